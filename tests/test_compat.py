"""Each private third-party API SPAR-Bench uses (spar_bench/compat.py) still exists and does
what we use it for; when it is gone we fall back or say so in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spar_bench import compat
from spar_bench.errors import ConfigError


def test_datasets_features_yaml_list_round_trips() -> None:
    from datasets import Features, Image, List, Value

    from spar_bench.builder.writers.hf import shard_table

    assert hasattr(Features, "_to_yaml_list"), "datasets dropped Features._to_yaml_list"
    data = {"key": np.array([b"a", b"b"]), "image": np.zeros((2, 4, 4), np.uint8),
            "present": np.ones((2, 16), bool), "q_slice": np.array([0, 1]), "q_answer": np.array([1, 0], np.int8)}
    _, features = shard_table("level3", data)
    listed = compat.features_yaml_list(features)
    assert [f["name"] for f in listed] == ["key", "image", "present", "questions"]
    assert Features._from_yaml_list(listed) == features  # what the Hub loader reads back
    simple = Features({"x": List(Value("float32"), length=2), "im": Image()})
    assert compat.features_yaml_list(simple) == [
        {"name": "x", "list": "float32", "length": 2}, {"name": "im", "dtype": "image"}]


def test_datasets_without_the_private_api_is_one_clear_error() -> None:
    class NoYaml:  # a Features of a release without _to_yaml_list
        pass

    with pytest.raises(ConfigError, match="Features._to_yaml_list.*--no-hf"):
        compat.features_yaml_list(NoYaml())


@pytest.mark.parametrize("names, chosen", [
    (["b.bin", "open_clip_pytorch_model.bin", "open_clip_model.safetensors"], "open_clip_model.safetensors"),
    (["z.pth", "a.bin", "m.safetensors"], "m.safetensors"),
    (["b.pth", "a.bin"], "a.bin"),
    (["config.json"], None),
])
def test_open_clip_checkpoint_rule_and_fallback_agree(tmp_path: Path, names, chosen) -> None:
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    want = str(tmp_path / chosen) if chosen else None
    assert compat._find_checkpoint_fallback(tmp_path) == want
    factory = pytest.importorskip("open_clip.factory")
    assert hasattr(factory, "_find_checkpoint_in_dir"), "open_clip dropped _find_checkpoint_in_dir"
    assert factory._find_checkpoint_in_dir(tmp_path) == want
    assert compat.find_open_clip_checkpoint(tmp_path) == want


def test_open_clip_checkpoint_without_the_private_api(tmp_path: Path, monkeypatch) -> None:
    import sys

    (tmp_path / "model.safetensors").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "open_clip.factory", None)  # import fails: the fallback
    assert compat.find_open_clip_checkpoint(tmp_path) == str(tmp_path / "model.safetensors")
