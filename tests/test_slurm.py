"""``spar-bench run --executor slurm`` against a real single-node SLURM (``slurm_cluster``), and
the scripts it writes (``--dry-run``: no cluster needed).

Through SLURM a small demo-like experiment gives the local executor's report byte for byte; a
running step cancelled with ``scancel`` and the same command again runs every step exactly once; a
second submission while the first is queued adds no job; a step failing on bad input leaves its
dependants unstarted, ``status`` shows its log's last line and the command exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXPERIMENT = """
experiment: tiny
vars:
  OUT: out
out: ${{OUT}}
builds:
  b: {{phantom: {{n: 4, layout: canonical, in_plane: 96, slices: 16}}, options: {{samples_per_case: 2, hf: false}}}}
encoders:
  r10: {{spec: "timm:resnet10t", {init}}}
modes:
  frozen: {{encoders: [r10], heads: [mlp], options: {{max_epochs: 1, bootstrap: 20}}}}
probes: [level1.localisation, level3.relative_position]
seeds: [0]
mllms:
  dummy: {{model: dummy, options: {{bootstrap: 20, probe: relative_position}}}}
resources:
  default: {{cpus: 1, mem: 2G, time: "0:20:00"}}
"""
STEPS = ["build:b", "cache:r10@b", "heads:r10", "vqa:dummy@b", "report"]


def _write(path: Path, weights: str = "") -> Path:
    """The experiment file (the same bytes wherever it runs: OUT is given with --set)."""
    path.write_text(EXPERIMENT.format(init=f"weights: {weights}" if weights else "random_init: true"))
    return path


def _run(path: Path, out: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return _bench("run", str(path), "--set", f"OUT={out}", *args, timeout=timeout)


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "spar_bench.experiments.cli", *args], env=env, capture_output=True,
                          encoding="utf-8", errors="replace", timeout=timeout)  # fmt: skip


def _finished(out: Path) -> list[str]:
    lines = [json.loads(x) for x in (out / ".plan" / "log.jsonl").read_text().splitlines()]
    return sorted(x["step"] for x in lines if x["event"] == "finish")


def _report(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "report").glob("*")) if p.suffix in (".md", ".json")}


def _states(out: Path) -> dict[str, tuple[str, ...]]:
    done = _bench("status", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [ln.split() for ln in done.stdout.splitlines()[1:] if ln.strip()]
    return {r[0]: tuple(r[1:]) for r in rows}


def _queue(states: str | None = None) -> list[str]:
    """Job ids in the queue (pending, running, completing); ``states="all"``: ended ones too."""
    args = ["squeue", "-h", "-o", "%i", *([f"--states={states}"] if states else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.split()


def _job_state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60).stdout.strip()


def _started(out: Path) -> list[str]:
    try:
        lines = (out / ".plan" / "log.jsonl").read_text().splitlines()
    except OSError:
        return []
    events = []
    for x in lines:
        try:
            events.append(json.loads(x))
        except ValueError:  # a line being written
            continue
    return [e["step"] for e in events if e["event"] == "start"]


def _wait(until, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """The tiny experiment run by the local executor: the report SLURM's must equal."""
    root = tmp_path_factory.mktemp("local")
    done = _run(_write(root / "tiny.yaml"), root / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "out"


# --------------------------------------------------------------------------- scripts (no cluster)
def test_a_damaged_jobs_json_is_refused_before_anything_is_submitted_again(tmp_path, monkeypatch):
    """Submitting over a damaged jobs.json would send every step again (its running jobs twice):
    one line that says how to find them, exit 2, no script written."""
    monkeypatch.setenv("PATH", "/nonexistent")  # nothing may reach a cluster
    slurm = tmp_path / "out" / ".plan" / "slurm"
    slurm.mkdir(parents=True)
    (slurm / "jobs.json").write_text("{not json")
    done = _run(_write(tmp_path / "tiny.yaml"), tmp_path / "out", "--executor", "slurm", "--dry-run")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "jobs.json: damaged" in lines[0] and "squeue" in lines[0], lines
    assert not list(slurm.glob("*.sbatch"))


@pytest.mark.slow
def test_dry_run_scripts_carry_resources_and_dependencies(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no SLURM command: a dry run reads nothing of a cluster
    path = _write(tmp_path / "tiny.yaml")
    path.write_text(path.read_text() + '  cache: {gpus: 1, mem: 24G, time: "2:00:00"}\n')
    done = _run(path, tmp_path / "out", "--executor", "slurm", "--dry-run", "--slurm-partition", "gpu",
                  "--slurm-account", "lab", "--slurm-qos", "short", "--slurm-extra=--constraint=a100")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    scripts = {s.split("\n", 1)[0]: s for s in done.stdout.split("# ---- ")[1:]}
    assert len(scripts) == len(STEPS) and not (tmp_path / "out").exists()  # printed, nothing written
    cache = next(s for k, s in scripts.items() if k.endswith("cache_r10@b.sbatch"))
    for line in ("--job-name=tiny:cache:r10@b", "--gres=gpu:1", "--mem=24G", "--time=2:00:00", "--cpus-per-task=1",
                 "--partition=gpu", "--account=lab", "--qos=short", "#SBATCH --constraint=a100",
                 "--dependency=afterok:{build:b}", "--kill-on-invalid-dep=yes", "--requeue",
                 f"--output={tmp_path / 'out'}/.plan/logs/cache_r10@b.%j.log", " step "):  # fmt: skip
        assert line in cache, line
    report = next(s for k, s in scripts.items() if k.endswith("report.sbatch"))
    assert "--dependency=afterok:{heads:r10}:{vqa:dummy@b}" in report and "--gres" not in report
    build = next(s for k, s in scripts.items() if k.endswith("build_b.sbatch"))
    assert "--dependency" not in build and "--mem=2G" in build


def test_a_gpu_step_asks_for_one_gpu_by_default(tmp_path, monkeypatch):
    """A step that takes a device gets ``--gres=gpu:1`` where the cluster has GPUs; no GPU needed here."""
    from spar_bench.experiments import slurm
    from spar_bench.experiments.config import load_experiment
    from spar_bench.experiments.plan import make_plan

    plan = make_plan(load_experiment(_write(tmp_path / "t.yaml"), {"OUT": str(tmp_path / "out")}))
    monkeypatch.setattr(slurm, "cluster_has_gpus", lambda: True)
    text = slurm.script(plan, plan.step("heads:r10"), slurm.resources(plan, plan.step("heads:r10"), True), ["7"],
                        slurm.SlurmOptions())  # fmt: skip
    assert "#SBATCH --gres=gpu:1\n" in text and "#SBATCH --dependency=afterok:7\n" in text
    cpu = slurm.resources(plan, plan.step("heads:r10"), False)
    assert cpu.gpus == 0 and slurm.resources(plan, plan.step("build:b"), True).gpus == 0


def test_a_resources_key_that_is_no_step_kind_is_one_line(tmp_path):
    from spar_bench.errors import ConfigError
    from spar_bench.experiments.config import load_experiment

    path = _write(tmp_path / "t.yaml")
    path.write_text(path.read_text() + "  cahce: {gpus: 1}\n")
    with pytest.raises(ConfigError, match=r"t.yaml:\d+: resources.cahce: not a kind of step; did you mean 'cache'"):
        load_experiment(path)


# --------------------------------------------------------------------------- a real SLURM
@pytest.mark.slow
def test_through_slurm_the_report_equals_the_local_one(slurm_cluster, local, tmp_path):
    out = tmp_path / "out"
    done = _run(_write(tmp_path / "tiny.yaml"), out, "--executor", "slurm")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _report(out) == _report(local) and _report(out)
    assert _finished(out) == sorted(STEPS)
    assert {k: v[0] for k, v in _states(out).items()} == dict.fromkeys(STEPS, "done")
    assert sorted(p.name.split(".")[0] for p in (out / ".plan" / "logs").glob("*.log")) == sorted(
        ["build_b", "cache_r10@b", "heads_r10", "vqa_dummy@b", "report"])


@pytest.mark.slow
def test_no_duplicate_while_queued_and_a_cancelled_step_is_run_again(slurm_cluster, local, tmp_path):
    """Submitted (no follow), submitted again: no job added. The heads step cancelled while it runs,
    then the same command: every step finishes exactly once, and the report is the local one."""
    out = tmp_path / "out"
    path = _write(tmp_path / "tiny.yaml")
    first = _run(path, out, "--executor", "slurm", "--no-follow")
    assert first.returncode == 0, first.stderr[-2000:]
    record = (out / ".plan" / "slurm" / "jobs.json").read_text()
    jobs = {r["job"] for r in json.loads(record)["steps"].values()}
    again = _run(path, out, "--executor", "slurm", "--no-follow")
    assert again.returncode == 0 and " 0 job(s) submitted" in again.stdout, again.stdout + again.stderr[-2000:]
    assert (out / ".plan" / "slurm" / "jobs.json").read_text() == record and len(jobs) == len(STEPS)
    first = min(int(j) for j in jobs)  # job ids grow: one submitted since has a larger id
    assert {j for j in _queue("all") if int(j) >= first} == jobs  # ended jobs too: none added
    heads = json.loads((out / ".plan" / "slurm" / "jobs.json").read_text())["steps"]["heads:r10"]["job"]
    _wait(lambda: _job_state(heads) == "RUNNING", "the heads step to run", timeout=600)
    _wait(lambda: "heads:r10" in _started(out), "the heads step to start", timeout=60)
    subprocess.run(["scancel", heads], check=True, timeout=60)
    _wait(lambda: not _queue(), "the cancelled step's dependants to leave the queue", timeout=600)
    states = _states(out)
    assert states["heads:r10"][0] == "cancelled" and states["report"][0] == "cancelled", states
    done = _run(path, out, "--executor", "slurm")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _finished(out) == sorted(STEPS)  # each step finished once
    assert _report(out) == _report(local)


@pytest.mark.slow
def test_a_failing_step_leaves_its_dependants_unstarted_and_exits_1(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "broken.pt").write_text("not a checkpoint\n")
    path = _write(tmp_path / "tiny.yaml", weights=str(tmp_path / "broken.pt"))
    done = _run(path, out, "--executor", "slurm")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cache:r10@b failed" in done.stderr and "broken.pt" in done.stderr, done.stderr[-2000:]
    states = _states(out)
    assert states["build:b"][0] == "done" and states["vqa:dummy@b"][0] == "done"
    assert states["cache:r10@b"][0] == "failed" and "broken.pt" in " ".join(states["cache:r10@b"])
    assert states["heads:r10"][0] == "cancelled" and states["report"][0] == "cancelled"
    assert "heads:r10" not in _started(out) and "report" not in _started(out)
    assert not list((out / ".plan" / "logs").glob("heads_r10.*.log"))


# --------------------------------------------------------------------------- docs/slurm
DOCS = Path(__file__).resolve().parents[1] / "docs" / "slurm"


def _generated(tmp_path: Path) -> dict[str, str]:
    """``--dry-run`` of docs/slurm/example.yaml, run in ``tmp_path``: script name -> text, with the
    interpreter, the working folder and each step's hash written as placeholders."""
    import re

    env = {**os.environ, "PATH": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "spar_bench.experiments.cli", "run", str(DOCS / "example.yaml"),
                           "--executor", "slurm", "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = {}
    for chunk in done.stdout.split("# ---- ")[1:]:
        head, text = chunk.split("\n", 1)
        text = text.replace(str(tmp_path), "/path/to/project").replace(sys.executable, "/path/to/venv/bin/python")
        out[Path(head).name] = re.sub(r"--hash [0-9a-f]{64}", "--hash HASH", text).rstrip("\n") + "\n"
    return out


@pytest.mark.slow
def test_the_scripts_in_docs_slurm_are_what_the_executor_writes(tmp_path):
    """docs/slurm/*.sbatch = the dry run of docs/slurm/example.yaml (SPAR_WRITE_DOCS=1: rewrite them)."""
    got = _generated(tmp_path)
    if os.environ.get("SPAR_WRITE_DOCS"):
        for p in DOCS.glob("*.sbatch"):
            p.unlink()
        for name, text in got.items():
            (DOCS / name).write_text(text)
    have = {p.name: p.read_text() for p in sorted(DOCS.glob("*.sbatch"))}
    assert have == got, "docs/slurm/ is stale: SPAR_WRITE_DOCS=1 python -m pytest -n 0 tests/test_slurm.py -k docs"
    assert "#SBATCH --gres=gpu:1" in got["cache_r18@ct.sbatch"]
