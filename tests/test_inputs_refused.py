"""Inputs are never silently ignored (issues 39 and 37.4): each is one error line or is acted on.

* ``spar-probe vqa`` on a build with no question level, ``--volume-as`` with no Level 4 probe;
* ``spar-build --volume-size`` without ``level4`` in the levels, and its one bounds rule
  (8 up to the largest cube the available memory holds), refused before anything is written;
* the ``openai:`` backend: an empty reply (``content`` null or blank) is retried and never
  cached, a 4xx other than 408/429 stops the batch at once;
* ``--splits test,val`` and ``--splits val,test`` are one run.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.cli import cli as build_cli
from spar_bench.builder.synthetic import write_synthetic_build
from spar_bench.probes.cli import cli as probe_cli
from spar_bench.probes.vqa.base import BackendOptions, PartialAnswers, Reply, Request, to_pil
from spar_bench.probes.vqa.openai import OpenAIBackend

from helpers import run_cmd, running_stub


@pytest.fixture(scope="module")
def phantom(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("refused")
    assert run_cmd(build_cli, ["phantom", "--out", root / "ph", "--n", 4, "--in-plane", 64, "--slices", 16]) == 0
    return root / "ph"


@pytest.fixture(scope="module")
def build3(phantom: Path) -> Path:
    """A real tiny Level 3 build (train, val, test)."""
    out = phantom.parent / "b3"
    assert run_cmd(build_cli, ["--source", "phantom", "--root", phantom, "--out", out, "--levels", "level3",
                               "--no-hf"]) == 0
    return out


def _vqa(*args) -> int:
    return run_cmd(probe_cli, ["vqa", "--bootstrap", 10, *args])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "\r" not in ln]  # no progress bar
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# -- spar-probe vqa ----------------------------------------------------------------------
def test_vqa_on_a_build_without_question_levels_is_one_line(tmp_path: Path, capsys) -> None:
    data = write_synthetic_build(tmp_path / "b12", 8, split="test", levels=("level1", "level2"))
    assert _vqa("--model", "dummy", "--data", data, "--out", tmp_path / "runs") == 2
    line = _one_line(capsys)
    assert str(data) in line and "levels: level1, level2" in line
    assert "spar-build" in line and "--levels level1,level2,level3" in line
    assert not (tmp_path / "runs").exists()


def test_volume_as_without_level4_is_one_line(build3: Path, tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    assert _vqa("--model", "dummy", "--data", build3, "--out", runs, "--probe", "size", "--volume-as", "video") == 2
    line = _one_line(capsys)
    assert "--volume-as video" in line and "no level4" in line and "levels: level3" in line
    assert not runs.exists()
    # a build with Level 4 asked only slice probes: --volume-as would be ignored just the same
    both = write_synthetic_build(tmp_path / "b34", 8, split="test", levels=("level3", "level4"),
                                 n_volumes=2, volume_size=8)
    assert _vqa("--model", "dummy", "--data", both, "--out", runs, "--probe", "size", "--volume-as", "views") == 2
    assert "no Level 4 probe is asked (level3.size)" in _one_line(capsys)
    assert _vqa("--model", "dummy", "--data", build3, "--out", runs, "--probe", "size", "--volume-as", "auto") == 0


# -- spar-build --volume-size ----------------------------------------------------------------
def _gone(out: Path) -> bool:
    """Nothing of a build to ``out`` was written: no OUT, OUT.tmp or OUT.lock."""
    return not any(p.exists() for p in (out, out.with_name(out.name + ".tmp"), out.with_name(out.name + ".lock")))


def test_volume_size_without_level4_is_one_line(phantom: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    assert run_cmd(build_cli, ["--source", "phantom", "--root", phantom, "--out", out, "--volume-size", 64,
                               "--no-hf"]) == 2
    line = _one_line(capsys)
    assert "--volume-size" in line and "level4" in line and "levels are level1,level2,level3" in line
    assert _gone(out)
    assert run_cmd(build_cli, ["--source", "phantom", "--root", phantom, "--out", out, "--levels", "level3",
                               "--volume-size", 16, "--no-hf"]) == 2
    assert "add level4 (--levels level3,level4)" in _one_line(capsys) and _gone(out)


@pytest.mark.parametrize("size", [0, 1, 7, 65, 100000])
def test_volume_size_has_one_rule_and_one_message(phantom: Path, tmp_path: Path, capsys, monkeypatch,
                                                  size: int) -> None:
    from spar_bench.builder.samples import config

    monkeypatch.setattr(config, "available_memory", lambda: config.VOLUME_BYTES_PER_VOXEL * 64**3)
    out = tmp_path / "o"
    assert run_cmd(build_cli, ["--source", "phantom", "--root", phantom, "--out", out, "--levels", "level4",
                               "--volume-size", size, "--no-hf"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: volume_size (--volume-size) {size}: must be an integer from 8 to 64, "
                           "the largest this machine allows"), line
    assert _gone(out)  # refused before anything is written


def test_volume_size_bound_follows_memory(monkeypatch) -> None:
    from spar_bench.builder.samples import config
    from spar_bench.errors import ConfigError

    per = config.VOLUME_BYTES_PER_VOXEL
    assert config.volume_size_max(per * 64**3) == 64 and config.volume_size_max(per * 64**3 - 1) == 63
    assert config.volume_size_max(None) is None
    avail = config.available_memory()
    assert avail is None or avail > 0
    monkeypatch.setattr(config, "available_memory", lambda: None)  # unknown: the lower bound only
    config.check_volume_size(100000)
    with pytest.raises(ConfigError, match=r"must be an integer >= 8 \(this machine does not say"):
        config.check_volume_size(4)


def test_volume_size_in_bounds_still_builds(phantom: Path, tmp_path: Path, monkeypatch) -> None:
    from spar_bench.builder.samples import config

    monkeypatch.setattr(config, "available_memory", lambda: config.VOLUME_BYTES_PER_VOXEL * 16**3)
    out = tmp_path / "o"
    assert run_cmd(build_cli, ["--source", "phantom", "--root", phantom, "--out", out, "--levels", "level4",
                               "--volume-size", 16, "--no-hf"]) == 0
    assert json.loads((out / "manifest.json").read_text())["sample_config"]["volume_size"] == 16


# -- openai: empty replies and refusals ----------------------------------------------------
@pytest.fixture()
def stub():
    with running_stub() as srv:
        yield srv


@pytest.fixture()
def waits(monkeypatch):
    """The back-off waits asked for (recorded, not slept)."""
    from spar_bench.probes.vqa import openai

    got: list[float] = []
    monkeypatch.setattr(openai, "_sleep", got.append)
    return got


def _backend(srv, **over) -> OpenAIBackend:
    kw = dict(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", timeout=60, retries=3,
              backoff=1.0, concurrency=1, max_new_tokens=8)
    kw.update(over)
    return OpenAIBackend("tiny-vlm", BackendOptions(**kw))


def _req(i: int = 0) -> Request:
    img = to_pil(np.full((32, 32), 100, np.uint8), 32)
    return Request(f"k{i}", "Is it? Options:\nA. no\nB. yes", ("A", "B"), ("no", "yes"), img)


def test_an_empty_reply_is_retried_with_the_back_off(stub, waits) -> None:
    stub.plan = ["null", "text:", "text:  \n "]
    (rep,) = _backend(stub).answer([_req()])
    assert rep.text == "The correct answer is (B)." and rep.meta["attempts"] == 4 and len(stub.seen) == 4
    assert len(waits) == 3 and 1.0 <= waits[0] <= 1.25 and 2.0 <= waits[1] <= 2.5  # the doubling back-off
    stub.seen.clear()
    stub.default = "null"
    with pytest.raises(PartialAnswers, match=r"failed 3 times \(last: empty reply \(content None\)\)") as e:
        _backend(stub, retries=2).answer([_req()])
    assert e.value.replies == [None] and len(stub.seen) == 3


def test_an_empty_reply_is_never_cached(tmp_path: Path) -> None:
    from spar_bench.probes.vqa.cache import ResponseCache

    key, ok = {"q": 1}, Reply(text="B").to_dict()
    with ResponseCache(tmp_path / "c.sqlite") as c:
        c.put_many([(key, Reply(text="").to_dict()), ({"q": 2}, Reply(text=" ").to_dict()), ({"q": 3}, ok),
                    ({"q": 4}, Reply(choice=0).to_dict())])
        assert len(c) == 2 and c.get(key) is None and c.get({"q": 3}) == ok
    db = sqlite3.connect(str(tmp_path / "c.sqlite"))  # an empty answer an older version stored
    from spar_bench.probes.vqa.cache import canonical, key_hash

    with db:
        db.execute("INSERT INTO replies VALUES (?, ?, ?)", (key_hash(key), canonical(key),
                                                             canonical(Reply(text="").to_dict())))
    db.close()
    with ResponseCache(tmp_path / "c.sqlite") as c:
        assert c.get(key) is None  # asked again


def test_null_replies_stop_the_run_and_are_asked_again(build3: Path, tmp_path: Path, capsys) -> None:
    from spar_bench.probes.vqa.cache import ResponseCache

    cache = tmp_path / "c.sqlite"
    args = ["--model", "openai:stub-vlm", "--data", build3, "--out", tmp_path / "runs", "--probe", "size",
            "--no-circular", "--retries", 0, "--concurrency", 1, "--cache", cache]
    with running_stub() as srv:
        srv.default = "null"
        assert _vqa(*args, "--base-url", f"http://127.0.0.1:{srv.server_address[1]}/v1") == 2
    assert "empty reply" in _one_line(capsys)
    with ResponseCache(cache) as c:
        assert len(c) == 0
    with running_stub() as srv:
        assert _vqa(*args, "--base-url", f"http://127.0.0.1:{srv.server_address[1]}/v1") == 0
        asked = len(srv.seen)
    with ResponseCache(cache) as c:
        assert asked > 0 and len(c) == asked


def test_a_client_error_stops_the_batch_at_once(stub, waits) -> None:
    stub.plan = ["text:A", "status:400"]
    with pytest.raises(PartialAnswers, match=r"HTTP 400.*\(1 of 6 failed, 4 not sent\)") as e:
        _backend(stub).answer([_req(i) for i in range(6)])
    assert len(stub.seen) == 2 and not waits  # nothing sent after the 400, nothing retried
    assert [r.text if r else None for r in e.value.replies] == ["A"] + [None] * 5
    stub.seen.clear()
    stub.plan = ["status:404"]
    with pytest.raises(PartialAnswers, match="HTTP 404"):
        _backend(stub, concurrency=1).answer([_req(i) for i in range(3)])
    assert len(stub.seen) == 1


def test_408_is_retried(stub, waits) -> None:
    stub.plan = ["status:408"]
    (rep,) = _backend(stub).answer([_req()])
    assert rep.meta["attempts"] == 2 and len(stub.seen) == 2 and len(waits) == 1


# -- --splits ------------------------------------------------------------------------------
def test_split_order_names_one_run(build3: Path, tmp_path: Path) -> None:
    from spar_bench.probes.vqa.ask import AskConfig

    assert AskConfig(("test", "val")).splits == AskConfig(("val", "test", "val")).splits == ("val", "test")
    runs = tmp_path / "runs"
    assert _vqa("--model", "dummy", "--data", build3, "--out", runs, "--probe", "size", "--splits", "test,val") == 0
    assert _vqa("--model", "dummy", "--data", build3, "--out", runs, "--probe", "size", "--splits", "val,test") == 0
    assert [p.name for p in (runs / "dummy" / "level3.size").iterdir()] == ["vqa-loglik,splits=val+test"]
