"""Issue 44: the command lines take their defaults from the library's config dataclasses
(``default=None``, filled by the dataclass: :func:`spar_bench.clitools.field_options`), and
every option an experiment file can set for a step is an option of its command, and back."""

from __future__ import annotations

import dataclasses
import json

import click
import pytest

from spar_bench.clitools import FieldOption, field_default, field_options, given
from spar_bench.experiments.steps import STEPS, spec_fields
from spar_bench.fields import limited
from spar_bench.probes.cache import CacheOptions
from spar_bench.probes.cli import cli
from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
from spar_bench.probes.runs.session import EvalTarget
from spar_bench.probes.runs.spec import PredictorSpec, RunSpec
from spar_bench.probes.runs.sweep import SweepConfig
from spar_bench.probes.train import TrainConfig
from spar_bench.probes.vqa.options import VqaOptions

#: each command and the config dataclasses its options fill
CONFIGS = {"fit": (RunSpec, TrainConfig), "sweep": (SweepConfig,), "finetune": (FinetuneConfig, FinetuneSpec),
           "cache": (CacheOptions,), "vqa": (VqaOptions,), "predict": (PredictorSpec,), "eval": (EvalTarget,)}  # fmt: skip
#: the options whose default no config holds: where ``spar-probe report`` writes, how ``spar-bench
#: run`` runs, and a phantom's number of cases (write_phantom_dataset's argument: 150 cases on
#: the command line, 12 in an experiment file's phantom build)
NO_CONFIG = {("spar-probe report", "out"), ("spar-bench run", "executor"), ("spar-bench run", "follow"),
             ("spar-build phantom", "n")}


def _commands() -> dict[str, click.Command]:
    """Every command of the three console scripts, by ``"<script> <command>"``."""
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.experiments.cli import cli as bench_cli

    found = {}
    for script, group in (("spar-build", build_cli), ("spar-probe", cli), ("spar-bench", bench_cli)):
        found[script] = group
        with click.Context(group) as ctx:
            for name in group.list_commands(ctx):
                found[f"{script} {name}"] = group.get_command(ctx, name)
    return found


def _options(cmd: click.Command | str) -> list[click.Option]:
    cmd = cli.get_command(click.Context(cli), cmd) if isinstance(cmd, str) else cmd
    return [p for p in cmd.params if isinstance(p, click.Option) and p.expose_value and not p.hidden]


def _default(p: click.Option):
    return None if p.default is None or type(p.default).__name__ == "Sentinel" else p.default


def _parsed(p: click.Option):
    """The value option ``p`` has when not given (a shared option's: its field's, filled)."""
    with click.Context(click.Command("x")) as ctx:
        return p.process_value(ctx, None)


def test_no_option_restates_a_default():
    """Every option of every command (the three scripts) has default None (a switch: off), but
    where no config holds its default: a default lives in its config's field only."""
    restated = [f"{name} --{p.name} {p.default!r}" for name, cmd in _commands().items() for p in _options(cmd)
                if _default(p) not in (None, ()) and not (p.is_flag and p.default is False)
                and (name, p.name) not in NO_CONFIG]  # fmt: skip
    assert restated == []


def test_every_generated_option_shows_its_fields_default():
    """Each option made from a field (:class:`FieldOption`), in every command of the three
    scripts, shows that field's default, and has it when not given (where the command reads the
    value itself) or None (the config fills it)."""
    generated = [(name, p) for name, cmd in _commands().items() for p in _options(cmd) if isinstance(p, FieldOption)]
    assert {name for name, _ in generated} >= {f"spar-probe {n}" for n in CONFIGS} | {
        "spar-build", "spar-build inspect", "spar-build phantom", "spar-build export"}
    for name, p in generated:
        default = field_default(p.config, p.field)
        text = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        assert p.help_text().endswith(f"[default: {text}]"), (name, p.name)
        value = _parsed(p)
        assert value is None or value == p.type_cast_value(click.Context(cli), default if not p.multiple or
                                                           isinstance(default, tuple) else (default,)), p.name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_option_fills_a_field_of_its_commands_configs(name):
    """A spar-probe command's generated options fill fields of its configs, or of
    :class:`SweepConfig` (the home of the runs folder's and the thread count's defaults)."""
    outside = [(p.name, p.config) for p in _options(name) if isinstance(p, FieldOption)
               and p.config not in (*CONFIGS[name], SweepConfig)]  # fmt: skip
    assert outside == []


@pytest.mark.parametrize("name", ["fit", "sweep", "finetune", "cache", "vqa", "predict", "eval"])
def test_the_shared_options_are_generated(name):
    """``--probe --head --seeds --out --device --compute --threads --bootstrap`` of every command
    are made from the field each fills: none is declared with a default of its own."""
    shared = {"probes", "head", "heads", "seeds", "out", "device", "compute", "threads", "n_boot"}
    params = {p.name: p for p in _options(name) if p.name in shared and not p.required}
    assert params
    assert sorted(n for n, p in params.items() if not isinstance(p, FieldOption)) == []


def test_where_a_shared_option_fills_fields_of_different_defaults():
    """``fit --device`` fills a run's ``TrainConfig.device``, a device already resolved whose
    default is cpu (a Python caller's); the command line's is ``auto`` like every ``--device``,
    taken from :class:`SweepConfig` (fit runs one sweep's grid in its process) and resolved before
    it reaches the run. ``--seeds`` fills a run's ``seed`` (0) in fit, finetune, predict and vqa, and
    a sweep's ``seeds`` (0,1,2)."""
    by = {n: {p.name: p for p in _options(n)} for n in ("fit", "sweep", "finetune", "predict", "vqa")}
    assert (by["fit"]["device"].config, _parsed(by["fit"]["device"]), TrainConfig().device) == (SweepConfig, "auto", "cpu")
    assert "[default: auto]" in by["fit"]["device"].help and "cpu" not in by["fit"]["device"].help.split("[")[1]
    seeds = {n: (by[n]["seeds"].config.__name__, by[n]["seeds"].field, _parsed(by[n]["seeds"])) for n in by}
    assert seeds == {"fit": ("RunSpec", "seed", "0"), "sweep": ("SweepConfig", "seeds", "0,1,2"),
                     "finetune": ("FinetuneSpec", "seed", "0"), "predict": ("PredictorSpec", "seed", "0"),
                     "vqa": ("VqaOptions", "seeds", "0")}  # fmt: skip


def test_fit_and_predict_runs_get_the_fields_defaults(tmp_path, monkeypatch):
    """The defaults filled when parsed reach the runs: fit's head, seed, n_boot, the device
    (auto, resolved) and the runs folder; predict's seed and n_boot."""
    from spar_bench.clitools import run_cli
    from spar_bench.probes.cli import fit, predict
    from spar_bench.probes.cli.options import resolved_device

    seen = []

    def fake(groups, out, **kw):
        seen.append(([s for g in groups for s in g], out))
        return iter(())

    monkeypatch.setattr(fit, "run_all", fake)
    monkeypatch.setattr(fit, "cache_probes", lambda probes, features: ["level3.size"])
    monkeypatch.chdir(tmp_path)
    assert run_cli(cli, ["fit", "--features", "f.h5"]) == 0
    (run,), out = seen.pop()
    assert (run.head, run.seed, run.n_boot, run.train.device, out) == ("mlp", 0, 1000, resolved_device("auto"), "runs")
    monkeypatch.setattr(predict, "run_all", fake)
    monkeypatch.setattr(predict, "run_kind", lambda kind: type("K", (), {"on_build": staticmethod(print)}))
    monkeypatch.setattr(predict, "Build", lambda data: type("B", (), {"levels": lambda self: ["level3"]})())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text("{}")
    assert run_cli(cli, ["predict", "--kind", "prior", "--data", "b", "--probe", "level3.size"]) == 0
    specs, out = seen.pop()
    assert [(s.seed, s.n_boot) for s in specs] == [(0, 1000)] and out == "runs"


#: each step kind with a command-line twin: the command, and the command's options the step sets itself
TWINS = {"finetune": ("spar-probe finetune", {"encoder", "model_args", "data", "head", "probes", "seeds", "out",
                                              "resume", "overwrite"}),
         "cache": ("spar-probe cache", {"encoder", "weights", "random_init", "revision", "model_args", "probe",
                                        "data", "out"}),
         "sweep": ("spar-probe sweep", {"features", "heads", "probes", "seeds", "out", "list_ids", "only",
                                        "partition"}),
         "vqa": ("spar-probe vqa", {"model", "answers", "data", "out"}),
         "phantom": ("spar-build phantom", {"out_dir", "overwrite"}),
         "build": ("spar-build", {"source", "root", "out", "resume", "overwrite"})}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(TWINS))
def test_every_option_of_a_step_is_on_the_command_line_and_back(kind):
    """An experiment file's options for a step are its command's options (aliases and
    ``no_`` switches resolved); the command's other options are what the step sets itself."""
    command, own = TWINS[kind]
    params = {p.name for p in _options(_commands()[command]) if p.name not in ("help", "version")}
    fields, aliases = set(spec_fields(kind)), STEPS.get(kind).aliases

    def in_yaml(p: str) -> str | None:
        a = aliases.get(p, p).lstrip("!")
        return a if a in fields else (p[3:] if p.startswith("no_") and p[3:] in fields else None)

    assert sorted(f for f in fields if not any(in_yaml(p) == f for p in params)) == []
    assert sorted(p for p in params if in_yaml(p) is None) == sorted(own)


def test_an_experiment_files_phantom_takes_every_option_of_the_step(tmp_path):
    """``builds.NAME.phantom`` accepts each option of the phantom step (``lesions`` and ``jobs``
    were refused as unknown keys), and they reach its spec."""
    from spar_bench.experiments.config import SCHEMA, load_experiment
    from spar_bench.experiments.plan import make_plan

    aliases = STEPS.get("phantom").aliases
    assert {aliases.get(k, k) for k in SCHEMA["builds"]["*"]["phantom"]} == set(spec_fields("phantom"))
    path = tmp_path / "e.yaml"
    path.write_text(f"experiment: t\nout: {tmp_path}/out\nbuilds:\n  p:\n    phantom: {{n: 2, lesions: false, jobs: 2}}\n"
                    "    options: {levels: level3}\nprobes: level3.size\n")  # fmt: skip
    (step,) = [s for s in make_plan(load_experiment(path)).steps if s.kind == "build"]
    spec = dict(step.specs)["phantom"]
    assert {k: spec[k] for k in spec if k != "out"} == {"n": 2, "layout": "canonical", "lesions": False, "jobs": 2}


def test_a_phantom_steps_jobs_are_its_processes(monkeypatch, tmp_path):
    """A phantom step's ``jobs`` reaches write_phantom_dataset as ``--jobs`` does (1 when not given)."""
    from spar_bench.experiments import step_kinds

    seen = []
    monkeypatch.setattr(step_kinds, "write_phantom_dataset", lambda out, n, opts, **kw: seen.append((n, opts, kw)))
    call = STEPS.get("phantom").call
    call({"out": str(tmp_path / "o"), "n": 3, "layout": "canonical", "lesions": False, "jobs": 2}, None)
    call({"out": str(tmp_path / "o"), "n": 3, "layout": "canonical"}, None)
    assert [(n, o.lesions, kw["workers"]) for n, o, kw in seen] == [(3, False, 2), (3, True, 1)]


def test_a_finetune_step_runs_on_threads_as_the_command_does(monkeypatch, one_torch_thread):
    """A finetune step's ``threads`` not given is ``--threads``'s default (1: the same bits on
    every machine), not torch's own (every core), as it was."""
    import torch

    from spar_bench.experiments import step_kinds

    monkeypatch.setattr(step_kinds, "finetune_specs", lambda *a, **kw: [])
    monkeypatch.setattr(step_kinds, "run_all", lambda *a, **kw: iter(()))
    spec = {"encoder": "dummy", "data": "d", "probes": ["all"], "heads": ["mlp"], "seeds": [0], "out": "o"}
    for options, threads in (({"threads": 2}, 2), ({}, 1)):
        torch.set_num_threads(3)
        STEPS.get("finetune").call({**spec, "options": options}, None)
        assert torch.get_num_threads() == threads


def test_predict_takes_what_an_experiment_files_predictor_does():
    """``predictors.NAME`` (``kind``, ``builds``, ``bootstrap``, ``options``) and the file's
    ``probes``/``seeds`` are ``spar-probe predict``'s options; ``out``, ``overwrite``: the step's own."""
    from spar_bench.experiments.config import SCHEMA

    twin = {"kind": "kind", "builds": "data", "bootstrap": "n_boot", "options": "options"}
    assert set(SCHEMA["predictors"]["*"]) == set(twin)
    params = {p.name for p in _options("predict")}
    assert params == {*twin.values(), "probes", "seeds", "out", "overwrite"}


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
