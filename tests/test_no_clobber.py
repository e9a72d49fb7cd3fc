"""Nothing finished is replaced without ``--overwrite`` (issue 19): a rerun with the same
options keeps the finished run, one with other options writes its own folder or is refused
in one line naming the finished one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spar_bench.errors import ConfigError

from helpers import run_cmd

TINY_VIT = ("timm:vit_tiny_patch16_224", {"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64})


def _finetune(pipeline, out: Path, **kw):
    from spar_bench.probes.finetune.config import FinetuneConfig
    from spar_bench.probes.finetune.run import run_finetune

    opts = {"batch_size": 16, "max_epochs": 1, "device": "cpu", "compute": "fp32", **kw.pop("cfg", {})}
    return run_finetune(TINY_VIT[0], pipeline["shards"], "mlp", "level1.localisation", 0, out, init="scratch",
                        model_kwargs=TINY_VIT[1], cfg=FinetuneConfig(**opts), controls=False,
                        n_boot=kw.pop("n_boot", 20), progress=False, **kw)  # fmt: skip


def test_finetune_keeps_a_finished_run(pipeline, tmp_path: Path, monkeypatch, capsys) -> None:
    """Case (1): a second finetune with --encoder-lr 0.01 replaced the first run."""
    from spar_bench.probes.finetune import loop

    out = tmp_path / "runs_ft"
    first = _finetune(pipeline, out)
    assert first.parent.name == "mlp,batch_size=16,max_epochs=1"  # named by its options, as fit's
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    # another option: its own folder, the first run untouched
    other = _finetune(pipeline, out, cfg={"encoder_lr": 0.01})
    assert other.parent.name == "mlp,batch_size=16,encoder_lr=0.01,max_epochs=1"
    assert json.loads((other / "metrics.json").read_text())["variant"] == "batch_size=16,encoder_lr=0.01,max_epochs=1"
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before

    def no_training(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(loop.Trainer, "fit", no_training)
    assert _finetune(pipeline, out) == first  # the same options: kept, not retrained
    # options that do not name the folder are checked against the finished run's
    with pytest.raises(ConfigError) as e:
        _finetune(pipeline, out, n_boot=30)
    msg = str(e.value)
    assert str(first) in msg and "n_bootstrap=20 (now 30)" in msg and "--overwrite" in msg and "\n" not in msg
    from spar_bench.probes.cli import cli

    args = ["finetune", "--encoder", TINY_VIT[0], "--init", "scratch", "--model-args", json.dumps(TINY_VIT[1]),
            "--data", pipeline["shards"], "--probe", "level1.localisation", "--out", out, "--batch-size", 16,
            "--max-epochs", 1, "--device", "cpu", "--compute", "bf16", "--bootstrap", 20, "--no-controls"]
    capsys.readouterr()
    assert run_cmd(cli, args) == 2  # another precision: refused
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(first) in err and "compute_dtype=fp32 (now bf16)" in err, err
    assert len(err.splitlines()) == 1, err
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    monkeypatch.undo()
    # --overwrite trains it again
    again = _finetune(pipeline, out, n_boot=30, overwrite=True)
    assert again == first and json.loads((first / "config.json").read_text())["n_bootstrap"] == 30
