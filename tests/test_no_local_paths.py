"""No absolute local path in anything the tools write (the project's provenance rule).

The main pipeline runs on absolute paths in tmp_path: a phantom build, a feature cache of a
tiny ``open_clip:local-dir:/abs/...`` model, a frozen fit and its eval, a finetune (export)
and its re-encoding eval, a re-cache of the export, an MLLM run of a tiny ``hf:/abs/...``
model, and the report. Every JSON / JSONL / Markdown / card, every HDF5 attribute, the
Parquet schema metadata, the safetensors header, the records in ``head.pt``, and the raw bytes of
every file must hold neither tmp_path, the home folder, the current folder nor any other
absolute path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from spar_bench.probes.cli import cli as probe_cli
from spar_bench.provenance import local_paths, local_prefixes

from helpers import OPEN_CLIP_TOWERS, make_open_clip, run_cmd

pytest.importorskip("open_clip")
pytest.importorskip("transformers")

#: an absolute POSIX path (``/tmp/x``, ``/home/me``) or a Windows drive path in a string;
#: not the ``//`` of a URL, nor ``a/b`` relative paths.
ABSOLUTE = re.compile(r"(?:^|[\s\"'=(,\[])(?:/(?!/)[\w.-]+/[\w.-]|[A-Za-z]:[\\/][\w.-])")


def _strings_of(path: Path) -> list:
    """The structured records of an output file, as Python objects (JSON-like)."""
    suffix = path.suffix
    if suffix == ".json":
        return [json.loads(path.read_text())]
    if suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line]
    if suffix in (".md", ".txt", ".yaml"):
        return [path.read_text()]
    if suffix == ".h5":
        return [_h5_attrs(path)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.read_schema(path).metadata or {}
        return [{k.decode(): v.decode("utf-8", "replace") for k, v in meta.items()}]
    if suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return [f.metadata() or {}]
    if suffix == ".pt":
        saved = torch.load(path, map_location="cpu", weights_only=False)
        return [{k: v for k, v in saved.items() if k != "state_dict"}]
    return []


def _h5_attrs(path: Path) -> dict:
    import h5py

    out: dict = {}

    def visit(name, obj):
        out[name or "/"] = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in obj.attrs.items()}

    with h5py.File(path, "r") as f:
        visit("", f)
        f.visititems(visit)
    return out


def _flatten(obj) -> list[str]:
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (str(k), *_flatten(v))]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _flatten(v)]
    return [obj] if isinstance(obj, str) else []


def _leaks(folder: Path, prefixes: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    needles = [p.encode() for p in prefixes]
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        records = _strings_of(path)
        bad = local_paths(records, prefixes)
        bad += [s for s in _flatten(records) if ABSOLUTE.search(s)]
        raw = path.read_bytes()
        bad += [f"bytes hold {n.decode()}" for n in needles if n in raw]
        if bad:
            found[path.relative_to(folder).as_posix()] = sorted(set(bad))[:3]
    return found


@pytest.mark.slow
def test_no_output_holds_a_local_path(tmp_path: Path) -> None:
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.probes.vqa.tiny import make_tiny_llava

    tmp_path = tmp_path.resolve()
    models, out = tmp_path / "models", tmp_path / "out"  # inputs / everything written
    models.mkdir()
    encoder, _ = make_open_clip(models, OPEN_CLIP_TOWERS["open_clip-vit"])
    assert encoder.startswith("open_clip:local-dir:/")
    llava = make_tiny_llava(models / "tiny-llava", seed=0)

    ph, build, runs = models / "ph", out / "build", out / "runs"
    assert run_cmd(build_cli, ["phantom", "--out", ph, "--n", 6, "--layout", "canonical"]) == 0
    assert run_cmd(build_cli, ["--source", "phantom", "--root", ph, "--out", build, "--levels", "level1,level3",
                               "--samples-per-case", 2, "--counterfactual", "mirror"]) == 0
    cache = out / "cache" / "clip.h5"
    assert run_cmd(probe_cli, ["cache", "--encoder", encoder, "--data", build, "--out", cache,
                               "--levels", "level1", "--compute", "fp32"]) == 0
    fit = ["--probe", "level1.localisation", "--bootstrap", 20, "--no-controls", "--max-epochs", 1]
    assert run_cmd(probe_cli, ["fit", "--features", cache, "--out", runs, *fit]) == 0
    [frozen] = list(runs.glob("*/level1.localisation/*/seed0"))
    assert re.fullmatch(r"open_clip-local-dir-tiny_clip-[0-9a-f]{8}", frozen.parts[-4])
    assert run_cmd(probe_cli, ["eval", "--run", frozen, "--features", cache, "--bootstrap", 20]) == 0

    assert run_cmd(probe_cli, ["finetune", "--encoder", encoder, "--data", build, "--out", runs, *fit,
                               "--batch-size", 8, "--device", "cpu", "--compute", "fp32"]) == 0
    [tuned] = list(runs.glob("*-finetuned-build/level1.localisation/*/seed0"))
    assert tuned.parts[-4] == f"{frozen.parts[-4]}-finetuned-build"
    assert run_cmd(probe_cli, ["eval", "--run", tuned, "--data", build, "--bootstrap", 20]) == 2  # path needed
    assert run_cmd(probe_cli, ["eval", "--run", tuned, "--data", build, "--bootstrap", 20,
                               "--encoder", encoder]) == 0
    assert run_cmd(probe_cli, ["cache", "--encoder", encoder, "--weights", tuned / "encoder.safetensors",
                               "--data", build, "--out", out / "cache" / "tuned.h5", "--levels", "level1",
                               "--splits", "test", "--compute", "fp32"]) == 0
    assert run_cmd(probe_cli, ["vqa", "--model", f"hf:{llava}", "--data", build, "--out", runs,
                               "--probe", "symmetry", "--bootstrap", 20, "--no-circular"]) == 0
    assert run_cmd(probe_cli, ["report", runs, "--out", out / "report"]) == 0

    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    for expected in ("build/manifest.json", "build/hf/README.md", "cache/clip.h5", "report/report.json",
                     f"runs/{tuned.relative_to(runs)}/encoder.safetensors", f"runs/{frozen.relative_to(runs)}/eval-clip.json",
                     f"runs/{tuned.relative_to(runs)}/eval-build.json"):
        assert expected in written
    assert any(p.endswith(".parquet") for p in written) and any("answers.jsonl" in p for p in written)
    assert _leaks(out, local_prefixes(tmp_path, models, out)) == {}
