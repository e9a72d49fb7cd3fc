"""Prove a refactor is a pure move: the same fixture pipeline, run with a git ref's code and
with the working tree's code, must write byte-identical outputs.

    python bench/same_outputs.py --ref HEAD              # HEAD against the working tree
    python bench/same_outputs.py --ref main~3 --keep /tmp/same   # keep both output trees
    python bench/same_outputs.py --ref HEAD --tree /tmp/scratch  # another checkout as "tree"
    python bench/same_outputs.py --ref HEAD~1 --tree-ref HEAD    # two commits (others' edits aside)
    python bench/same_outputs.py --self                  # the tree twice: is it deterministic?

**Code.** Each side's code is laid out as the installed package would be: its ``setup.cfg``
``package_dir`` is read (``spar_bench.builder = builder`` ...) and the folders are copied into
one ``spar_bench/`` folder, which is put first on ``sys.path`` (the venv's editable install
comes after it). The ref's files come from ``git archive``; the tree's from the working folder
as it is (uncommitted edits included). The commands are the console scripts of that side's
``setup.cfg`` (``spar-build``, ``spar-probe``), one process per step. Both sides run one after
the other in the same temporary folders (same absolute paths, same cwd), so a recorded path
cannot differ by where it ran. The installed distribution (its version, its dependencies)
is the same for both sides; no output embeds a git commit (there is nothing to normalise).

**Pipeline** (CPU, about 1-2 min a side): a 6-case phantom; a build with mirrored
counterfactuals and a Levels 1+3 build of another seed; ``dummy``-encoder caches of both;
``fit`` of an ``mlp`` head (controls: blind, mirror, chance/majority/prior) and of a
``transformer`` token head; ``sweep``: 2 heads x 2 probes x 2 seeds in 1 process, an lr grid
x 2 seeds trained as one vmapped batch (``--batch-runs on``), and ``--grid-prune``; ``eval``
(transfer) of a fit run on the other build's cache; ``finetune`` of a tiny scratch ViT for 1
epoch with controls, and its ``eval`` re-encoding the other build; ``vqa`` with the ``dummy``
and the ``oracle`` models; ``report``. Both sides get the same argv, in today's CLI spelling
(``sweep --heads/--probes``): when an old spelling is removed, update :func:`steps`.

**Compared**: every file the steps write under ``runs/`` and ``report/`` (metrics.json,
config.json, eval-*.json, answers.jsonl, head.pt, exported encoders, the VQA response cache,
report.md/json and the PNG plots), byte for byte, and files present on one side only. One
field is normalised: ``images_per_s`` (a finetune run's measured throughput in
``train``, wall-clock, so it differs between any two runs); a JSON file that differs only
there counts as the same, and says so. The builds and caches are made by each side's own code
but not compared: they are inputs (a builder refactor has its own determinism tests);
``--compare-all`` compares them too. All of it was byte-identical between two runs of one
tree (``--self``), PNGs, checkpoints and SQLite included. Not covered: GPU code paths,
``--batch-runs on``, distributed caching, the ``hf:``/``openai:`` backends, real encoders.

Prints one line per file (same / DIFFERENT / only in ref / only in tree) and exits 1 on any
difference, 2 when a step fails or the ref is unknown.
"""

from __future__ import annotations

import argparse
import configparser
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: compared by default: the run and report folders
COMPARED_ROOTS = ("runs", "report")
#: JSON keys whose values are measured wall-clock rates (left out of the comparison; a finetune
#: run's metrics.json held images_per_s before it moved to timing.json)
VOLATILE_KEYS = frozenset({"images_per_s"})
#: files of measurements (wall-clock), not outputs: never compared
MEASURED_FILES = frozenset({"timing.json"})

TINY_VIT = {"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64}
L1, L2, L3A, L3B = "level1.localisation", "level2.arrangement", "level3.size", "level3.counting"


def steps() -> list[tuple[str, list[str]]]:
    """The fixture pipeline: (console script, argv), run in the work folder. ``glob:PATTERN``
    is the one path matching PATTERN there when the step starts (run folder names are the
    code's business, and the same on both sides if the outputs are)."""
    fast = ["--max-epochs", "2", "--bootstrap", "20"]
    finetune = ["finetune", "--encoder", "timm:vit_tiny_patch16_224", "--init", "scratch",
                "--model-args", json.dumps(TINY_VIT), "--data", "shards", "--probe", L3B,
                "--out", "runs/finetune", "--max-epochs", "1", "--batch-size", "16", "--device", "cpu",
                "--compute", "fp32", "--threads", "1", "--bootstrap", "20"]  # fmt: skip
    return [
        ("spar-build", ["phantom", "--out", "ph", "--n", "6", "--layout", "canonical"]),
        ("spar-build", ["--source", "phantom", "--root", "ph", "--out", "shards", "--samples-per-case",
                        "2", "--counterfactual", "mirror", "--no-hf", "--workers", "1"]),
        ("spar-build", ["--source", "phantom", "--root", "ph", "--out", "other", "--levels", "level1,level3",
                        "--samples-per-case", "1", "--seed", "1", "--no-hf", "--workers", "1"]),
        ("spar-probe", ["cache", "--encoder", "dummy", "--data", "shards", "--out", "cache/dummy.h5"]),
        ("spar-probe", ["cache", "--encoder", "dummy", "--data", "other", "--out", "cache/other.h5"]),
        ("spar-probe", ["fit", "--features", "cache/dummy.h5", "--head", "mlp", "--probe",
                        f"{L1},{L3A}", "--out", "runs/fit", *fast]),
        ("spar-probe", ["fit", "--features", "cache/dummy.h5", "--head", "transformer", "--probe",
                        f"{L2},{L3B}", "--out", "runs/fit", "--d-model", "16", "--n-layers", "1",
                        "--proj-dim", "16", *fast]),
        ("spar-probe", ["sweep", "--features", "cache/dummy.h5", "--heads", "linear,mlp", "--probes",
                        f"{L1},{L3B}", "--seeds", "0,1", "--jobs", "1", "--out", "runs/sweep", *fast]),
        ("spar-probe", ["sweep", "--features", "cache/dummy.h5", "--heads", "mlp", "--probes", L3A,
                        "--seeds", "0,1", "--grid", "lr=1e-3,3e-4", "--batch-runs", "on", "--jobs", "1",
                        "--out", "runs/batched", *fast]),
        ("spar-probe", ["sweep", "--features", "cache/dummy.h5", "--heads", "mlp", "--probes", L1,
                        "--grid", "lr=1e-3,3e-4", "--grid-prune", "1", "--jobs", "1", "--out",
                        "runs/pruned", *fast]),
        ("spar-probe", ["eval", "--run", f"glob:runs/fit/*/{L1}/mlp,*/seed0", "--features",
                        "cache/other.h5", "--bootstrap", "20"]),
        ("spar-probe", finetune),
        ("spar-probe", ["eval", "--run", f"glob:runs/finetune/*/{L3B}/*/seed0", "--data", "other",
                        "--bootstrap", "20"]),
        ("spar-probe", ["vqa", "--model", "dummy", "--data", "shards", "--out", "runs/vqa",
                        "--bootstrap", "20"]),
        ("spar-probe", ["vqa", "--model", "oracle", "--data", "shards", "--out", "runs/vqa",
                        "--bootstrap", "20"]),
        ("spar-probe", ["report", "runs", "--out", "report"]),
    ]


# -- each side's code ---------------------------------------------------------------------
def _setup_cfg(src: Path) -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(src / "setup.cfg")
    return cfg


def _lines(value: str) -> list[tuple[str, str]]:
    pairs = [line.split("=", 1) for line in value.strip().splitlines() if "=" in line]
    return [(a.strip(), b.strip()) for a, b in pairs]


def lay_out(src: Path, dest: Path) -> dict[str, str]:
    """Copy ``src``'s package folders into ``dest/spar_bench`` as setup.cfg maps them;
    return its console scripts (``{"spar-probe": "spar_bench.probes.cli:main"}``)."""
    cfg = _setup_cfg(src)
    mapping = sorted(_lines(cfg["options"]["package_dir"]), key=lambda kv: kv[0].count("."))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package, folder in mapping:
        target = dest.joinpath(*package.split("."))
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(src / folder, target, ignore=ignore)
    return dict(_lines(cfg["options.entry_points"]["console_scripts"]))


def export_ref(ref: str, dest: Path) -> None:
    """The ref's tracked files under ``dest`` (``git archive``: no worktree left behind)."""
    dest.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref],
                                 check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        print(f"error: git archive {ref}: {e.stderr.decode().strip()}", file=sys.stderr)
        raise SystemExit(2) from None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


# -- running one side -----------------------------------------------------------------------
LAUNCH = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib; "
          "mod, _, fn = sys.argv[2].partition(':'); sys.argv = sys.argv[2:]; "
          "sys.exit(getattr(importlib.import_module(mod), fn)())")


class StepFailed(Exception):
    pass


def resolve(argv: list[str], work: Path) -> list[str]:
    out = []
    for a in argv:
        if a.startswith("glob:"):
            hits = sorted(work.glob(a[5:]))
            if len(hits) != 1:
                raise StepFailed(f"{a[5:]} matches {len(hits)} paths in {work}, not one")
            a = hits[0].relative_to(work).as_posix()
        out.append(a)
    return out


def run_side(label: str, code: Path, scripts: dict[str, str], work: Path, log: Path) -> float:
    """Run every step with ``code`` first on sys.path, in ``work``; return seconds."""
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONDONTWRITEBYTECODE": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    check = ("import spar_bench.probes, spar_bench.builder, sys; "
             "sys.exit(0 if all(m.__file__.startswith(sys.argv[1]) for m in "
             "(spar_bench, spar_bench.probes, spar_bench.builder)) else 3)")
    if subprocess.run([sys.executable, "-c", check, str(code)], cwd=work, env=env).returncode:
        raise StepFailed(f"{label}: spar_bench does not import from {code}")
    start = time.monotonic()
    with log.open("a") as out:
        for script, argv in steps():
            argv = resolve(argv, work)
            t0 = time.monotonic()
            out.write(f"\n== {label}: {script} {' '.join(argv)}\n")
            out.flush()
            cmd = [sys.executable, "-c", LAUNCH, str(code), scripts[script], *argv]
            rc = subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
            print(f"  {label}: {script} {argv[0]:<10} rc={rc} {time.monotonic() - t0:5.1f} s", flush=True)
            if rc != 0:
                raise StepFailed(f"{label}: `{script} {' '.join(argv)}` exited {rc}")
    return time.monotonic() - start


# -- comparing -------------------------------------------------------------------------------
def files(root: Path, compare_all: bool) -> dict[str, Path]:
    tops = [root] if compare_all else [root / r for r in COMPARED_ROOTS]
    return {p.relative_to(root).as_posix(): p for top in tops for p in sorted(top.rglob("*"))
            if p.is_file() and p.name not in MEASURED_FILES}


def _without_volatile(obj, where: str, seen: set[str]):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in VOLATILE_KEYS:
                seen.add(f"{where}{k}")
            else:
                out[k] = _without_volatile(v, f"{where}{k}.", seen)
        return out
    if isinstance(obj, list):
        return [_without_volatile(v, where, seen) for v in obj]
    return obj


def same_but_volatile(a: Path, b: Path) -> str | None:
    """For two JSON files that differ: the volatile fields, when nothing else differs."""
    if a.suffix != ".json":
        return None
    try:
        ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
    except ValueError:
        return None
    seen: set[str] = set()
    if _without_volatile(ja, "", seen) != _without_volatile(jb, "", seen) or not seen:
        return None
    return ", ".join(sorted(seen))


def compare(a: Path, b: Path, compare_all: bool) -> tuple[list[tuple[str, str]], int]:
    """``[(file, verdict)]`` and the number of differences."""
    fa, fb = files(a, compare_all), files(b, compare_all)
    rows, bad = [], 0
    for name in sorted(fa.keys() | fb.keys()):
        if name not in fb:
            rows.append((name, "only in ref")); bad += 1  # noqa: E702
        elif name not in fa:
            rows.append((name, "only in tree")); bad += 1  # noqa: E702
        elif filecmp.cmp(fa[name], fb[name], shallow=False):
            rows.append((name, "same"))
        elif volatile := same_but_volatile(fa[name], fb[name]):
            rows.append((name, f"same (but {volatile})"))
        else:
            rows.append((name, "DIFFERENT")); bad += 1  # noqa: E702
    return rows, bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--ref", help="git ref whose code is the reference (e.g. HEAD, main~2)")
    side.add_argument("--self", action="store_true", help="run the tree twice (determinism)")
    tree = ap.add_mutually_exclusive_group()
    tree.add_argument("--tree", type=Path, default=REPO, help="checkout to compare (default: this one)")
    tree.add_argument("--tree-ref", help="compare this git ref's code instead of a checkout")
    ap.add_argument("--keep", type=Path, help="copy both output trees (ref/, tree/) and the log here")
    ap.add_argument("--compare-all", action="store_true", help="also compare builds, caches, binaries")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spar-same-") as tmp_:
        tmp = Path(tmp_)
        log = tmp / "steps.log"
        log.touch()
        code, work = tmp / "code", tmp / "work"  # the same paths for both sides
        if args.tree_ref:
            export_ref(args.tree_ref, tmp / "src-tree")
            args.tree = tmp / "src-tree"
        if args.ref:
            export_ref(args.ref, tmp / "src-ref")
            ref_src, ref_label = tmp / "src-ref", f"ref {args.ref}"
        else:
            ref_src, ref_label = args.tree, "tree (1st run)"
        seconds = {}
        try:
            for label, src, name in ((ref_label, ref_src, "ref"), ("tree", args.tree, "tree")):
                scripts = lay_out(src, code)
                seconds[name] = run_side(label, code, scripts, work, log)
                work.rename(tmp / f"out-{name}")
                shutil.rmtree(code)
        except StepFailed as e:
            print("".join(log.read_text().splitlines(keepends=True)[-15:]), file=sys.stderr)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(log, args.keep / "steps.log")
            print(f"error: {e} (its output above{'; the log in --keep' if args.keep else ''})",
                  file=sys.stderr)
            return 2
        rows, bad = compare(tmp / "out-ref", tmp / "out-tree", args.compare_all)
        width = max(len(n) for n, _ in rows)
        for name, verdict in rows:
            print(f"{name:<{width}}  {verdict}")
        print(f"\n{len(rows) - bad} same, {bad} different; "
              f"{ref_label}: {seconds['ref']:.0f} s, tree: {seconds['tree']:.0f} s")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for name in ("ref", "tree"):
                shutil.copytree(tmp / f"out-{name}", args.keep / name, dirs_exist_ok=True)
            shutil.copy(log, args.keep / "steps.log")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
