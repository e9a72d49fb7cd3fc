"""Issue 44: the command lines take their defaults from the library's config dataclasses
(``default=None``, filled by the dataclass: :func:`spar_bench.clitools.field_options`), and
every option an experiment file can set for a step is an option of its command, and back."""

from __future__ import annotations

import dataclasses
import json

import click
import pytest

from spar_bench.clitools import field_options, given
from spar_bench.experiments.steps import STEPS, spec_fields
from spar_bench.fields import limited
from spar_bench.probes.cache import CacheOptions
from spar_bench.probes.cli import cli
from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
from spar_bench.probes.runs.spec import PredictorSpec, RunSpec
from spar_bench.probes.runs.sweep import SweepConfig
from spar_bench.probes.train import TrainConfig
from spar_bench.probes.vqa.options import VqaOptions

#: each command and the config dataclasses its options fill
CONFIGS = {"fit": (RunSpec, TrainConfig), "sweep": (SweepConfig,), "finetune": (FinetuneConfig, FinetuneSpec),
           "cache": (CacheOptions,), "vqa": (VqaOptions,), "predict": (PredictorSpec,)}  # fmt: skip
#: the options every command shares (probes/cli/options.py declares each once for all commands)
SHARED = {"head", "heads", "probes", "seeds", "device", "compute", "threads", "n_boot"}


def _options(name: str) -> list[click.Option]:
    cmd = cli.get_command(click.Context(cli), name)
    return [p for p in cmd.params if isinstance(p, click.Option) and p.expose_value]


def _default(p: click.Option):
    return None if p.default is None or type(p.default).__name__ == "Sentinel" else p.default


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_option_restates_a_dataclass_default(name):
    fields = {f.name: f for c in CONFIGS[name] for f in dataclasses.fields(c)}
    restated = [f"--{p.name} {p.default!r}" for p in _options(name)
                if p.name in fields and p.name not in SHARED and _default(p) is not None
                and not (p.is_flag and p.default is False)]  # fmt: skip
    assert restated == []


@pytest.mark.parametrize("name", ["finetune", "cache", "sweep", "vqa"])
def test_each_generated_option_shows_its_fields_default(name):
    fields = {f.name: f for c in CONFIGS[name] for f in dataclasses.fields(c)}
    shown = [(p, fields[p.name].default) for p in _options(name)
             if p.name in fields and p.name not in SHARED and "[default: " in (p.help or "")]  # fmt: skip
    assert shown
    for p, default in shown:
        text = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        assert p.help.endswith(f"[default: {text}]"), p.name


@pytest.mark.parametrize("command", ["finetune", "cache", "sweep", "vqa"])
def test_every_option_of_a_step_is_on_the_command_line_and_back(command):
    """An experiment file's options for a step are its command's options (aliases and
    ``no_`` switches resolved); the command's other options are what the step sets itself."""
    params = {p.name for p in _options(command) if not p.name.startswith("_old_")}
    fields, aliases = set(spec_fields(command)), STEPS.get(command).aliases

    def in_yaml(p: str) -> str | None:
        a = aliases.get(p, p).lstrip("!")
        return a if a in fields else (p[3:] if p.startswith("no_") and p[3:] in fields else None)

    assert sorted(f for f in fields if not any(in_yaml(p) == f for p in params)) == []
    own = {"finetune": {"encoder", "model_args", "data", "head", "probes", "seeds", "out", "resume", "overwrite"},
           "cache": {"encoder", "weights", "random_init", "revision", "model_args", "probe", "data", "out"},
           "sweep": {"features", "heads", "probes", "seeds", "out", "list_ids", "only", "partition"},
           "vqa": {"model", "answers", "data", "out"}}[command]  # fmt: skip
    assert sorted(p for p in params if in_yaml(p) is None) == sorted(own)


def test_finetunes_training_options_reach_its_config(tmp_path, monkeypatch):
    """``--grad-clip`` and friends (once YAML only) fill FinetuneConfig; unset ones keep its defaults."""
    from spar_bench.clitools import run_cli
    from spar_bench.probes.runs import session

    seen = []

    def fake(fs, out, **kw):
        seen.append(fs)
        (tmp_path / "metrics.json").write_text(json.dumps({"headline": "accuracy", "test": {"accuracy": 0.5}}))
        return tmp_path

    monkeypatch.setattr(session, "run", fake)
    argv = ["finetune", "--encoder", "dummy", "--data", str(tmp_path), "--probe", "level3.size",
            "--out", str(tmp_path / "o"), "--grad-clip", "0.5", "--sinkhorn-iters", "7", "--val-fraction", "0.2"]
    assert run_cli(cli, argv) == 0
    cfg = seen[0].cfg
    assert (cfg.grad_clip, cfg.sinkhorn_iters, cfg.val_fraction) == (0.5, 7, 0.2)
    assert cfg == FinetuneConfig(grad_clip=0.5, sinkhorn_iters=7, val_fraction=0.2)  # the rest: its defaults


def test_predict_takes_a_kinds_options(tmp_path, monkeypatch):
    from spar_bench.probes.cli.predict import kind_options

    assert kind_options(("epochs=2", "lr=1e-3", "name=x", "sizes=[1,2]")) == {
        "epochs": 2, "lr": 0.001, "name": "x", "sizes": [1, 2]}
    assert json.dumps(kind_options(())) == "{}"


def test_field_options_fill_only_what_was_given():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        rate: float = limited(0.5, help="A rate.")
        n: int = limited(3, lo=1)

    @click.command()
    @field_options(Cfg, "rate", "n")
    def cmd(**kw):
        click.echo(json.dumps(dataclasses.asdict(Cfg(**given(kw)))))

    from click.testing import CliRunner

    assert json.loads(CliRunner().invoke(cmd, ["--n", "5"]).output) == {"rate": 0.5, "n": 5}
    out = CliRunner().invoke(cmd, ["--help"]).output
    assert "A rate.  [default: 0.5]" in out and "[default: 3]" in out
    assert CliRunner().invoke(cmd, ["--n", "0"]).exit_code == 2  # its limit, as the click type
