"""One meaning per option across ``spar-build``, ``spar-probe`` and ``spar-bench`` (README, "One
vocabulary"): ``--device`` (default ``auto``), ``--compute`` (auto/fp32/bf16/fp16), ``--dtype``
(storage only), ``--seeds`` (comma list), ``--threads`` (default 1); ``finetune`` takes the head
options of ``fit``; ``vqa --dtype``/``--seed`` are hidden old spellings with a note.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from spar_bench.errors import SparError
from spar_bench.probes.cli import cli

from helpers import run_cmd

SHARED = ("--device", "--compute", "--dtype", "--seeds", "--threads")
TINY_VIT = ("timm:vit_tiny_patch16_224", '{"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64}')


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


def _option(command: click.Command, flag: str) -> click.Option | None:
    opts = [p for p in command.params if isinstance(p, click.Option) and flag in p.opts and not p.hidden]
    return opts[0] if opts else None


def _default(opt: click.Option):
    """The value an option not given has (None; its config field's, filled when parsed)."""
    with click.Context(click.Command("x")) as ctx:
        return opt.process_value(ctx, None)


def _meaning(opt: click.Option) -> tuple:
    """What an option means to a user: its default, type (choices), metavar and help (but the
    default it shows, the default's)."""
    text = (opt.help or "").split("  [default: ")[0]
    return _default(opt), repr(opt.type), getattr(opt.type, "choices", None), opt.metavar, text


@pytest.mark.parametrize("command", ["cache", "finetune", "fit", "sweep", "vqa"])
def test_every_device_defaults_to_auto(command) -> None:
    assert _default(_option(_commands()[f"spar-probe {command}"], "--device")) == "auto"


def test_one_threads_default() -> None:
    defaults = {name: _default(_option(c, "--threads")) for name, c in _commands().items() if _option(c, "--threads")}
    assert set(defaults) >= {"spar-probe fit", "spar-probe sweep", "spar-probe finetune"}
    assert set(defaults.values()) == {1}, defaults


def test_every_shared_option_has_one_meaning() -> None:
    """Walks every command of the three groups: each visible ``--device``, ``--compute``,
    ``--threads`` means the same everywhere; ``--seeds`` too but for its default (``sweep``
    runs three); ``--dtype`` is the storage precision only; an old spelling is hidden."""
    from spar_bench.probes.cache import STORAGE_DTYPES
    from spar_bench.probes.cli.options import parse_seeds

    meanings: dict[str, dict[str, tuple]] = {flag: {} for flag in SHARED}
    for name, command in _commands().items():
        for p in command.params:
            for flag in set(SHARED) & set(getattr(p, "opts", ())):
                if p.hidden:
                    assert p.help.startswith("Old spelling of"), (name, flag)
                    continue
                meanings[flag][name] = _meaning(p)
    assert len(meanings["--device"]) == 5 and len(meanings["--seeds"]) == 5, meanings
    for flag in ("--device", "--compute", "--threads"):
        assert len(set(meanings[flag].values())) == 1, (flag, meanings[flag])
    assert len({m[1:] for m in meanings["--seeds"].values()}) == 1, meanings["--seeds"]
    assert all(parse_seeds(m[0]) for m in meanings["--seeds"].values())
    assert {m[2] for m in meanings["--dtype"].values()} == {tuple(sorted(STORAGE_DTYPES))}, meanings["--dtype"]
    assert set(meanings["--compute"]) >= {"spar-probe cache", "spar-probe finetune", "spar-probe vqa"}


# -- vqa: --compute, --seeds, and the hidden --dtype, --seed ----------------------------------
class _Stop(SparError):
    pass


def _vqa_options(monkeypatch, pipeline, capsys, *args) -> tuple[object, str]:
    """The :class:`BackendOptions` ``spar-probe vqa --model hf:x ARGS`` loads its model with
    (stopped there), and its stderr."""
    import spar_bench.probes.vqa as vqa

    seen = []

    def load(spec, options):
        seen.append(options)
        raise _Stop("stop")

    monkeypatch.setattr(vqa, "load_backend", load)
    capsys.readouterr()
    assert run_cmd(cli, ["vqa", "--model", "hf:x", "--data", pipeline["shards"], *args]) == 2
    return seen[0], capsys.readouterr().err


def test_vqa_compute_is_the_old_dtype(monkeypatch, pipeline, capsys) -> None:
    """``--compute fp32`` loads an ``hf:`` model as ``--dtype float32`` did (the dtype its runs
    record as ``decoding.dtype``, which names their folder: the same run); the old spelling
    still works, hidden, with a one-line note."""
    from spar_bench.probes.hardware import pick_compute, pick_device

    for new, old in (("fp32", "float32"), ("bf16", "bfloat16")):
        options, err = _vqa_options(monkeypatch, pipeline, capsys, "--device", "cpu", "--compute", new)
        assert options.dtype == old and options.device == "cpu" and "note" not in err
        before, err = _vqa_options(monkeypatch, pipeline, capsys, "--device", "cpu", "--dtype", old)
        assert before == options
        assert err.startswith("note: --dtype is deprecated") and "give --compute" in err, err
    options, _ = _vqa_options(monkeypatch, pipeline, capsys)
    dev = pick_device("auto")
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    assert (options.device, options.dtype) == (str(dev), names[pick_compute("auto", dev).dtype])
    for stated, dtype in (("native", "bfloat16"), ("none", "float32")):  # auto on either kind of CPU
        monkeypatch.setenv("SPAR_CPU_BF16", stated)
        options, _ = _vqa_options(monkeypatch, pipeline, capsys, "--device", "cpu")
        assert options.dtype == dtype
    capsys.readouterr()
    rc = run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--dtype", "float32",
                       "--compute", "fp32"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--dtype and --compute" in err, err


def _seed_folders(out: Path) -> list[str]:
    return sorted({p.parent.name for p in out.glob("dummy/level3.size/*/seed*/metrics.json")})


def test_vqa_seeds_and_the_hidden_seed(pipeline, tmp_path, capsys) -> None:
    base = ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--probe", "size", "--bootstrap", 10]
    assert run_cmd(cli, [*base, "--out", tmp_path / "a", "--seeds", "0,2"]) == 0
    assert _seed_folders(tmp_path / "a") == ["seed0", "seed2"]
    capsys.readouterr()
    assert run_cmd(cli, [*base, "--out", tmp_path / "b", "--seed", 2]) == 0
    assert "note: --seed is deprecated" in capsys.readouterr().err
    assert _seed_folders(tmp_path / "b") == ["seed2"]
    answers = lambda out: (out / "dummy/level3.size/vqa-loglik/seed2/answers.jsonl").read_text()  # noqa: E731
    assert answers(tmp_path / "b") == answers(tmp_path / "a")  # the same run as --seeds 2


# -- finetune: fit's head options -------------------------------------------------------------
def test_finetune_takes_fits_head_options(monkeypatch, tmp_path, capsys) -> None:
    from spar_bench.probes.runs import session

    specs = []

    def fake_run(fs, out, **_kw):
        specs.append(fs)
        rd = Path(out) / f"{fs.probe}-{fs.head}-{fs.seed}"
        rd.mkdir(parents=True, exist_ok=True)
        (rd / "metrics.json").write_text(json.dumps({"headline": "accuracy", "test": {"accuracy": 0.5}}))
        return rd

    monkeypatch.setattr(session, "run", fake_run)  # the one loop, session.run_all, calls it
    base = ["finetune", "--encoder", "dummy", "--data", tmp_path, "--probe", "level3.size", "--out", tmp_path / "o"]
    assert run_cmd(cli, [*base, "--head", "mlp,transformer", "--d-model", 32, "--hidden", 16,
                         "--proj-dim", "none"]) == 0  # fmt: skip
    assert {s.head: s.head_cfg for s in specs} == {"mlp": {"hidden": 16},
                                                   "transformer": {"d_model": 32, "proj_dim": "none"}}
    capsys.readouterr()
    rc = run_cmd(cli, [*base, "--head", "mlp", "--d-model", 32])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--d-model" in err, err


def _help_of(command: str, flag: str) -> str:
    with click.Context(cli) as ctx:
        return _option(cli.get_command(ctx, command), flag).get_help_record(ctx)[1]


def test_head_option_help_reads_the_head_classes_defaults(monkeypatch) -> None:
    """The help of a head option shows the head classes' ``DEFAULTS`` (changed here: 48, 1024)."""
    from spar_bench.probes.heads import HEADS, head_defaults

    monkeypatch.setitem(HEADS.get("transformer").DEFAULTS, "d_model", 48)
    monkeypatch.setitem(HEADS.get("mlp").DEFAULTS, "hidden", 1024)
    text = _help_of("fit", "--d-model")
    assert "48 transformer" in text and f"{head_defaults('attnpool')['d_model']} attnpool" in text, text
    assert "[default: 1024]" in _help_of("sweep", "--hidden")
    assert "48 transformer" in _help_of("finetune", "--d-model")


def test_finetune_records_a_head_option(pipeline, tmp_path) -> None:
    """A real (tiny) finetune run given ``--hidden 16``: its head has it, config.json records
    it and its folder is named by it."""
    out = tmp_path / "runs"
    assert run_cmd(cli, ["finetune", "--encoder", TINY_VIT[0], "--model-args", TINY_VIT[1], "--init", "scratch",
                         "--data", pipeline["shards"], "--probe", "level3.size", "--head", "mlp", "--hidden", 16,
                         "--max-epochs", 1, "--batch-size", 8, "--bootstrap", 10, "--no-controls",
                         "--device", "cpu", "--compute", "fp32", "--out", out]) == 0  # fmt: skip
    (config,) = out.glob("*/level3.size/*/seed0/config.json")
    assert "hidden=16" in config.parent.parent.name.split(",")
    assert json.loads(config.read_text())["extra"]["head_config"]["hidden"] == 16
