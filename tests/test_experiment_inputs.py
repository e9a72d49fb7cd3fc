"""Experiment files as documented, checked before any step runs (issue 39, items 4 and 8).

* a ``path:`` build (an existing build folder) runs through cache, heads and transfer eval;
* every value of the file (phantom ``n``, seeds, sizes, epochs, devices ...) is checked when
  the plan is made: one line naming the file, the line and the key;
* every command a hint of the experiments package names exists;
* ``--devices`` is checked before any step runs (a device that is not there, an empty list).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cmd


def _run(argv: list) -> int:
    from spar_bench.experiments.cli import cli

    return run_cmd(cli, ["run", *argv])


# --------------------------------------------------------------------------- path: builds
def test_a_path_build_runs_through_cache_heads_and_transfer_eval(pipeline, tmp_path, one_torch_thread):
    """Two existing builds outside OUT, given by path: the cache records no build folder for
    them (no local path is published), so the heads and the eval steps get ``--data``."""
    path = tmp_path / "p.yaml"
    path.write_text(f"""
experiment: p
out: {tmp_path / 'out'}
builds:
  main: {{path: "{pipeline['shards']}"}}
  other: {{path: "{pipeline['other']}"}}
train_on: main
transfer: [other]
encoders:
  d: {{spec: dummy}}
modes:
  frozen: {{encoders: [d], heads: [mlp], options: {{max_epochs: 2, bootstrap: 10, no_controls: true}}}}
probes: [level1.localisation]
seeds: [0]
""")
    assert _run([path]) == 0
    runs = list((tmp_path / "out" / "runs" / "frozen-d").rglob("metrics.json"))
    assert len(runs) == 1
    evals = list(runs[0].parent.glob("eval-*.json"))
    assert [e.name for e in evals] == ["eval-d@other.json"]
    assert json.loads(evals[0].read_text())["probe"] == "level1.localisation"
