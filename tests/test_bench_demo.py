"""bench/demo.py, the demo's stage table, end to end at the smallest size: every step timed in
its own process, the rerun, the plan's estimate, the bare forward beside each cache and the cache
alone with 1 process and one per core (the same bytes). Keeps the bench working as the job changes.

The demo's encoders are swapped for a tiny random-init timm CNN (no weights on the index for it),
so the numbers mean nothing; the test checks the shape of what the bench prints and records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "demo.py"


@pytest.mark.slow
def test_the_demo_bench_times_every_stage_and_compares_each_cache(tmp_path: Path) -> None:
    demo = (ROOT / "experiments" / "demo.yaml").read_text(encoding="utf-8")
    tiny = demo.replace('{spec: "${ENCODER}", label', '{spec: "${ENCODER}", random_init: true, label')
    assert tiny != demo, "demo.yaml's pretrained encoder line moved: update this test's edit"
    exp = tmp_path / "demo.yaml"
    exp.write_text(tiny, encoding="utf-8")
    sets = ["N_CASES=3", "SAMPLES=1", "MAX_EPOCHS=1", "ENCODER=timm:resnet10t", "CONTROL=timm:resnet14t"]
    cmd = [sys.executable, str(BENCH), "--experiment", str(exp), "--keep", str(tmp_path / "out"),
           "--json", str(tmp_path / "stages.json"), "--bare-seconds", "0.2", "--pace-repeats", "1", *[x for s in sets for x in ("--set", s)]]
    p = subprocess.run(cmd, capture_output=True, encoding="utf-8", cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads((tmp_path / "stages.json").read_text(encoding="utf-8"))

    steps = [r["step"] for r in rep["steps"]]
    assert steps[0] == "build:shards" and steps[-1] == "report" and len(steps) == 7
    for r in rep["steps"]:
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["log_s"] > 0 and r["estimate_s"] > 0, r
    assert rep["rerun"]["wall_s"] > 0 and rep["estimate_s"] > 0
    assert len(rep["caches"]) == 2
    for c in rep["caches"]:
        assert set(c["bare"]) == {"1 proc x 1 thread, contiguous", "1 proc x 1 thread, channels_last",
                                  f"1 proc x {rep['cores']} threads, channels_last",
                                  f"{rep['cores']} procs x 1 thread, channels_last"}
        runs = c["pace"]["runs"]
        assert set(runs) == {"1", str(rep["cores"])} and c["pace"]["identical"], c["pace"]
        assert all(r["images"] == c["images"] for r in runs.values())  # every row of the step's cache
        assert all(len(r["loop_img_s_all"]) == 1 and 0 < r["loop_s"] < r["total_s"] for r in runs.values())
        assert c["ratio"] > 0 and c["ratio_step"] > 0 and c["ratio_cpu"] > 0
    assert "| **all steps** |" in p.stdout and "cache / best bare forward, all cores:" in p.stdout
    assert "byte-identical" in p.stdout and "DIFFERENT" not in p.stdout
