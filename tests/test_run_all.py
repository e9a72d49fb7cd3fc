"""Issue 44: one probe x seed loop (:func:`spar_bench.probes.runs.session.run_all`) for every
command and experiment step; a probe unavailable on a build is skipped whole under ``all``."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from spar_bench.probes.runs import session
from spar_bench.probes.runs.inputs import ProbeUnavailable

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("builder", "probes", "experiments", "spar_bench")


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """``session.run`` replaced: probe ``gone`` is not on the build; every call is recorded."""
    made: list[str] = []

    def fake(spec, out, **kw):
        made.append(f"{spec.probe}/{spec.seed}")
        if spec.probe == "gone":
            raise ProbeUnavailable("build has no gone")
        return Path(out) / spec.probe / str(spec.seed)

    monkeypatch.setattr(session, "run", fake)
    return made


def _grid(*probes: str) -> list[list[SimpleNamespace]]:
    return [[SimpleNamespace(probe=p, seed=s) for s in (0, 1)] for p in probes]


def test_an_unavailable_probe_is_skipped_whole_under_all(calls, capsys, tmp_path):
    got = [(s.probe, s.seed) for s, _ in session.run_all(_grid("a", "gone", "b"), tmp_path, skip_unavailable=True)]
    assert got == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert calls == ["a/0", "a/1", "gone/0", "b/0", "b/1"]  # its other seeds are not tried
    assert capsys.readouterr().err.strip() == "gone: not available on this build (build has no gone); skipped"


def test_a_named_unavailable_probe_stops_the_loop(calls, tmp_path):
    with pytest.raises(ProbeUnavailable):
        list(session.run_all(_grid("a", "gone", "b"), tmp_path))
    assert calls == ["a/0", "a/1", "gone/0"]


def test_the_loop_is_written_once_outside_the_sweep():
    """``except ProbeUnavailable`` once in the package outside ``runs/sweep.py`` (its workers
    report it to the parent): the 2-D calibration's frozen probes go through the same loop."""
    found = [p.relative_to(ROOT).as_posix() for d in PACKAGE for p in sorted((ROOT / d).rglob("*.py"))
             for _ in re.findall(r"except \(?[\w., ]*ProbeUnavailable", p.read_text(encoding="utf-8"))]  # fmt: skip
    rest = [f for f in found if f != "probes/runs/sweep.py"]
    assert rest == ["probes/runs/session.py"], found


def test_the_calibration_skips_a_frozen_probe_with_nothing_to_train_on(monkeypatch, capsys, tmp_path):
    """The 2-D calibration's frozen probe of a layout without the probe's items (e.g. no
    symmetric pair in random layouts) goes through ``run_all``: no predictions, one line."""
    from spar_bench.experiments.calibration import Training, frozen_head_predict

    def unavailable(spec, out, **kw):
        raise ProbeUnavailable(f"{spec.features}: {spec.probe} has no train or no test items")

    monkeypatch.setattr(session, "run", unavailable)
    caches, builds = {"random": tmp_path / "cache-random.h5"}, {"random": tmp_path / "shards-random"}
    got = frozen_head_predict(caches, builds, "random", "level3.symmetry", Training(), tmp_path / "heads", 5)
    assert got == {}
    assert capsys.readouterr().err.strip() == (f"level3.symmetry: not available on this build ({caches['random']}: "
                                               "level3.symmetry has no train or no test items); skipped")


def test_a_kind_says_itself_whether_its_runs_can_be_rescored(tmp_path, monkeypatch):
    """``evaluate_on`` asks the run's kind (``rescore``): ``runs/`` names no kind; a kind
    without it is refused in one line naming those that have it."""
    from spar_bench.errors import ConfigError
    from spar_bench.probes.kinds import RUN_KINDS
    from spar_bench.probes.runs.record import RunRecord
    from spar_bench.probes.runs.session import EvalTarget, HeadJob, evaluate_on

    assert callable(HeadJob.rescore) and callable(RUN_KINDS.get("finetune").rescore)
    assert not hasattr(RUN_KINDS.get("prior"), "rescore")
    finetune = RUN_KINDS.get("finetune")
    monkeypatch.setattr(finetune, "rescore", staticmethod(lambda rd, target: f"finetune {rd.name}"))
    (tmp_path / "encoder.safetensors").write_bytes(b"")  # a damaged finetune run: its marker file
    assert evaluate_on(tmp_path, EvalTarget(features="x.h5")) == f"finetune {tmp_path.name}"
    rd = tmp_path / "prior"
    rd.mkdir()
    RunRecord(kind="prior", probe="level1.localisation", head="prior", seed=0).write(rd)
    with pytest.raises(ConfigError, match="a run of kind prior has no trained head.*finetune or head can be"):
        evaluate_on(rd, EvalTarget(features="x.h5"))


def test_the_run_kind_registry_keeps_its_earlier_name():
    """One name per concept (issue 44): the registry of run kinds is ``RUN_KINDS``; its earlier
    name ``PREDICTORS`` stays an alias, so code that imports it still finds every kind."""
    from spar_bench.probes import kinds

    assert kinds.PREDICTORS is kinds.RUN_KINDS and "head" in kinds.RUN_KINDS
