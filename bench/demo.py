"""The demo's stage table: where ``spar-bench run experiments/demo.yaml`` spends its time.

    python bench/demo.py                        # the demo into a temp folder, every stage timed
    python bench/demo.py --json demo-stages.json --keep /tmp/demo
    python bench/demo.py --set N_CASES=4 --no-bare   # smaller, without the bare forward

Each step of the plan (``--list``) runs as its own ``spar-bench run EXP --only STEP`` process,
timed with ``os.wait4``: wall seconds, CPU seconds (user + system, the process and its
workers) and peak RSS; beside them the step's own seconds from the run's log
(``OUT/.plan/log.jsonl``, the runner's record; the process's wall also counts Python's
imports). Then the whole job is run again (every step done: the rerun's time), and
``--dry-run``'s estimate is compared with the measured total.

Beside each cache: the encoder's bare forward on this machine (random uint8 batches of 224 px,
the cache's batch size and compute precision, the encoder as the cache loads it), in fresh
processes: 1 process x 1 thread contiguous and channels-last, 1 process x all threads,
and one 1-thread process per core side by side (summed). Then the cache alone, as the step
writes it (``write_cache``, the encoder loaded by it), in a fresh process with 1 process and
with one per core: its images per second in its encoding loop (a Stopwatch's main-loop stages:
what the bare forward times, no imports, no weights loading) and over the whole call,
and its sha256 (the same bytes whatever the number of processes). ``cache / bare`` is the
cache alone on all cores (the median of ``--pace-repeats`` runs) over the best bare forward;
beside it the step's own pace (the log's seconds: imports, weights and start-up included) and
per CPU-second.

On a shared machine only the CPU seconds mean much; the wall times are an idle machine's only
when nothing else runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "experiments" / "demo.yaml"


def timed_run(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd``; its wall and CPU seconds and peak RSS (MiB) from ``os.wait4``."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.stderr.write(out.decode(errors="replace")[-3000:])
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mib": ru.ru_maxrss / 1024,
            "output": out.decode(errors="replace")}


#: ``spar-bench`` of this interpreter's spar_bench (a venv's entry point may be another's)
SPAR_BENCH = [sys.executable, "-m", "spar_bench.experiments.cli"]


def run_args(exp: Path, out: Path, sets: list[str]) -> list[str]:
    return [str(exp), "--set", f"OUT={out}", *[x for s in sets for x in ("--set", s)]]


def logged_seconds(out: Path) -> dict[str, float]:
    """Each finished step's seconds as the runner logged them."""
    found = {}
    for line in (out / ".plan" / "log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "finish":
            found[rec["step"]] = rec["seconds"]
    return found


def load_plan(exp: Path, out: Path, sets: list[str]):
    """The experiment's plan, as ``spar-bench run`` makes it."""
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    return make_plan(load_experiment(exp, {"OUT": str(out), **dict(s.split("=", 1) for s in sets)}))


def estimates(plan) -> dict[str, float]:
    """Each step's estimated seconds on 2 CPU cores (what ``--dry-run`` prints)."""
    from spar_bench.experiments.estimate import step_seconds

    return {s.id: step_seconds(plan, s)[0] for s in plan.steps}


# -- the bare forward ------------------------------------------------------------------
def bare_worker(spec: str, random_init: bool, layout: str, threads: int, compute: str, batch: int,
                seconds: float) -> tuple[float, float]:
    """Images per second and per CPU-second of the encoder's forward alone in this process
    (``threads`` torch threads)."""
    import torch

    from spar_bench.probes.encoders import load_encoder

    torch.set_num_threads(threads)
    enc = load_encoder(spec, random_init=random_init)
    if layout == "channels_last":
        enc.prefer_channels_last()
    amp = {"bf16": torch.bfloat16}.get(compute)
    x = torch.randint(0, 256, (batch, 224, 224), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    with torch.no_grad(), torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
        for _ in range(2):
            enc(x, [-1])
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds or n < 2:
            enc(x, [-1])[-1][0].float()
            n += 1
    return n * batch / (time.perf_counter() - t0), n * batch / (time.process_time() - c0)


def bare(spec: str, random_init: bool, compute: str, batch: int, seconds: float, cores: int) -> dict[str, list]:
    """The bare forward in fresh processes, several ways: ``[images/s, images per CPU-s]`` of each
    (side by side: summed)."""
    base = [sys.executable, __file__, "--bare-worker", spec, "--random-init", str(int(random_init)),
            "--compute", compute, "--batch", str(batch), "--seconds", str(seconds)]

    def start(layout: str, threads: int) -> subprocess.Popen:
        return subprocess.Popen([*base, "--layout", layout, "--threads", str(threads)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    def rate(procs: list[subprocess.Popen]) -> list[float]:
        each = [[float(v) for v in p.communicate()[0].strip().splitlines()[-1].split()] for p in procs]
        return [sum(e[0] for e in each), sum(e[1] for e in each) / len(each)]

    ways = {"1 proc x 1 thread, contiguous": ("contiguous", 1, 1),
            "1 proc x 1 thread, channels_last": ("channels_last", 1, 1),
            f"1 proc x {cores} threads, channels_last": ("channels_last", cores, 1),
            f"{cores} procs x 1 thread, channels_last": ("channels_last", 1, cores)}
    return {name: rate([start(layout, t) for _ in range(n)]) for name, (layout, t, n) in ways.items()}


# -- the cache alone, 1 process and all cores: its pace and its bytes ----------------------
def cache_worker(spec: str, random_init: bool, build: str, out: str, processes: int | None) -> dict:
    """Write the cache of ``spec`` over ``build`` as the demo's step does (its options, the
    encoder loaded by ``write_cache``), in this fresh process: total seconds, the encoding
    loop's seconds (the main loop's stages of a :class:`~spar_bench.probes.stopwatch.Stopwatch`:
    from the first batch read to the last written, the other processes' batches waited for
    included), the images, CPU seconds of this process and its children, sha256."""
    import resource

    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.stopwatch import STAGES, Stopwatch

    images, sw = [0], Stopwatch()
    t0 = time.perf_counter()
    write_cache(spec, build, out, CacheOptions(device="cpu", processes=processes, random_init=random_init),
                progress=False, stopwatch=sw, on_batch=lambda lv, sp, lo, hi: images.__setitem__(0, images[0] + hi - lo))
    total = time.perf_counter() - t0
    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return {"total_s": total, "loop_s": sum(v for k, v in sw.seconds.items() if STAGES.get(k) == "main"),
            "images": images[0], "cpu_s": sum(r.ru_utime + r.ru_stime for r in ru),
            "sha256": hashlib.sha256(Path(out).read_bytes()).hexdigest()}


def cache_pace(build: Path, spec: str, random_init: bool, tmp: Path, cores: int, repeats: int = 3) -> dict:
    """The cache with 1 process and with one per core, each ``repeats`` times in a fresh process
    (as a step runs it), the median run kept (a 500-image cache's loop is a few batches of a
    second each per process: which one ends last moves it by 10 %): ``loop_img_s`` = its images
    over its encoding loop's seconds (what the bare forward times: no imports, no weights
    loading); ``whole_img_s`` = over the whole call; ``loop_img_s_all``: every repeat's."""
    runs, sums = {}, set()
    for n in (1, cores):
        got = []
        for r in range(repeats):
            out = tmp / f"pace-{n}-{r}.h5"
            cmd = [sys.executable, __file__, "--cache-worker", spec, "--random-init", str(int(random_init)),
                   "--build", str(build), "--out", str(out), "--processes", str(n)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            got.append({**res, "loop_img_s": res["images"] / max(res["loop_s"], 1e-9),
                        "whole_img_s": res["images"] / res["total_s"]})
            sums.add(res["sha256"])
            out.unlink()
        got.sort(key=lambda x: x["loop_img_s"])
        runs[n] = {**got[len(got) // 2], "loop_img_s_all": [x["loop_img_s"] for x in got]}
    return {"runs": runs, "identical": len(sums) == 1}


# -- the table ---------------------------------------------------------------------------
def table(rows: list[dict], total: dict) -> str:
    lines = ["| stage | wall s | CPU s | CPU share | step s (log) | estimate s | peak RSS MiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    cpu_all = sum(r["cpu_s"] for r in rows) or 1.0
    for r in rows:
        lines.append(f"| {r['step']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {100 * r['cpu_s'] / cpu_all:.0f} % | "
                     f"{r.get('log_s', float('nan')):.1f} | {r.get('estimate_s', float('nan')):.0f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    lines.append(f"| **all steps** | {sum(r['wall_s'] for r in rows):.1f} | {cpu_all:.1f} | 100 % | "
                 f"{sum(r.get('log_s', 0.0) for r in rows):.1f} | {sum(r.get('estimate_s', 0.0) for r in rows):.0f} | "
                 f"{max(r['peak_rss_mib'] for r in rows):.0f} |")
    lines.append(f"| rerun (all done) | {total['wall_s']:.1f} | {total['cpu_s']:.1f} | | | | {total['peak_rss_mib']:.0f} |")
    return "\n".join(lines)


def cache_steps(plan, out: Path) -> list[tuple[str, str, bool, int, int]]:
    """(step, encoder spec, random_init, images, batch) of each cache step of ``plan`` run into
    ``out``: its images are the rows of the cache it wrote (the plan's cost is an estimate)."""
    import h5py

    from spar_bench.probes.cache import CacheOptions

    found = []
    for s in plan.steps:
        if s.kind == "cache":
            spec = s.specs[-1][1]
            batch = int(spec["options"].get("batch_size", CacheOptions.batch_size))
            with h5py.File(spec["out"].replace("{out}", str(out)), "r") as f:
                rows = sum(g[sp]["done"].shape[0] for g in f.values() if isinstance(g, h5py.Group)
                           for sp in g if isinstance(g[sp], h5py.Group) and "done" in g[sp])
            found.append((s.id, spec["encoder"], bool(spec.get("random_init")), rows, batch))
    return found


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default=str(DEMO))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--keep", default=None, help="run into this folder (kept) instead of a temp one")
    ap.add_argument("--no-bare", dest="bare", action="store_false", help="skip the bare forward")
    ap.add_argument("--no-pace", dest="pace", action="store_false",
                    help="skip the cache alone with 1 process and one per core (its pace and its bytes)")
    ap.add_argument("--bare-seconds", type=float, default=8.0)
    ap.add_argument("--pace-repeats", type=int, default=3, help="runs of the cache alone per process count (median kept)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--bare-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--build", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--random-init", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="channels_last", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--compute", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=8.0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.bare_worker:
        print(*bare_worker(a.bare_worker, a.random_init == "1", a.layout, a.threads, a.compute, a.batch, a.seconds))
        return 0
    if a.cache_worker:
        print(json.dumps(cache_worker(a.cache_worker, a.random_init == "1", a.build, a.out, a.processes)))
        return 0
    import torch

    from spar_bench.probes.cache import usable_cores
    from spar_bench.probes.hardware import pick_compute

    exp = Path(a.experiment)
    cores = usable_cores()
    compute = pick_compute("auto", torch.device("cpu"))
    with tempfile.TemporaryDirectory(prefix="spar-bench-demo-") as tmp:
        out = Path(a.keep) if a.keep else Path(tmp) / "demo"
        plan = load_plan(exp, out, a.sets)
        est = estimates(plan)
        rows = []
        for step in [s.id for s in plan.steps]:
            r = timed_run([*SPAR_BENCH, "run", *run_args(exp, out, a.sets), "--only", step])
            rows.append({"step": step, "estimate_s": est[step], **{k: v for k, v in r.items() if k != "output"}})
            print(f"{step}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} CPU-s", flush=True)
        logged = logged_seconds(out)
        for r in rows:
            r["log_s"] = logged.get(r["step"], float("nan"))
        rerun = timed_run([*SPAR_BENCH, "run", *run_args(exp, out, a.sets)])
        report = {"cores": cores, "compute": {"dtype": compute.dtype, "reason": compute.reason},
                  "steps": rows, "rerun": {k: v for k, v in rerun.items() if k != "output"},
                  "estimate_s": sum(est.values()), "caches": []}
        for step, enc, random_init, images, batch in cache_steps(plan, out):
            r = next(x for x in rows if x["step"] == step)
            report["caches"].append(compare_cache(a, r, rerun, (step, enc, random_init, images, batch), compute.dtype,
                                                  cores, out / "builds" / "shards", Path(tmp)))
    print_report(report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def compare_cache(a, row: dict, rerun: dict, step: tuple, compute: str, cores: int, build: Path, tmp: Path) -> dict:
    """One cache step beside the bare forward: the step's pace (its log's seconds; per CPU-s
    less a ``spar-bench run`` that does nothing, the rerun's), the cache alone
    (:func:`cache_pace`) and the ratios to the best bare forward."""
    name, enc, random_init, images, batch = step
    log_s = row["log_s"] if row["log_s"] == row["log_s"] and row["log_s"] else None
    c = {"step": name, "encoder": enc, "random_init": random_init, "images": images,
         "cache_img_s": images / log_s if log_s else None,
         "cache_img_cpu_s": images / max(row["cpu_s"] - rerun["cpu_s"], 1e-9)}
    if a.pace:
        c["pace"] = cache_pace(build, enc, random_init, tmp, cores, a.pace_repeats)
    if a.bare:
        c["bare"] = bare(enc, random_init, compute, batch, a.bare_seconds, cores)
        best = max(v[0] for v in c["bare"].values())
        best_cpu = max(v[1] for v in c["bare"].values())
        c.update(best_bare_img_s=best, ratio_step=(c["cache_img_s"] or 0.0) / best,
                 best_bare_img_cpu_s=best_cpu, ratio_cpu=c["cache_img_cpu_s"] / best_cpu)
        if a.pace:
            c["ratio"] = c["pace"]["runs"][cores]["loop_img_s"] / best
    return c


def print_report(rep: dict) -> None:
    print(f"\n{rep['cores']} cores; --compute auto: {rep['compute']['dtype']} ({rep['compute']['reason']})\n")
    print(table(rep["steps"], rep["rerun"]))
    total_wall = sum(r["wall_s"] for r in rep["steps"])
    print(f"\nplan estimate (2 CPU cores): {rep['estimate_s']:.0f} s; measured {total_wall:.0f} s wall "
          f"(estimate / measured {rep['estimate_s'] / total_wall:.2f})")
    for c in rep["caches"]:
        print(f"\n{c['step']}: {c['images']} images, cache {c['cache_img_s'] or float('nan'):.1f} img/s "
              f"(its step), {c['cache_img_cpu_s']:.1f} img per CPU-s")
        for way, (v, cpu) in c.get("bare", {}).items():
            print(f"  bare forward, {way}: {v:.1f} img/s, {cpu:.1f} img per CPU-s")
        for n, p in c.get("pace", {}).get("runs", {}).items():
            print(f"  the cache alone, --processes {n}: {p['loop_img_s']:.1f} img/s in its encoding loop "
                  f"({p['loop_s']:.1f} s; median of {' / '.join(f'{v:.1f}' for v in p['loop_img_s_all'])}), "
                  f"{p['whole_img_s']:.1f} img/s over the whole call ({p['total_s']:.1f} s, {p['cpu_s']:.1f} CPU-s)")
        if "pace" in c:
            print(f"  cache with --processes 1 vs {max(c['pace']['runs'])}: "
                  f"{'byte-identical' if c['pace']['identical'] else 'DIFFERENT'} "
                  f"(sha256 {' / '.join(p['sha256'][:12] for p in c['pace']['runs'].values())})")
        if "ratio" in c:
            print(f"  cache / best bare forward, all cores: {c['ratio']:.2f} (the cache alone, its encoding loop; "
                  f"an idle machine's only)")
        if "ratio_step" in c:
            print(f"  the step / best bare forward: {c['ratio_step']:.2f} in wall time (imports, weights, "
                  f"start-up included), {c['ratio_cpu']:.2f} per CPU-s")


if __name__ == "__main__":
    sys.exit(main())
