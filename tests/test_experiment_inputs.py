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


# --------------------------------------------------------------------------- every value, at plan time
BAD_VALUES = [  # (a line of the file, the key the error names)
    ("builds: {a: {phantom: {n: -3}}}", "builds.a.phantom.n"),
    ("builds: {a: {phantom: {n: 4, in_plane: 10}}}", "builds.a.phantom.in_plane"),
    ("builds: {a: {phantom: {n: 4, seed: -1}}}", "builds.a.phantom.seed"),
    ("builds: {a: {phantom: {n: 4}, options: {samples_per_case: 0}}}", "builds.a.options.samples_per_case"),
    ("builds: {a: {phantom: {n: 4}, options: {volume_size: 4, levels: [level4]}}}", "builds.a.options.volume_size"),
    ("builds: {a: {phantom: {n: 4}, options: {jobs: 0}}}", "builds.a.options.jobs"),
    ("builds: {a: {phantom: {n: 4}, options: {counterfactual: flip}}}", "builds.a.options.counterfactual"),
    ("builds: {a: {phantom: {n: 4}, options: {limit: [phantom=0]}}}", "builds.a.options.limit"),
    ("builds: {a: {phantom: {n: 4}, options: {split_ratio: ['1,2']}}}", "builds.a.options.split_ratio"),
    ("builds: {a: {path: no-such-build}}", "builds.a.path"),
    ("seeds: [0, -2]", "seeds"),
    ("jobs: 0", "jobs"),
    ("modes: {frozen: {options: {max_epochs: 0}}}", "modes.frozen.options.max_epochs"),
    ("modes: {frozen: {options: {lr: -1}}}", "modes.frozen.options.lr"),
    ("modes: {frozen: {options: {bootstrap: 0}}}", "modes.frozen.options.bootstrap"),
    ("modes: {frozen: {options: {device: gpu9}}}", "modes.frozen.options.device"),
    ("modes: {frozen: {cache: {batch_size: 0}}}", "modes.frozen.cache.batch_size"),
    ("modes: {finetune: {options: {max_epochs: 0}}}", "modes.finetune.options.max_epochs"),
    ("modes: {scratch: {options: {loader_workers: -1}}}", "modes.scratch.options.loader_workers"),
    ("mllms: {d: {model: dummy, options: {batch_size: 0}}}", "mllms.d.options.batch_size"),
    # limits the settings classes declare (spar_bench.fields), read without any CLI
    ("builds: {a: {phantom: {n: 4, slices: 4}}}", "builds.a.phantom.slices"),
    ("builds: {a: {phantom: {n: 4}, options: {images: photo}}}", "builds.a.options.images"),
    ("builds: {a: {phantom: {n: 4}, options: {hf: 3}}}", "builds.a.options.hf"),
    ("modes: {frozen: {options: {batch_runs: maybe}}}", "modes.frozen.options.batch_runs"),
    ("modes: {frozen: {cache: {compute: fp8}}}", "modes.frozen.cache.compute"),
    ("modes: {finetune: {options: {compute: fp8}}}", "modes.finetune.options.compute"),
    ("mllms: {d: {model: dummy, options: {retries: 30}}}", "mllms.d.options.retries"),
    ("mllms: {d: {model: dummy, options: {concurrency: 0}}}", "mllms.d.options.concurrency"),
    ("mllms: {d: {model: dummy, options: {guided: json}}}", "mllms.d.options.guided"),
]


def _experiment(tmp_path: Path, line: str) -> Path:
    """A small file with ``line`` as its line 4 (a ``builds:`` line replaces the default one)."""
    default = "builds: {a: {phantom: {n: 4}, options: {samples_per_case: 1, hf: false}}}"
    text = "\n".join(["experiment: t", f"out: {tmp_path / 'out'}", "encoders: {r: {spec: dummy}}", line,
                      "" if line.startswith("builds:") else default])
    path = tmp_path / "t.yaml"
    path.write_text(text + "\n")
    return path


@pytest.mark.parametrize("line,key", BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_file_line_and_key_before_any_step(tmp_path, capsys, line, key):
    path = _experiment(tmp_path, line)
    assert _run([path, "--list"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {path}:4: {key}: "), err
    assert _run([path]) == 2  # and a run stops before its first step
    assert not (tmp_path / "out").exists()


def test_a_declared_limit_says_the_limit(tmp_path, capsys):
    assert _run([_experiment(tmp_path, "builds: {a: {phantom: {n: -3}}}")]) == 2
    err = capsys.readouterr().err
    assert "builds.a.phantom.n: --n (cases) must be an integer >= 1, got -3" in err, err
    assert _run([_experiment(tmp_path, "mllms: {d: {model: dummy, options: {retries: 30}}}")]) == 2
    assert "mllms.d.options.retries: --retries must be <= 20 and >= 0, got 30" in capsys.readouterr().err


# --------------------------------------------------------------------------- hints name real commands
REPO = Path(__file__).resolve().parents[1]


def _groups() -> dict:
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.experiments.cli import cli as bench_cli
    from spar_bench.probes.cli import cli as probe_cli

    return {"bench": bench_cli, "build": build_cli, "probe": probe_cli}


def test_every_command_a_hint_of_the_experiments_package_names_exists():
    import re

    import click

    groups = _groups()
    named = {(m.group(1), m.group(2)) for f in sorted((REPO / "experiments").glob("*.py"))
             for m in re.finditer(r"spar-(bench|build|probe) ([a-z][a-z-]*)", f.read_text())}
    assert named, "no command found: the pattern is out of date"
    missing = [f"spar-{g} {w}" for g, w in sorted(named)
               if groups[g].get_command(click.Context(groups[g]), w) is None]
    assert not missing, f"hints name commands that do not exist: {missing}"


def test_a_full_disk_in_a_step_says_to_rerun_spar_bench_run(pipeline, tmp_path, capsys, monkeypatch):
    """The build's own advice (rerun with --resume) names an option spar-bench run lacks."""
    import errno

    import spar_bench.builder.build as build_module
    from spar_bench.errors import SparError
    from spar_bench.experiments.runner import call

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.tmp"))

    monkeypatch.setattr(build_module, "_prepare_dirs", full)
    with pytest.raises(SparError) as e:  # a build step's library call, as the runner makes it
        call("build", {"source": ["phantom"], "root": [str(pipeline["root"] / "ph")], "out": str(tmp_path / "out"),
                       "options": {"levels": "level1", "no_hf": True}}, None)  # fmt: skip
    err = str(e.value).lower()
    assert "no space left" in err and "rerun the same `spar-bench run` command" in err, err
    assert "--resume" not in err


# --------------------------------------------------------------------------- --devices
@pytest.mark.parametrize("devices,says", [
    ("gpu9", "--devices gpu9: gpu9: not a device"),
    ("cuda:7", "--devices cuda:7: cuda:7: not on this machine (visible: cpu, cuda:0, cuda:1)"),
    ("cpu,cuda:2", "cuda:2: not on this machine (visible: cpu, cuda:0, cuda:1)"),
    (",", "--devices ',': no device given"),
    ("cpu,,cpu", "empty entry"),
])
def test_devices_are_checked_before_any_step(tmp_path, capsys, monkeypatch, devices, says):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    path = _experiment(tmp_path, "mllms: {d: {model: dummy}}")
    assert _run([path, "--devices", devices]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_visible_devices_pass_and_a_printed_plan_does_not_need_them(tmp_path, monkeypatch):
    import torch

    from spar_bench.experiments.values import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_devices("cuda:0, cuda:1,cpu") == ("cuda:0", "cuda:1", "cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert check_devices("cuda:3", here=False) == ("cuda:3",)
    path = _experiment(tmp_path, "modes: {frozen: {options: {device: 'cuda:1'}}}")
    assert _run([path, "--devices", "cuda:0", "--list"]) == 0  # a plan printed on a login node
