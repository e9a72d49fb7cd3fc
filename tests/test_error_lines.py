"""Bad inputs and faults of issue 19, part B: each gives one line naming the file and the
problem (or the right behaviour), never a traceback."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path

import pytest
from test_bad_input import make_case

from spar_bench.builder.cli import cli as build_cli
from spar_bench.clitools import run_cli


def _one_error(capsys, *words: str) -> str:
    """The one ``error:`` line on stderr (progress bars aside), holding ``words``."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "%|" not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _unreadable(path: Path, monkeypatch) -> None:
    """``path`` cannot be opened: its mode is 000, or, for root (who reads anything), every
    ``open`` of it fails as the kernel would fail it."""
    os.chmod(path, 0)
    if os.geteuid() != 0:
        return
    real_open, real_io_open = builtins.open, io.open

    def refuse(opener):
        def wrapped(file, *a, **k):
            if isinstance(file, (str, os.PathLike)) and Path(file).resolve() == path.resolve():
                raise PermissionError(13, "Permission denied", str(file))
            return opener(file, *a, **k)

        return wrapped

    monkeypatch.setattr(builtins, "open", refuse(real_open))
    monkeypatch.setattr(io, "open", refuse(real_io_open))


def test_an_unreadable_input_file_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """Case (7): the error path hashed the unreadable file again (input_digest): a traceback."""
    root = tmp_path / "word"
    make_case(root, "a_good")
    _, bad = make_case(root, "b_bad")
    _unreadable(bad, monkeypatch)
    args = ["--source", "word", "--root", root, "--levels", "level1", "--no-hf"]
    assert run_cli(build_cli, [str(a) for a in [*args, "--out", tmp_path / "out"]]) == 2
    _one_error(capsys, "case b_bad", str(bad), "Permission denied")
    assert not (tmp_path / "out").exists()
    # the failed build's OUT.tmp is said to be what it is, not "an interrupted build"
    assert run_cli(build_cli, [str(a) for a in [*args, "--out", tmp_path / "out"]]) == 2
    _one_error(capsys, "out.tmp holds a build that stopped on an error (case b_bad", "--resume")
    # skipped, it is recorded in the manifest
    assert run_cli(build_cli, [str(a) for a in [*args, "--out", tmp_path / "out", "--on-error", "skip",
                                                "--overwrite"]]) == 0
    manifest = (tmp_path / "out" / "manifest.json").read_text()
    assert "b_bad" in manifest and "Permission denied" in manifest


@pytest.mark.slow
def test_resume_from_a_truncated_checkpoint_is_one_line(pipeline, tmp_path: Path, capsys) -> None:
    """Case (8): finetune --resume with a cut checkpoint.pt: RuntimeError: PytorchStreamReader failed."""
    import json

    import torch

    from spar_bench.probes.cli import cli

    model_args = {"depth": 1, "embed_dim": 16, "num_heads": 2, "img_size": 64}
    out = tmp_path / "runs"
    rd = out / "timm-vit_tiny_patch16_224-scratch-shards" / "level1.localisation" / "mlp,max_epochs=1" / "seed0"
    rd.mkdir(parents=True)
    torch.save({"key": {}, "encoder": {"w": torch.zeros(1000)}}, rd / "checkpoint.pt")
    data = (rd / "checkpoint.pt").read_bytes()
    (rd / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    args = ["finetune", "--encoder", "timm:vit_tiny_patch16_224", "--init", "scratch", "--model-args",
            json.dumps(model_args), "--data", pipeline["shards"], "--probe", "level1.localisation", "--out", out,
            "--max-epochs", 1, "--device", "cpu", "--compute", "fp32", "--bootstrap", 20, "--no-controls", "--resume"]
    assert run_cli(cli, [str(a) for a in args]) == 2
    _one_error(capsys, str(rd / "checkpoint.pt"), "unreadable checkpoint file", "--overwrite")


def test_report_skips_a_foreign_metrics_json(pipeline, tmp_path: Path, capsys) -> None:
    """Case (10): a foreign metrics.json under RUNS gave KeyError: 'head'. Another tool's file
    in a folder that is no run is skipped with a warning line naming it (a report over a folder
    shared with other tools still works); one in a run's folder is a damaged run: one error line."""
    import json

    from spar_bench.probes.cli import cli

    runs = tmp_path / "runs"
    assert run_cli(cli, [str(a) for a in ["fit", "--features", pipeline["cache"], "--out", runs, "--probe",
                                          "level3.size", "--max-epochs", 1, "--bootstrap", 20, "--no-controls"]]) == 0
    foreign = runs / "wandb" / "run-1" / "metrics.json"
    foreign.parent.mkdir(parents=True)
    foreign.write_text(json.dumps({"accuracy": 0.9}))
    capsys.readouterr()
    assert run_cli(cli, ["report", str(runs), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert f"{foreign}: not a SPAR-Bench run's metrics.json" in err and "skipped" in err
    assert "level3.size" in (tmp_path / "rep" / "report.md").read_text()
    (damaged,) = runs.glob("*/level3.size/*/seed0/metrics.json")
    damaged.write_text(json.dumps({"probe": "level3.size"}))
    assert run_cli(cli, ["report", str(runs), "--out", str(tmp_path / "rep2")]) == 2
    _one_error(capsys, str(damaged), "head, seed, encoder, test", "damaged")
    damaged.write_text("{")
    assert run_cli(cli, ["report", str(runs), "--out", str(tmp_path / "rep2")]) == 2
    _one_error(capsys, str(damaged), "unreadable metrics")


def test_a_misspelled_model_args_key_is_one_line(pipeline, tmp_path: Path, capsys) -> None:
    from spar_bench.probes.cli import cli

    args = ["finetune", "--encoder", "timm:resnet10t", "--init", "scratch", "--model-args", '{"dpeth": 1}',
            "--data", pipeline["shards"], "--probe", "level1.localisation", "--out", tmp_path / "runs"]
    assert run_cli(cli, [str(a) for a in args]) == 2
    _one_error(capsys, "--model-args", "dpeth", "timm:resnet10t")
    assert not (tmp_path / "runs").exists()


def test_push_with_a_bad_repo_or_offline_is_one_line(pipeline, tmp_path: Path, capsys) -> None:
    """``spar-build push`` with an invalid --repo, or offline, gave a huggingface_hub traceback."""
    import shutil
    import subprocess
    import sys

    for repo in ("bad repo/x y", "no-org", "a/b/c"):
        assert run_cli(build_cli, ["push", str(tmp_path / "absent"), "--repo", repo]) == 2
        _one_error(capsys, f"--repo {repo!r}")
    out = tmp_path / "build"
    shutil.copytree(pipeline["other"], out)
    (out / "hf").mkdir()
    (out / "hf" / "README.md").write_text("card\n")
    code = "from spar_bench.builder.cli import main; main()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run([sys.executable, "-c", code, "push", str(out), "--repo", "org/name"], capture_output=True,
                          text=True, timeout=120, env={**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: push of {out / 'hf'} to the Hub dataset org/name failed") and "offline" in lines[0]


def test_a_folder_in_place_of_the_lock_file_is_one_line(tmp_path: Path, capsys) -> None:
    import pytest

    from spar_bench.errors import ConfigError
    from spar_bench.locks import output_lock

    root = tmp_path / "word"
    make_case(root, "a_good")
    (tmp_path / "out.lock").mkdir()
    args = ["--source", "word", "--root", root, "--levels", "level1", "--no-hf", "--out", tmp_path / "out"]
    assert run_cli(build_cli, [str(a) for a in args]) == 2
    _one_error(capsys, str(tmp_path / "out.lock"), "is a folder")
    assert (tmp_path / "out.lock").is_dir() and not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot hold"):
        with output_lock(tmp_path / "file" / "c.h5", what="feature cache"):
            pass


def test_an_encoder_that_outputs_nan_is_named_as_such(pipeline, tmp_path: Path, monkeypatch) -> None:
    """The "fp16 overflow" hint was shown for an encoder whose own output is NaN."""
    import pytest

    from spar_bench.errors import IntegrityError
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.encoders.base import DummyEncoder

    layer_tokens = DummyEncoder._layer_tokens
    for value, words in ((float("nan"), "the encoder itself output NaN"), (1e6, "fp16 overflow")):
        def scaled(self, x, layers, value=value):
            return {v: t * 0 + value for v, t in layer_tokens(self, x, layers).items()}

        monkeypatch.setattr(DummyEncoder, "_layer_tokens", scaled)
        with pytest.raises(IntegrityError) as e:
            write_cache("dummy", pipeline["other"], tmp_path / f"c{value}.h5",
                        CacheOptions(levels=["level1"], compute="fp32"), progress=False)
        assert words in str(e.value) and "\n" not in str(e.value)
        assert ("fp16 overflow" in str(e.value)) == (value == 1e6)


def test_an_empty_case_selection_says_so(tmp_path: Path, capsys) -> None:
    """``--cases ""`` said "every case failed; first: none found" (and left OUT.tmp)."""
    root = tmp_path / "word"
    make_case(root, "a_good")
    for cases in ("", " , ", "word="):
        args = ["--source", "word", "--root", root, "--out", tmp_path / "out", "--cases", cases]
        assert run_cli(build_cli, [str(a) for a in args]) == 2
        _one_error(capsys, "--cases", "selection of source word is empty")
    assert not list(tmp_path.glob("out*"))


def test_an_unsafe_image_id_in_meta_csv_is_refused(tmp_path: Path, capsys) -> None:
    """A ``..`` id in meta.csv was reported as "no segmentations/ folder" (a folder outside ROOT)."""
    root = tmp_path / "ts"
    (root / "s0001" / "segmentations").mkdir(parents=True)
    for bad in ("..", "../s0001", "/etc", "a\\b"):
        (root / "meta.csv").write_text(f"image_id;split\ns0001;train\n{bad};test\n")
        args = ["--source", "totalsegmentator", "--root", root, "--out", tmp_path / "out"]
        assert run_cli(build_cli, [str(a) for a in args]) == 2
        _one_error(capsys, f"{root / 'meta.csv'} line 3", repr(bad), "unsafe")
    assert not list(tmp_path.glob("out*"))


def test_eval_of_a_finetune_run_with_a_truncated_head_is_one_line(pipeline, tmp_path: Path, capsys) -> None:
    from spar_bench.probes.cli import cli

    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "encoder.safetensors").write_bytes(b"")
    (rd / "metrics.json").write_text("{}")
    (rd / "head.pt").write_bytes(b"PK\x03\x04 cut short")
    assert run_cli(cli, ["eval", "--run", str(rd), "--data", str(pipeline["shards"])]) == 2
    _one_error(capsys, str(rd / "head.pt"), "unreadable head file", "--overwrite")
