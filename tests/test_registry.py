"""Registries: unknown names are one-line ConfigErrors with "did you mean"; tests add and remove
entries through the public API; every CLI names a mistyped source / encoder / head / probe
before it looks at any file."""

from __future__ import annotations

from pathlib import Path

import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.builder.sources import SOURCES
from spar_bench.clitools import run_cli
from spar_bench.errors import ConfigError, SparError
from spar_bench.probes.cli import cli as probe_cli
from spar_bench.registry import Registry, UnknownNameError


def test_unknown_name_is_a_config_error_with_suggestions() -> None:
    reg: Registry = Registry("colour")
    reg.register("violet", 1)
    reg.register_lazy("green", "os.path:join")
    with pytest.raises(ConfigError) as e:
        reg.get("gren")
    assert isinstance(e.value, UnknownNameError) and isinstance(e.value, SparError)
    assert str(e.value) == "unknown colour 'gren'. Did you mean 'green'? Known: green, violet"
    with pytest.raises(UnknownNameError):
        reg.meta("blue")
    assert reg.check("violet") == "violet"


def test_register_unregister_and_the_context_manager() -> None:
    reg: Registry = Registry("thing")
    reg.register("a", 1)
    with reg.registered("b", 2):
        assert reg.get("b") == 2 and reg.names() == ["a", "b"]
    assert "b" not in reg
    with reg.registered("a", 10, note="temp"):  # replaces, then restores
        assert reg.get("a") == 10 and reg.meta("a") == {"note": "temp"}
    assert reg.get("a") == 1 and reg.meta("a") == {}
    reg.unregister("a")
    assert len(reg) == 0
    with pytest.raises(UnknownNameError):
        reg.unregister("a")


def _one_line_error(capsys, rc: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


def test_build_names_a_mistyped_source_before_its_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    rc = run_cli(build_cli, ["--source", "wrod", "--root", "d", "--out", "X"])
    _one_line_error(capsys, rc, "unknown source 'wrod'", "Did you mean 'word'")
    rc = run_cli(build_cli, ["--source", "wrod", "--out", "X"])  # no --root: still the name
    err = _one_line_error(capsys, rc, "Did you mean 'word'")
    assert "data folder" not in err
    rc = run_cli(build_cli, ["inspect", "--source", "wrod", "--root", "d"])
    _one_line_error(capsys, rc, "Did you mean 'word'")
    assert not (tmp_path / "X").exists()


def test_probe_commands_name_mistyped_heads_probes_and_encoders(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "none.h5")
    rc = run_cli(probe_cli, ["fit", "--features", missing, "--head", "mpl"])
    _one_line_error(capsys, rc, "unknown head 'mpl'", "'mlp'")
    rc = run_cli(probe_cli, ["fit", "--features", missing, "--probe", "level1.localisaton"])
    _one_line_error(capsys, rc, "unknown probe", "'level1.localisation'")
    rc = run_cli(probe_cli, ["sweep", "--features", missing, "--heads", "mlp,transfomer"])
    _one_line_error(capsys, rc, "'transformer'")
    rc = run_cli(probe_cli, ["cache", "--encoder", "tim:resnet50", "--data", str(tmp_path),
                             "--out", str(tmp_path / "c.h5")])
    _one_line_error(capsys, rc, "unknown encoder family 'tim'", "'timm'")
    rc = run_cli(probe_cli, ["cache", "--encoder", "dumy", "--data", str(tmp_path),
                             "--out", str(tmp_path / "c.h5")])
    _one_line_error(capsys, rc, "unknown encoder 'dumy'", "'dummy'")
    rc = run_cli(probe_cli, ["finetune", "--encoder", "tim:resnet10t", "--data", str(tmp_path / "none"),
                             "--probe", "level1.localisation"])
    _one_line_error(capsys, rc, "unknown encoder family 'tim'", "'timm'")


def test_a_multi_line_message_is_printed_on_one_line(capsys) -> None:
    import click

    @click.command()
    def boom() -> None:
        raise ConfigError("first line\nsecond line\n")

    rc = run_cli(boom, [])
    assert _one_line_error(capsys, rc) == "error: first line second line\n"


def test_sources_registry_lists_the_builtin_names() -> None:
    assert {"word", "lits", "totalsegmentator", "nnunet", "phantom"} <= set(SOURCES.names())
