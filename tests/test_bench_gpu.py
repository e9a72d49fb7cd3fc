"""bench/gpu.py --quick: the GPU bench's whole path (phantom, build, caches, finetune, sweep, token
storage) runs on the CPU without datasets, hdf5plugin, SimpleITK, pyarrow or matplotlib, and prints
its one table (issue 25)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what a bare GPU machine lacks (nibabel aside: the bench takes it from a wheel, docs/SCALE.md)
ABSENT = ("datasets", "hdf5plugin", "SimpleITK", "pyarrow", "matplotlib")


@pytest.mark.slow
def test_gpu_bench_quick_prints_its_table(tmp_path: Path) -> None:
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in ABSENT), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick", "--device", "cpu", "--jobs", "1",
                        "--work", str(tmp_path / "work"), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| measure")]
    measures = [ln.split(" | ")[0][2:].strip() for ln in rows]
    assert lines.count("| measure | value | target |") == 1  # one table
    for start in ("cache timm:resnet10t", "cache timm:vit_tiny_patch16_224", "finetune timm:resnet10t",
                  "sweep (4-case phantom", "spar-build phantom --n 4", "build (4 cases",
                  "token cache of 26,558 images", "--token-grid 14 (measured", "--token-grid 7 --token-int8",
                  "cache with grid:14 vs bare forward", "writer thread on vs off"):
        assert any(m.startswith(start) for m in measures), (start, measures)
    assert sum("where the time goes" in m for m in measures) == 3
    res = json.loads(out.read_text(encoding="utf-8"))
    assert res["sweep"] == dict(res["sweep"], runs=1, done=1, finished=True)
    assert {s[0] for s in res["cache"][0]["breakdown"]["stages"]} >= {"read", "load wait", "h2d", "forward", "write"}
    assert {s[0] for s in res["finetune"]["breakdown"]["stages"]} >= {"forward", "backward", "step", "host prep"}
    grid14 = res["storage"]["storages"]["grid:14"]["bytes_per_image"]
    assert res["storage"]["tokens"] == 1 + 37 * 37 and 0 < grid14 < res["storage"]["full_bytes_per_image"] / 5
