"""Settings limits declared once (spar_bench.fields): checked by the library class, read by the
command lines as click types, and the one naming interface every run kind's spec shares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from spar_bench.clitools import declared_type
from spar_bench.errors import ConfigError
from spar_bench.fields import Limit, check_fields, limit_of, limited


@dataclass(frozen=True)
class _Settings:
    n: int = limited(1, lo=1)
    p: float = limited(0.5, lo=0.0, hi=1.0, flag="--share")
    mode: str = limited("a", choices=("a", "b"))
    free: int = 3

    def __post_init__(self) -> None:
        check_fields(self)


def test_limits_refuse_in_one_line_naming_the_flag() -> None:
    assert _Settings(n=5, p=1.0, mode="b").n == 5
    with pytest.raises(ConfigError, match=r"^--n must be >= 1, got 0$"):
        _Settings(n=0)
    with pytest.raises(ConfigError, match=r"^--share must be <= 1.0 and >= 0.0, got 1.5$"):
        _Settings(p=1.5)
    with pytest.raises(ConfigError, match=r"^--mode must be one of a, b, got 'c'$"):
        _Settings(mode="c")
    with pytest.raises(ConfigError, match="must be a number"):
        _Settings(n="3")  # type: ignore[arg-type]
    assert limit_of(_Settings, "free") is None and Limit(lo=1).problem(None) is None


def test_the_command_line_types_come_from_the_declaration() -> None:
    t = declared_type(_Settings, "n")
    assert isinstance(t, click.IntRange) and (t.min, t.max) == (1, None)
    assert isinstance(declared_type(_Settings, "p"), click.FloatRange)
    assert list(declared_type(_Settings, "mode").choices) == ["a", "b"]
    with pytest.raises(TypeError):
        declared_type(_Settings, "free")


def test_the_commands_read_the_library_declarations() -> None:
    """``spar-probe vqa --retries`` and ``spar-build phantom --in-plane`` take their ranges from
    the settings classes, so the two can never disagree."""
    from spar_bench.builder.phantom.cli import phantom_command
    from spar_bench.probes.cli.vqa import vqa_command
    from spar_bench.probes.vqa.options import VqaOptions

    params = {p.name: p for p in vqa_command.params}
    assert (params["retries"].type.min, params["retries"].type.max) == (0, 20)
    with pytest.raises(ConfigError, match="--retries"):
        VqaOptions(retries=21)
    in_plane = next(p for p in phantom_command.params if p.name == "in_plane")
    assert in_plane.type.min == 32


def test_every_run_kind_spec_names_its_folder_one_way(tmp_path: Path) -> None:
    from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
    from spar_bench.probes.runs.spec import NamedRun, PredictorSpec, RunSpec
    from spar_bench.probes.train import TrainConfig
    from spar_bench.probes.vqa.ask import AskConfig
    from spar_bench.probes.vqa.base import BackendOptions
    from spar_bench.probes.vqa.predictor import MllmSpec

    generate = BackendOptions(mode="generate")  # an MLLM spec is data: the model named, its backend the job's
    specs = {
        "head": (RunSpec("f.h5", "level3.size", "mlp", 1), RunSpec("f.h5", "level3.size", "mlp", 1,
                                                                   train=TrainConfig(lr=0.5))),
        "oracle": (PredictorSpec("level3.size", "oracle", 1), None),
        "finetune": (FinetuneSpec("timm:x", "b", "level3.size", "mlp", 1),
                     FinetuneSpec("timm:x", "b", "level3.size", "mlp", 1, cfg=FinetuneConfig(max_epochs=2))),
        "mllm": (MllmSpec("dummy", "", "level3.size", AskConfig(seed=1), generate),
                 MllmSpec("dummy", "", "level3.size", AskConfig(seed=1, splits=("val",)), generate)),
    }
    for kind, (plain, changed) in specs.items():
        assert isinstance(plain, NamedRun) and plain.kind == kind
        head = plain.head_name()
        assert plain.slug("enc") == f"enc/level3.size/{head}/seed1"
        assert plain.run_dir(tmp_path, "enc") == tmp_path / plain.slug("enc")
        assert plain.identity("enc") == {"kind": kind, "model": "enc", "probe": "level3.size", "head": head,
                                         "variant": "", "seed": 1}
        if changed is not None:  # an option off its default names the folder and the identity
            assert changed.variant() and changed.slug("enc") == f"enc/level3.size/{head},{changed.variant()}/seed1"
            assert changed.identity("enc") != plain.identity("enc")
    assert specs["finetune"][1].variant() == "max_epochs=2" and specs["mllm"][1].variant() == "splits=val"
