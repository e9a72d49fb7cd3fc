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
    from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec
    from spar_bench.probes.runs.session import run as run_finetune

    opts = {"batch_size": 16, "max_epochs": 1, "device": "cpu", "compute": "fp32", **kw.pop("cfg", {})}
    fs = FinetuneSpec(TINY_VIT[0], str(pipeline["shards"]), "level1.localisation", "mlp", 0, init="scratch",
                      model_kwargs=TINY_VIT[1], cfg=FinetuneConfig(**opts), controls=False,
                      n_boot=kw.pop("n_boot", 20))  # fmt: skip
    return run_finetune(fs, out, progress=False, **kw)


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
    assert again == first and json.loads((first / "config.json").read_text())["options"]["n_bootstrap"] == 30
    # its re-encoded evaluation on a build: kept when the same, refused when other, as eval's
    from spar_bench.probes.finetune.encoding import run_eval_reencoded

    ev = run_eval_reencoded(first, pipeline["other"], n_boot=20, device="cpu", compute="fp32")
    made = ev.read_bytes()
    assert run_eval_reencoded(first, pipeline["other"], n_boot=20, device="cpu", compute="fp32") == ev
    with pytest.raises(ConfigError, match="n_bootstrap=20 \\(now 30\\)"):
        run_eval_reencoded(first, pipeline["other"], n_boot=30, device="cpu", compute="fp32")
    assert ev.read_bytes() == made


def _files(rd: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(rd.iterdir())}


def _one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def test_fit_and_eval_keep_what_they_finished(pipeline, tmp_path: Path, capsys) -> None:
    """fit replaced a finished run of the same folder (other --bootstrap, --no-controls, a cache
    of another build) and eval an evaluation of other inputs, without a word."""
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.cli import cli

    out = tmp_path / "runs"

    def fit(*extra, features=pipeline["cache"], controls=False):
        return run_cmd(cli, ["fit", "--features", features, "--out", out, "--probe", "level1.localisation",
                             "--max-epochs", 2, *([] if controls else ["--no-controls"]), "--bootstrap", 20, *extra])

    assert fit() == 0
    (rd,) = out.glob("*/level1.localisation/*/seed0")
    before = _files(rd)
    capsys.readouterr()
    assert fit() == 0 and "kept" in capsys.readouterr().err and _files(rd) == before  # the same run: kept
    assert fit("--bootstrap", 30) == 2
    _one_error(capsys, str(rd), "n_boot=20 (now 30)", "--overwrite")
    assert fit(controls=True) == 2
    _one_error(capsys, str(rd), "controls=False (now True)")
    other = write_cache("dummy", pipeline["other"], tmp_path / "other.h5", CacheOptions(levels=["level1"]),
                        progress=False)
    assert fit(features=other) == 2
    _one_error(capsys, str(rd), "another build")
    import h5py

    with h5py.File(pipeline["cache"], "r") as f:  # the same encoder and build, the other dtype
        dtype = {"fp16": "fp32", "fp32": "fp16"}[f.attrs["dtype"]]
    stored = write_cache("dummy", pipeline["shards"], tmp_path / "stored.h5", CacheOptions(levels=["level1"], dtype=dtype),
                         progress=False)
    assert fit(features=stored) == 2
    _one_error(capsys, str(rd), f"(now {dtype})", "stored.h5")
    assert _files(rd) == before

    def evaluate(*extra):
        return run_cmd(cli, ["eval", "--run", rd, "--features", pipeline["cache"], "--bootstrap", 20, *extra])

    assert evaluate() == 0
    (ev,) = rd.glob("eval-*.json")
    first = ev.read_bytes()
    assert json.loads(first)["n_bootstrap"] == 20
    capsys.readouterr()
    assert evaluate() == 0 and "kept" in capsys.readouterr().err and ev.read_bytes() == first
    assert evaluate("--bootstrap", 30) == 2
    _one_error(capsys, str(ev), "n_bootstrap=20 (now 30)", "--overwrite")
    assert ev.read_bytes() == first
    assert evaluate("--bootstrap", 30, "--overwrite") == 0 and json.loads(ev.read_text())["n_bootstrap"] == 30
    # --overwrite trains the run again (its evaluations go with it)
    assert fit("--overwrite", features=other) == 0
    assert json.loads((rd / "config.json").read_text())["inputs"]["features"] == "other.h5" and not list(rd.glob("eval-*"))


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_builds_phantoms_and_caches_are_never_replaced_without_overwrite(pipeline, tmp_path: Path, capsys) -> None:
    """The other commands that write a build, a phantom or a cache refuse a finished one in one
    line (a cache rerun with the same arguments keeps it), whatever the options."""
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.probes.cli import cli as probe_cli

    ph = pipeline["root"] / "ph"
    common = ["--source", "phantom", "--root", ph, "--levels", "level1", "--no-hf", "--cases", "phantom_0001,phantom_0002"]
    for i in (0, 1):
        assert run_cmd(build_cli, [*common, "--out", tmp_path / f"p{i}", "--partition", f"{i}/2"]) == 0
    merged = tmp_path / "merged"
    assert run_cmd(build_cli, ["merge", tmp_path / "p0", tmp_path / "p1", "--out", merged]) == 0
    cache = tmp_path / "c.h5"
    assert run_cmd(probe_cli, ["cache", "--encoder", "dummy", "--data", merged, "--out", cache]) == 0
    before = {p: _tree(p) for p in (merged, tmp_path / "p0")}
    cached = cache.read_bytes()
    capsys.readouterr()
    attempts = [
        (build_cli, ["merge", tmp_path / "p0", tmp_path / "p1", "--out", merged], "exists and is not empty"),
        (build_cli, [*common, "--out", merged, "--seed", 3], "exists and is not empty"),
        (build_cli, [*common, "--out", merged, "--seed", 3, "--resume"], "already a finished build"),
        (build_cli, [*common, "--out", tmp_path / "p0", "--partition", "0/2", "--seed", 3], "exists and is not empty"),
        (build_cli, ["phantom", "--out", merged, "--n", 1], "exists and is not empty"),
        (probe_cli, ["cache", "--encoder", "dummy", "--data", merged, "--out", cache, "--dtype", "fp32"],
         "made with other arguments"),
    ]
    for cli, args, words in attempts:
        assert run_cmd(cli, args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "--overwrite" in err[0], (args, err)
    assert run_cmd(probe_cli, ["cache", "--encoder", "dummy", "--data", merged, "--out", cache]) == 0  # kept
    assert {p: _tree(p) for p in before} == before and cache.read_bytes() == cached


def test_sweep_does_not_skip_a_run_finished_with_other_bootstrap_or_controls(pipeline, tmp_path: Path, capsys) -> None:
    """A sweep skipped a finished run made with another --bootstrap or --no-controls and reported
    it as its own (other CIs, or no blind baseline)."""
    from spar_bench.probes.cli import cli

    def sweep(*extra):
        return run_cmd(cli, ["sweep", "--features", pipeline["cache"], "--out", tmp_path / "runs", "--heads", "mlp",
                             "--probes", "level3.size", "--seeds", "0", "--max-epochs", 1, "--jobs", 1, *extra])

    assert sweep("--bootstrap", 10, "--no-controls") == 0
    (rd,) = (tmp_path / "runs").glob("*/level3.size/*/seed0")
    before = _tree(rd)
    capsys.readouterr()
    assert sweep("--bootstrap", 10, "--no-controls") == 0 and "0 run(s) done" in capsys.readouterr().out
    for extra, words in ((("--bootstrap", 20, "--no-controls"), "n_boot=10 (now 20)"),
                         (("--bootstrap", 10), "controls=False (now True)")):
        assert sweep(*extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(rd) in err[0] and words in err[0], err
    assert _tree(rd) == before
