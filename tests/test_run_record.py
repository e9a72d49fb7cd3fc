"""One record, one entry: every run's ``config.json`` is a :class:`RunRecord`; every run is
``session.run(spec)`` through the ``RUN_KINDS`` registry; a finished run is whole or absent
(a crash at any write leaves no finished-looking run), and a damaged one is run again; a new
run kind is one class plus one registry line (here: a plug-in's, found by its entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError

from helpers import run_cmd

PROBE = "level3.relative_position"


# --------------------------------------------------------------------------- the record
def test_a_record_reads_back_as_written_and_names_what_differs(tmp_path: Path) -> None:
    from spar_bench.probes.runs.record import RunRecord

    rec = RunRecord(kind="head", probe=PROBE, head="mlp", seed=1, variant="lr=0.01", model="timm:resnet18",
                    build="shards", build_fingerprint="ab" * 32, inputs={"features": "c.h5"},
                    options={"n_boot": 50, "train": {"lr": 0.01}}, extra={"in_dim": 8})  # fmt: skip
    rec.write(tmp_path)
    back = RunRecord.read(tmp_path)
    assert back == rec and json.loads((tmp_path / "config.json").read_text())["kind"] == "head"
    other = rec.replace(options={"n_boot": 50, "train": {"lr": 0.1}}, extra={"in_dim": 9})
    assert back.differences(other) == ["options.train.lr=0.01 (now 0.1)"]  # extra is no identity
    assert back.differences(rec) == []
    (tmp_path / "config.json").write_text('{"record": 99, "kind": "head"}')
    with pytest.raises(ConfigError, match="layout 99.*upgrade spar-bench"):
        RunRecord.read(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable run record"):
        RunRecord.read(tmp_path)


@pytest.mark.parametrize(("config", "kind", "model", "build"), [
    ({"encoder": "dummy", "dataset_dir": "shards", "run": {"n_boot": 5}}, "head", "dummy", "shards"),
    ({"command": "finetune", "encoder": "timm:vit", "dataset_dir": "b"}, "finetune", "timm:vit", "b"),
    ({"track": "vqa", "model": "dummy", "dataset": "b"}, "mllm", "dummy", "b"),
    ({"predictor": "prior", "encoder": "prior", "dataset_dir": "b"}, "prior", "prior", "b"),
])  # fmt: skip
def test_a_config_written_before_the_record_is_read_with_its_kind(config, kind, model, build) -> None:
    from spar_bench.probes.runs.record import RunRecord

    rec = RunRecord.from_dict({"probe": PROBE, "head": "h", "seed": 0, "dataset_fingerprint": "f", **config})
    assert (rec.kind, rec.model, rec.build, rec.build_fingerprint, rec.legacy) == (kind, model, build, "f", True)
    # compared on what those files recorded alike
    assert rec.differences(rec.replace(legacy=False, options={"x": 1})) == []
    assert rec.differences(rec.replace(legacy=False, seed=3)) == ["seed=0 (now 3)"]


# --------------------------------------------------------------------------- whole or absent
class Crash(Exception):
    pass


def _writes(rd: Path, metrics: dict, crash_at: int | None, monkeypatch) -> int:
    """``write_run`` with a crash injected at its ``crash_at``-th write; the number of writes."""
    from spar_bench.probes.runs import record as record_mod
    from spar_bench.probes.runs import store
    from spar_bench.probes.runs.record import RunRecord

    count = [0]

    def step():
        count[0] += 1
        if count[0] == crash_at:
            raise Crash(f"killed at write {crash_at}")

    def file_writer(text):
        return (lambda p: (step(), p.write_text(text)), True)

    real_write, real_metrics, real_rename = record_mod.RunRecord.write, store.write_metrics, Path.rename
    monkeypatch.setattr(record_mod.RunRecord, "write", lambda self, d: (step(), real_write(self, d)))
    monkeypatch.setattr(store, "write_metrics", lambda d, m: (step(), real_metrics(d, m)))
    monkeypatch.setattr(Path, "rename", lambda self, t: (step(), real_rename(self, t))[1])
    rec = RunRecord(kind="head", probe=PROBE, head="mlp", seed=0, options={"v": metrics["v"]})
    try:
        store.write_run(rd, rec, metrics, {"head.pt": file_writer(f"head {metrics['v']}"),
                                           "extra.txt": file_writer("extra")})
    finally:
        monkeypatch.undo()
    return count[0]


def test_a_run_killed_at_any_write_is_whole_or_absent_and_reruns(tmp_path: Path, monkeypatch) -> None:
    """A crash at every write in turn (files, record, metrics, the renames), first into an empty
    folder, then over a finished run of the same folder: the folder is the old whole run or
    absent, never a finished-looking run with a file missing; the rerun writes it whole."""
    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.runs.store import METRICS_FILE, clear_staging

    n = _writes(tmp_path / "probe" / "n", {"v": 0}, None, monkeypatch)
    assert n >= 5
    for earlier in (None, 1):
        for k in range(1, n + 1):
            rd = tmp_path / f"e{earlier}-k{k}" / "seed0"
            if earlier is not None:
                _writes(rd, {"v": earlier}, None, monkeypatch)
            with pytest.raises(Crash):
                _writes(rd, {"v": 2}, k, monkeypatch)
            if (rd / METRICS_FILE).is_file():  # the earlier run, whole, or this one renamed into place whole
                rec = RunRecord.read(rd)
                assert rec.damaged(rd) == []
                v = json.loads((rd / METRICS_FILE).read_text())["v"]
                assert (rd / "head.pt").read_text() == f"head {v}" and rec.options == {"v": v}
            else:
                assert not rd.exists() or not any(rd.iterdir())
            clear_staging(rd)
            assert [p.name for p in rd.parent.iterdir() if p.name != "seed0"] == []  # nothing left beside it
            _writes(rd, {"v": 2}, None, monkeypatch)
            assert json.loads((rd / METRICS_FILE).read_text()) == {"v": 2} and RunRecord.read(rd).damaged(rd) == []


def _fit(pipeline, out: Path, capsys) -> tuple[int, str]:
    from spar_bench.probes.cli import cli

    code = run_cmd(cli, ["fit", "--features", pipeline["cache"], "--probe", PROBE, "--out", out,
                         "--max-epochs", 2, "--bootstrap", 20])  # fmt: skip
    return code, capsys.readouterr().err


def test_a_damaged_finished_run_is_run_again_not_skipped(pipeline, tmp_path: Path, capsys) -> None:
    out = tmp_path / "runs"
    assert _fit(pipeline, out, capsys)[0] == 0
    (rd,) = [p.parent for p in out.rglob("metrics.json")]
    record = json.loads((rd / "config.json").read_text())
    assert record["kind"] == "head" and set(record["files"]) == {"head.pt"}
    metrics = (rd / "metrics.json").read_bytes()
    code, err = _fit(pipeline, out, capsys)
    assert code == 0 and "kept" in err  # whole: kept
    for damage in (lambda p: p.unlink(), lambda p: p.write_bytes(p.read_bytes()[:-7])):
        damage(rd / "head.pt")
        code, err = _fit(pipeline, out, capsys)
        assert code == 0 and "a damaged run (head.pt" in err and "running it again" in err
        assert (rd / "metrics.json").read_bytes() == metrics  # the same run, trained again
        assert json.loads((rd / "config.json").read_text())["files"] == record["files"]


# --------------------------------------------------------------------------- a new run kind
PLUGIN = '''
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class MajorityClass:
    """Answers every item with the class most frequent on the training items."""

    spec: Any
    majority: int = 0
    kind: str = "majority"

    @classmethod
    def on_build(cls, spec, build):
        return cls(spec)

    def fit(self, train, val):
        self.majority = int(np.bincount(np.asarray(train.y["answer"]).astype(int)).argmax())

    def predict(self, t, split="test"):
        return np.full(len(t), self.majority, dtype=np.int64)

    def blind(self):
        return MajorityClass(self.spec)
'''


def _plugin(tmp_path: Path) -> Path:
    """A package folder with the plug-in module and its entry point (a dist-info, as pip writes it)."""
    site = tmp_path / "site"
    (site / "spar_majority-0.1.dist-info").mkdir(parents=True)
    (site / "spar_majority.py").write_text(textwrap.dedent(PLUGIN))
    (site / "spar_majority-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: spar-majority\nVersion: 0.1\n")
    (site / "spar_majority-0.1.dist-info" / "entry_points.txt").write_text(
        "[spar_bench.run_kinds]\nmajority = spar_majority:MajorityClass\n")
    return site


@pytest.mark.slow
def test_a_new_run_kind_is_one_class_and_one_registry_line(pipeline, tmp_path: Path) -> None:
    """A plug-in's 20-line predictor, registered by its entry point only, runs through
    ``spar-probe predict`` (session.run) with every control, and the report names its kind."""
    site = _plugin(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    out, report = tmp_path / "runs", tmp_path / "report"
    cmd = [sys.executable, "-m", "spar_bench.probes.cli"]
    done = subprocess.run([*cmd, "predict", "--kind", "majority", "--data", str(pipeline["shards"]), "--probe",
                           PROBE, "--out", str(out), "--bootstrap", "20"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rd = out / "majority" / PROBE / "majority" / "seed0"
    m, rec = (json.loads((rd / f).read_text()) for f in ("metrics.json", "config.json"))
    assert rec["kind"] == "majority" and m["track"] == "majority" and m["controls"]["blind"] is not None
    assert m["test"]["accuracy"] == pytest.approx(m["controls"]["majority"])  # it is the majority control
    typo = subprocess.run([*cmd, "predict", "--kind", "majorty", "--data", str(pipeline["shards"])], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert typo.returncode != 0 and "majority" in typo.stderr and len(typo.stderr.strip().splitlines()) == 1
    from spar_bench.experiments.report import load_runs, mode_of

    (run,) = load_runs(out)
    assert mode_of(run.metrics, run.record) == "majority"
    from spar_bench.probes.cli import cli

    assert run_cmd(cli, ["report", out, "--out", report]) == 0
    assert "majority" in (report / "report.md").read_text()
    # the same kind in an experiment file (predictors:), run by spar-bench run, in its report
    exp = tmp_path / "e.yaml"
    exp.write_text(f"""
experiment: e
out: {tmp_path / 'e'}
builds:
  b: {{path: "{pipeline['shards']}"}}
predictors:
  majority: {{bootstrap: 20}}
  prior: {{kind: prior, bootstrap: 20}}
probes: [{PROBE}]
seeds: [0, 1]
""")
    done = subprocess.run([sys.executable, "-m", "spar_bench.experiments.cli", "run", str(exp)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = (tmp_path / "e" / "report" / "experiment.md").read_text()
    assert "| majority |" in rows.replace("  ", " ") or " majority " in rows
    kinds = {json.loads(p.read_text())["kind"] for p in (tmp_path / "e" / "runs").rglob("config.json")}
    assert kinds == {"majority", "prior"}
    exp.write_text(exp.read_text().replace("majority: {bootstrap: 20}", "majority: {kind: majorty}"))
    typo = subprocess.run([sys.executable, "-m", "spar_bench.experiments.cli", "run", str(exp), "--dry-run"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert typo.returncode == 2 and "e.yaml:" in typo.stderr and "majority" in typo.stderr, typo.stderr
