"""One GPU bench that makes its own data: issue 25's table on a bare GPU machine.

    python bench/gpu.py                                  # one GPU: WORD-sized phantom, about 6-8 min
    python bench/gpu.py --quick --device cpu             # smoke run: 4 cases, tiny models, ~1 min

It needs torch, timm, h5py, numpy and scipy, and nibabel for the phantom's NIfTI files
(pure Python: ``pip install nibabel``, or put its wheel, ``nibabel-*-py3-none-any.whl``, in
``--wheels DIR`` and it is imported from there). Not datasets, hdf5plugin or SimpleITK: the
build is ``--no-hf`` with gzip shards. In a work folder (``--work``, default a temporary one)
it

1. writes the WORD-sized phantom (``spar-build phantom --n 150 --jobs <cores>``) and builds it
   (32 mosaics per case, mirrored counterfactuals, ``--no-hf``, gzip: 26,558 images);
2. caches the whole build with random-init ResNet-50 and ViT-B/32, each against the bare bf16
   forward (``bench/cache.py``), with where the time goes;
3. trains ResNet-50 at batch 128 against the bare forward+backward+step (``bench/finetune.py``),
   with where the time goes;
4. caches the build with ResNet-18 and runs the WORD-sized sweep (8 probes x {mlp,
   transformer} x 3 seeds, defaults) for at most ``--sweep-limit`` seconds, counting the runs
   done;
5. caches Level 3 with a ViT-B/14 at 518 px (RadDINO's token count, 1 + 37 x 37 x 768) under
   each token storage option, and gives each one's size for a WORD-sized build (26,558
   images) and the cache/bare ratio of the first option;

and prints one Markdown table: measure | value | target. ``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import cache as cache_bench  # noqa: E402
import finetune as finetune_bench  # noqa: E402
from token_storage import parse_storage  # noqa: E402

#: images of the WORD-sized build (150 canonical phantom cases, 32 mosaics per case, mirrors)
WORD_IMAGES = 26_558
#: a RadDINO-like encoder: a ViT-B/14 whose timm default input is 518 px (1 + 37 x 37 tokens, 768 dims)
RADDINO_LIKE = "timm:vit_base_patch14_dinov2"


@dataclass(frozen=True)
class Plan:
    """What one bench run does: the full GPU run or the ``--quick`` smoke run."""

    cases: int
    samples_per_case: int
    encoders: tuple[str, str]
    cache_batch: int
    bare_iters: int
    finetune: tuple[str, int, int]  # encoder, batch, batches timed
    sweep_encoder: str
    sweep_args: tuple[str, ...]
    storage_model_args: dict | None
    storages: tuple[str, ...]
    phantom_args: tuple[str, ...] = ()  # the phantom's grid (--quick: a small one)


FULL = Plan(150, 32, ("timm:resnet50", "timm:vit_base_patch32_224"), 256, 20, ("timm:resnet50", 128, 20),
            "timm:resnet18", ("--head", "mlp,transformer", "--probe", "all", "--seeds", "0,1,2"), None,
            ("grid:14", "grid:14+int8", "grid:7", "grid:14+pca:256"))
QUICK = Plan(4, 1, ("timm:resnet10t", "timm:vit_tiny_patch16_224"), 16, 4, ("timm:resnet10t", 8, 2),
             "timm:resnet10t", ("--head", "mlp", "--probe", "level3.size", "--seeds", "0", "--max-epochs", "2",
                                "--bootstrap", "20", "--no-controls", "--jobs", "1"),
             {"depth": 1, "embed_dim": 48, "num_heads": 2},
             ("grid:14", "grid:7+int8"), ("--in-plane", "96", "--slices", "16"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 cases, tiny models (CPU, ~1 min)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cpu or auto")
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build processes (default: all cores)")
    ap.add_argument("--workers", type=int, default=None,
                    help="DataLoader workers (default: 8 for caches and 4 for finetuning on CUDA, 0 on CPU)")
    ap.add_argument("--sweep-limit", type=float, default=None,
                    help="seconds the sweep may run before it is stopped (default: 240; --quick: 300)")
    ap.add_argument("--wheels", type=Path, default=ROOT / "bench" / "wheels",
                    help="folder with a nibabel wheel, used when nibabel is not installed")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    return ap.parse_args(argv)


#: pure-Python packages a bare GPU machine may lack, taken from ``--wheels`` then
PURE_WHEELS = ("nibabel", "click")
#: the project's folders mapped into the ``spar_bench`` package (setup.cfg ``package_dir``)
PACKAGE_DIRS = ("builder", "probes", "manifests", "experiments")


def importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def wheel_paths(wheels: Path) -> list[str]:
    """The wheels in ``wheels`` of the :data:`PURE_WHEELS` that do not import; one line when one lacks."""
    out = []
    for name in (m for m in PURE_WHEELS if not importable(m)):
        found = sorted(wheels.glob(f"{name}-*-py3-none-any.whl")) if wheels.is_dir() else []
        if not found:
            raise SystemExit(f"bench/gpu.py: {name} is not installed and {wheels} holds no {name} wheel; "
                             f"`pip install {name}` (pure Python) or put {name}-*-py3-none-any.whl there")
        out.append(str(found[-1]))
    return out


def package_path(work: Path) -> list[str]:
    """``[]`` when ``spar_bench`` is installed; else a folder that maps it as setup.cfg does (symlinks)."""
    if importable("spar_bench.probes"):
        return []
    sys.modules.pop("spar_bench", None)  # a parent found without its mapped folders is imported again
    pkg = work / "src" / "spar_bench"
    pkg.mkdir(parents=True, exist_ok=True)
    for src in [*(ROOT / "spar_bench").iterdir(), *(ROOT / d for d in PACKAGE_DIRS)]:
        link = pkg / src.name
        if not link.exists() and src.name != "__pycache__":
            link.symlink_to(src)
    return [str(pkg.parent)]


def run_cli(module: str, args: list[str], env: dict[str, str], timeout: float = 3600) -> float:
    """``python -m module args`` in its own process; its wall seconds. A failure ends the bench in one line."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"bench/gpu.py: {module} {args[0]} failed (exit {r.returncode}): {last}")
    return time.perf_counter() - t0


def make_build(work: Path, plan: Plan, jobs: int, env: dict[str, str]) -> tuple[Path, dict]:
    """The phantom and its build; their wall times."""
    phantom, build = work / "phantom", work / "build"
    t_ph = run_cli("spar_bench.builder.cli", ["phantom", "--out", str(phantom), "--n", str(plan.cases),
                                              *plan.phantom_args, "--jobs", str(jobs), "--overwrite"], env)
    t_b = run_cli("spar_bench.builder.cli", ["--source", "phantom", "--root", str(phantom), "--out", str(build),
                                             "--samples-per-case", str(plan.samples_per_case),
                                             "--counterfactual", "mirror", "--no-hf", "--compression", "gzip",
                                             "--jobs", str(jobs), "--overwrite"], env)
    return build, {"phantom_s": t_ph, "build_s": t_b}


def quiet(fn, *args, **kw):
    """``fn(*args, **kw)`` with its prints kept out of the table (returned second)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = fn(*args, **kw)
    return out, buf.getvalue()


def cache_rows(build: Path, plan: Plan, a: argparse.Namespace, device, compute: str, work: Path) -> list[dict]:
    """bench/cache.py's measurement of both encoders over the whole build (one repeat each)."""
    from spar_bench.builder.shards import Build

    ca = cache_bench.parse_args(["--batch", str(plan.cache_batch), "--iters", str(plan.bare_iters),
                                 "--repeats", "1", *(["--workers", str(a.workers)] if a.workers is not None else [])])
    levels = Build(build).levels()
    return [quiet(cache_bench.measure_encoder, name, ca, build, levels, device, compute, work)[0]
            for name in plan.encoders]


def finetune_row(build: Path, plan: Plan, a: argparse.Namespace, work: Path) -> dict:
    enc, batch, batches = plan.finetune
    out = work / "finetune.json"
    args = ["--data", str(build), "--encoder", enc, "--batch", str(batch), "--batches", str(batches),
            "--probe", "level3.size", "--device", a.device, "--json", str(out), "--workers", str(a.finetune_workers)]
    quiet(finetune_bench.main, args)
    return json.loads(out.read_text(encoding="utf-8"))


def sweep_row(build: Path, plan: Plan, a: argparse.Namespace, env: dict[str, str], work: Path) -> dict:
    """The sweep's cache, then the sweep for at most ``--sweep-limit`` s: runs done of all, wall."""
    from spar_bench.probes.cache import CacheOptions, write_cache

    feats = work / "sweep.h5"
    t0 = time.perf_counter()
    write_cache(plan.sweep_encoder, build, feats, CacheOptions(device=a.device, batch_size=plan.cache_batch,
                                                               random_init=True, loader_workers=a.workers,
                                                               overwrite=True), progress=False)
    cache_s = time.perf_counter() - t0
    common = ["sweep", "--features", str(feats), "--data", str(build), "--out", str(work / "runs"), *plan.sweep_args,
              "--device", a.device]
    listed = subprocess.run([sys.executable, "-m", "spar_bench.probes.cli", *common, "--list"], env=env,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        raise SystemExit(f"bench/gpu.py: sweep --list failed: {(listed.stderr.strip().splitlines() or ['?'])[-1]}")
    total = len([ln for ln in listed.stdout.splitlines() if ln.strip()])
    limit = a.sweep_limit if a.sweep_limit is not None else (300.0 if a.quick else 240.0)
    wall, finished = timed_process([sys.executable, "-m", "spar_bench.probes.cli", *common], env, limit,
                                   work / "sweep.log")
    done = len(list((work / "runs").rglob("metrics.json")))
    return {"cache_s": cache_s, "runs": total, "done": done, "wall_s": wall, "finished": finished, "limit_s": limit}


def timed_process(cmd: list[str], env: dict[str, str], limit: float, log: Path) -> tuple[float, bool]:
    """Run ``cmd`` for at most ``limit`` s (then stop its process group); ``(wall s, finished)``."""
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return time.perf_counter() - t0, False
    if rc != 0:
        raise SystemExit(f"bench/gpu.py: the sweep failed (exit {rc}); see {log}")
    return time.perf_counter() - t0, True


def storage_rows(build: Path, plan: Plan, a: argparse.Namespace, device, compute: str, work: Path) -> dict:
    """Level 3 cached by the RadDINO-like ViT under each storage option: bytes per image, and the
    first option's cache img/s against the bare forward (both bf16 where the device has it)."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.encoders import load_encoder

    enc = load_encoder(RADDINO_LIKE, random_init=True, model_kwargs=plan.storage_model_args)
    enc.to(device)
    b = Build(build)
    n = sum(b.count("level3", s) for s in b.splits("level3"))
    spec = enc.spec
    out = {"encoder": RADDINO_LIKE, "tokens": spec.n_tokens, "dim": spec.dim, "images": n,
           "full_bytes_per_image": spec.n_tokens * spec.dim * 2, "storages": {}}
    bare = cache_bench.bare_throughput(enc, device, compute, plan.cache_batch, plan.bare_iters)
    for i, name in enumerate(plan.storages):
        path = work / "storage.h5"
        t0 = time.perf_counter()
        write_cache(RADDINO_LIKE, build, path, CacheOptions(levels=["level3"], device=str(device),
                                                            batch_size=plan.cache_batch, compute=compute,
                                                            loader_workers=a.workers, overwrite=True,
                                                            token_storage=parse_storage(name)),
                    encoder_obj=enc, progress=False)
        seconds = time.perf_counter() - t0
        out["storages"][name] = {"bytes_per_image": path.stat().st_size / n, "img_s": n / seconds}
        if i == 0:
            out["first_ratio"], out["bare_img_s"] = n / seconds / bare, bare
        path.unlink()
    return out


def shares(stages: list) -> str:
    """A breakdown in one cell: main-loop shares of the wall, then the reader and writer seconds."""
    main = [f"{s} {100 * share:.0f}%" for s, where, _, share in stages if where == "main" and share >= 0.005]
    side = [f"{s} {sec:.1f} s" for s, where, sec, _ in stages if where != "main" and sec >= 0.05]
    return ", ".join(main) + (f" (background: {', '.join(side)})" if side else "")


def table(res: dict, plan: Plan) -> list[tuple[str, str, str]]:
    """The rows: measure, value, target (issue 25's table)."""
    rows = []
    for r in res["cache"]:
        rows.append((f"cache {r['encoder']}, {res['images']} images, batch {plan.cache_batch}",
                     f"{r['cache_img_s']:,.0f} vs {r['bare_img_s']:,.0f} img/s bare: **{r['ratio']:.2f}**", ">= 0.9"))
        rows.append((f"  where the time goes (a timed run, {r['breakdown']['wall_s']:.1f} s)",
                     shares(r["breakdown"]["stages"]), "-"))
        if "writer_speedup" in r:
            on, off = r["peak_memory_mib"], r["peak_memory_sync_mib"]
            rows.append(("  writer thread on vs off (async_writes=False: the same file)",
                         f"{r['cache_img_s']:,.0f} vs {r['cache_sync_img_s']:,.0f} img/s: x{r['writer_speedup']:.2f}; "
                         + ", ".join(f"{k} {on[k]:,.0f} vs {off[k]:,.0f} MiB" for k in on), "-"))
    f = res["finetune"]
    rows.append((f"finetune {f['encoder']}, batch {f['batch']}, {f['probe']}",
                 f"{f['finetune_img_s']:,.0f} vs {f['bare_img_s']:,.0f} img/s fwd+bwd+step: "
                 f"**{f['ratio_finetune_over_bare']:.2f}**", ">= 0.85"))
    rows.append((f"  where the time goes (a timed epoch, {f['breakdown']['wall_s']:.1f} s)",
                 shares(f["breakdown"]["stages"]), "-"))
    s = res["sweep"]
    rows.append((f"sweep ({res['cases']}-case phantom, {plan.sweep_encoder} cache of {res['images']} images in "
                 f"{s['cache_s']:.0f} s, {' '.join(plan.sweep_args)})",
                 f"**{s['done']} of {s['runs']} runs in {s['wall_s']:.0f} s**"
                 + ("" if s["finished"] else f", then stopped (limit {s['limit_s']:.0f} s)"), "whole sweep < 60 s"))
    rows.append((f"spar-build phantom --n {res['cases']} --jobs {res['jobs']}", f"{res['phantom_s']:.1f} s",
                 "uses the cores"))
    rows.append((f"build ({res['cases']} cases, mirrors, gzip, --no-hf, --jobs {res['jobs']})",
                 f"{res['build_s']:.1f} s, {res['images']} images", "-"))
    t = res["storage"]
    word = lambda bpi: f"{bpi * WORD_IMAGES / 1e9:.1f} GB"  # noqa: E731
    rows.append((f"token cache of {WORD_IMAGES:,} images, {t['encoder']} ({t['tokens']} x {t['dim']}), full fp16",
                 word(t["full_bytes_per_image"]), "< 8 GB"))
    for name, v in t["storages"].items():
        rows.append((f"  {storage_flags(name)} (measured on {t['images']} Level 3 images)",
                     f"{word(v['bytes_per_image'])} ({v['bytes_per_image'] / t['full_bytes_per_image']:.3f} x full)",
                     "< 8 GB"))
    first = next(iter(t["storages"]))
    rows.append((f"  cache with {first} vs bare forward", f"{t['storages'][first]['img_s']:,.0f} vs "
                 f"{t['bare_img_s']:,.0f} img/s: **{t['first_ratio']:.2f}**", ">= 0.9"))
    return rows


def storage_flags(name: str) -> str:
    """``"grid:14+int8"`` -> ``"--token-grid 14 --token-int8"`` (spar-probe cache's flags)."""
    flags = {"grid": "--token-grid {}", "pca": "--token-proj pca:{}", "random": "--token-proj random:{}"}
    return " ".join("--token-int8" if p == "int8" else flags[p.split(":")[0]].format(p.split(":")[1])
                    for p in name.split("+"))


def print_table(rows: list[tuple[str, str, str]], header: str) -> None:
    print(header)
    print("\n| measure | value | target |\n|---|---|---|")
    for m, v, t in rows:
        print(f"| {m} | {v} | {t} |")


def environment(a: argparse.Namespace, work: Path) -> dict[str, str]:
    """This process's path and its subprocesses' environment: the project without an install
    (:func:`package_path`) and nibabel/click from ``--wheels`` when they are not installed."""
    env = dict(os.environ)
    extra = [*package_path(work), *wheel_paths(a.wheels)]
    sys.path[:0] = extra
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*extra, env.get("PYTHONPATH")]))
    return env


def run(a: argparse.Namespace, work: Path, env: dict[str, str]) -> dict:
    import torch

    from spar_bench.builder.shards import Build
    from spar_bench.probes.hardware import pick_compute, pick_device

    plan = QUICK if a.quick else FULL
    device = pick_device(a.device)
    a.finetune_workers = a.workers if a.workers is not None else 4 if device.type == "cuda" else 0
    if a.workers is None:
        a.workers = 8 if device.type == "cuda" else 0
    compute = pick_compute("auto", device).dtype
    build, times = make_build(work, plan, a.jobs, env)
    b = Build(build)
    res = {"quick": a.quick, "device": str(device), "compute": compute, "cases": plan.cases, "jobs": a.jobs,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "images": sum(b.count(lv, s) for lv in b.levels() for s in b.splits(lv)), **times}
    res["cache"] = cache_rows(build, plan, a, device, compute, work)
    res["finetune"] = finetune_row(build, plan, a, work)
    res["sweep"] = sweep_row(build, plan, a, env, work)
    res["storage"] = storage_rows(build, plan, a, device, compute, work)
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spar-bench-gpu-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        res = run(a, work, environment(a, work))
    res["total_s"] = time.perf_counter() - t0
    plan = QUICK if a.quick else FULL
    print_table(table(res, plan), f"bench/gpu.py{' --quick' if a.quick else ''}: {res['gpu'] or res['device']}, "
                f"compute {res['compute']}, {os.cpu_count()} cores, {res['total_s']:.0f} s in all")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
