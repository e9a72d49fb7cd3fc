"""Benchmark spreading work: 2 workers/ranks/partitions against 1, measured side by side.

    python bench/scale.py                       # phantom of 16 cases, resnet18 random init
    python bench/scale.py --cases 40 --encoder timm:resnet50 --images 600

For each stage it runs the one-process way and the spread way on the same inputs, in one
run, checks that both give the same result, and prints wall seconds and the speed-up:

* build: ``--workers 1`` vs ``--workers 2``; and 2 partitions run at once + ``merge``
  (shards byte-identical, compared by fingerprint);
* cache: one process vs ``torchrun --nproc_per_node 2`` (CPU, gloo), one torch thread per
  process in both (the largest array difference is printed: 0 means identical);
* sweep: ``--jobs 1`` vs ``--jobs 2`` over the same runs (same metrics).

Every command is a real CLI call in a subprocess (start-up included, as a user pays it).
Peak RSS is the largest of any child process. On a machine whose cores are busy with other
work the speed-ups are lower bounds; the script prints the load average it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list, env: dict | None = None) -> float:
    """Wall seconds of one command (raises with its stderr tail on failure)."""
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, encoding="utf-8", errors="replace", env=env)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def fingerprint(build: Path) -> str:
    return json.loads((build / "manifest.json").read_text())["fingerprint"]


def bench_build(tmp: Path, n_cases: int) -> dict:
    ph = tmp / "ph"
    run(["spar-build", "phantom", "--out", ph, "--n", n_cases, "--layout", "canonical"])
    base = ["spar-build", "--source", "phantom", "--root", ph, "--samples-per-case", 4,
            "--counterfactual", "mirror", "--no-hf"]
    t1 = run([*base, "--out", tmp / "b1", "--workers", 1])
    t2 = run([*base, "--out", tmp / "b2", "--workers", 2])
    t0 = time.perf_counter()
    procs = [subprocess.Popen([str(c) for c in [*base, "--out", tmp / f"p{i}", "--partition", f"{i}/2"]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(2)]
    for p in procs:
        if p.wait():
            raise SystemExit(p.stderr.read().decode()[-2000:])
    t_parts = time.perf_counter() - t0
    t_merge = run(["spar-build", "merge", tmp / "p0", tmp / "p1", "--out", tmp / "bm"])
    same = fingerprint(tmp / "b1") == fingerprint(tmp / "b2") == fingerprint(tmp / "bm")
    return {"cases": n_cases, "workers1_s": t1, "workers2_s": t2, "speedup_workers": t1 / t2,
            "partitions2_s": t_parts, "merge_s": t_merge, "speedup_partitions": t1 / (t_parts + t_merge),
            "identical": same, "build": tmp / "b1"}


def bench_cache(tmp: Path, build: Path, encoder: str) -> dict:
    args = ["--encoder", encoder, "--random-init", "--data", build, "--device", "cpu",
            "--compute", "fp32", "--dtype", "fp32", "--batch", 16, "--workers", 0]
    # one torch thread per process in both: the same kernels, so the same float results
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = run([sys.executable, "-m", "spar_bench.probes.cli", "cache", *args, "--out", tmp / "c1.h5"],
              env=env)
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", 2,
               "-m", "spar_bench.probes.cli", "cache", *args, "--out", tmp / "c2.h5"], env=env)
    return {"encoder": encoder, "one_process_s": one, "torchrun2_s": two, "speedup": one / two,
            "max_abs_diff": _cache_diff(tmp / "c1.h5", tmp / "c2.h5")}


def _cache_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between the two caches' arrays (0.0: identical)."""
    import h5py
    import numpy as np

    def arrays(p: Path) -> dict:
        out: dict = {}
        with h5py.File(p, "r") as f:
            f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
        return out

    x, y = arrays(a), arrays(b)
    if x.keys() != y.keys():
        return float("inf")
    num = [k for k in x if x[k].dtype.kind == "f"]
    if any(not np.array_equal(x[k], y[k]) for k in x if k not in num):
        return float("inf")
    return max((float(np.abs(x[k].astype(np.float64) - y[k]).max()) for k in num if x[k].size), default=0.0)


def bench_sweep(tmp: Path, cache: Path) -> dict:
    base = ["spar-probe", "sweep", "--features", cache, "--heads", "mlp,transformer",
            "--probes", "level3.relative_position,level3.size,level1.localisation", "--seeds", "0,1",
            "--max-epochs", 5, "--bootstrap", 100]
    t1 = run([*base, "--jobs", 1, "--out", tmp / "s1"])
    t2 = run([*base, "--jobs", 2, "--out", tmp / "s2"])
    same = all((tmp / "s1" / p.relative_to(tmp / "s2")).read_bytes() == p.read_bytes()
               for p in (tmp / "s2").rglob("metrics.json"))
    return {"runs": 12, "jobs1_s": t1, "jobs2_s": t2, "speedup": t1 / t2, "same_metrics": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=16, help="phantom cases of the build")
    ap.add_argument("--encoder", default="timm:resnet18")
    ap.add_argument("--skip", default="", help="comma list of stages to skip: build,cache,sweep")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    print(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="spar-bench-scale-") as tmp:
        tmp = Path(tmp)
        b = bench_build(tmp, a.cases)
        build = b.pop("build")
        if "build" not in skip:
            print(f"build   {b['cases']} cases: 1 worker {b['workers1_s']:.1f}s, 2 workers {b['workers2_s']:.1f}s "
                  f"(x{b['speedup_workers']:.2f}); 2 partitions at once {b['partitions2_s']:.1f}s + merge "
                  f"{b['merge_s']:.1f}s (x{b['speedup_partitions']:.2f}); identical: {b['identical']}", flush=True)
        if "cache" not in skip:
            c = bench_cache(tmp, build, a.encoder)
            print(f"cache   {c['encoder']}: 1 process {c['one_process_s']:.1f}s, torchrun 2 ranks "
                  f"{c['torchrun2_s']:.1f}s (x{c['speedup']:.2f}); largest difference {c['max_abs_diff']:.3g}", flush=True)
        if "sweep" not in skip:
            run([sys.executable, "-m", "spar_bench.probes.cli", "cache", "--encoder", "dummy",
                 "--data", build, "--out", tmp / "dummy.h5"])
            s = bench_sweep(tmp, tmp / "dummy.h5")
            print(f"sweep   {s['runs']} runs: --jobs 1 {s['jobs1_s']:.1f}s, --jobs 2 {s['jobs2_s']:.1f}s "
                  f"(x{s['speedup']:.2f}); same metrics: {s['same_metrics']}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS of any child process: {rss:.0f} MiB; load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
