"""Shared fixtures. Real data is read from ../shared/data (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SPAR_SHARED_DATA", REPO.parent / "shared" / "data"))


def _shared(sub: str) -> Path:
    path = SHARED_DATA / sub
    if not path.exists():
        pytest.skip(f"real data not available: {path} is missing (set SPAR_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def word_labels_dir() -> Path:
    """The 20 real WORD label maps (masks only, L,P,S): ``word-labels/`` with labelsTs/."""
    return _shared("word-labels")


@pytest.fixture(scope="session")
def totalseg_dir() -> Path:
    """One real CT with TotalSegmentator masks (R,A,S): ``totalsegmentator-sample/``."""
    return _shared("totalsegmentator-sample")


@pytest.fixture()
def fake_root(tmp_path: Path) -> Path:
    """Five fake cases (3 train, 1 val, 1 test) of the source ``fake`` (helpers.FakeSource),
    registered for the test only."""
    import json

    from spar_bench.builder.sources import SOURCES

    from helpers import FakeSource

    root = tmp_path / "data"
    root.mkdir()
    cases = [["c1", "train"], ["c2", "train"], ["c3", "train"], ["c4", "val"], ["c5", "test"]]
    (root / "cases.json").write_text(json.dumps(cases))
    with SOURCES.registered("fake", FakeSource):
        yield root


@pytest.fixture()
def one_torch_thread():
    """Heads are tiny: one torch thread avoids oversubscription on a busy 2-core machine."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory) -> dict[str, Path]:
    """phantom -> shards (with mirrors) -> dummy-encoder caches, built once per session
    (helpers.build_pipeline)."""
    from helpers import build_pipeline

    return build_pipeline(tmp_path_factory)


def _untracked() -> set[str] | None:
    """Files in the checkout that git neither tracks nor ignores (None where git cannot say)."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--directory"],
                             cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.splitlines())


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller only, once
        session.config.stash[_BEFORE] = _untracked()


def pytest_sessionfinish(session, exitstatus):
    """A test that writes into the checkout (a relative ``out`` in the working directory: a phantom
    build was once committed that way) fails the run, naming what it left."""
    before = session.config.stash.get(_BEFORE, None)
    after = _untracked() if before is not None else None
    new = sorted(after - before) if after is not None else []
    if new:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(f"tests wrote into the checkout {REPO.name}/: {', '.join(new)} (write under tmp_path)",
                                red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[set | None]()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def check():
    """The calibration's ``spar-bench check`` (``spar_bench.experiments.calibration_check``)."""
    from spar_bench.experiments import calibration_check

    return calibration_check


@pytest.fixture
def bench_check(capsys):
    """``spar-bench check ARGS...``: ``(exit status, stdout, stderr)``."""
    from spar_bench.clitools import run_cli
    from spar_bench.experiments.cli import cli

    def run(*args) -> tuple[int, str, str]:
        code = run_cli(cli, ["check", *map(str, args)], prog_name="spar-bench")
        got = capsys.readouterr()
        return code, got.out, got.err

    return run


@pytest.fixture(scope="module")
def reference(check) -> dict:
    """The calibration table's reference rows (``docs/calibration.json``)."""
    import json

    return json.loads(check.REFERENCE.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node SLURM (``scripts/slurm-local.sh start``) for the session, stopped after;
    ``SLURM_CONF`` points at it. Skipped, with the reason, where it cannot run (not root, no
    packages); under CI (env ``CI`` set) that is a failure, never a skip."""
    import subprocess

    script = REPO / "scripts" / "slurm-local.sh"
    folder = tmp_path_factory.mktemp("slurm")
    done = subprocess.run(["bash", str(script), "start", str(folder)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
        if done.returncode == 3 and not os.environ.get("CI"):
            pytest.skip(f"no local SLURM: {reason}")
        pytest.fail(f"scripts/slurm-local.sh start failed (exit {done.returncode}): {reason}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        yield folder
    finally:
        subprocess.run(["bash", str(script), "stop", str(folder)], capture_output=True, timeout=120)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
