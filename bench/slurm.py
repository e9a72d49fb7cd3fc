"""The demo through SLURM beside the local executor, in one run.

    python bench/slurm.py                          # starts scripts/slurm-local.sh in a temp folder
    python bench/slurm.py --set N_CASES=4 --keep   # any demo variable; keep the folders

Runs ``spar-bench run demo --set OUT=<tmp>/local`` (the local executor), then
``spar-bench run demo --executor slurm --set OUT=<tmp>/slurm`` on a single-node SLURM that this
bench starts (``SLURM_CONF`` already set: that cluster instead), each in a fresh process, and
prints both wall times, the SLURM overhead, ``spar-bench status`` of the SLURM folder, and
whether ``report/report.md`` is the same bytes in both. Exit status 1 when it is not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "spar_bench.experiments.cli", *args], capture_output=True, text=True)
    return time.perf_counter() - t0, done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spar-bench-slurm-"))
    sets = [x for s in args.sets for x in ("--set", s)]
    started = "SLURM_CONF" not in os.environ
    if started:
        subprocess.run(["bash", str(REPO / "scripts" / "slurm-local.sh"), "start", str(root / "cluster")], check=True)
        os.environ["SLURM_CONF"] = str(root / "cluster" / "slurm.conf")
    try:
        t_local, local = bench("run", "demo", *sets, "--set", f"OUT={root / 'local'}")
        t_slurm, slurm = bench("run", "demo", "--executor", "slurm", *sets, "--set", f"OUT={root / 'slurm'}")
        for name, done in (("local", local), ("slurm", slurm)):
            if done.returncode != 0:
                print(f"{name} run failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                return 1
        status = bench("status", str(root / "slurm"))[1].stdout
        same = (root / "local/report/report.md").read_bytes() == (root / "slurm/report/report.md").read_bytes()
        print(status.rstrip())
        print(f"local executor: {t_local:.1f} s; slurm executor: {t_slurm:.1f} s "
              f"(overhead {t_slurm - t_local:+.1f} s, x{t_slurm / t_local:.2f}); "
              f"report.md byte-identical: {same}; cores: {os.cpu_count()}")
        return 0 if same else 1
    finally:
        if started:
            subprocess.run(["bash", str(REPO / "scripts" / "slurm-local.sh"), "stop", str(root / "cluster")])
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
