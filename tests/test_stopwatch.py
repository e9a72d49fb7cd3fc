"""The optional Stopwatch of the cache writer: it times the stages and changes no output (issue 25)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from test_cache import exact, make_build

from spar_bench.probes.cache import write_cache
from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.stopwatch import STAGES, Stopwatch


def _arrays(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_cache_with_a_stopwatch_is_the_same_cache(workers: int, tmp_path: Path) -> None:
    build = make_build(tmp_path / "build")
    enc = load_encoder("dummy")
    plain = write_cache("dummy", build, tmp_path / "plain.h5", exact(loader_workers=workers), encoder_obj=enc,
                        progress=False)
    sw = Stopwatch()
    timed = write_cache("dummy", build, tmp_path / "timed.h5", exact(loader_workers=workers), encoder_obj=enc,
                        progress=False, stopwatch=sw)
    a, b = _arrays(plain), _arrays(timed)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    batches = 3 + 1 + 2  # level1/train 11 rows, level1/test 3, level3/test 7, batches of 4
    for stage in ("read", "collate", "load wait", "h2d", "forward", "write"):
        assert sw.counts[stage] == batches, stage  # read/collate come back from the worker process too
    assert sw.counts["write wait"] == batches + 1  # and the last wait for the writer thread
    assert "d2h" not in sw.counts  # on the CPU the cast is the writer's
    rows = sw.rows(10.0)
    assert [r[0] for r in rows][-1] == "other" and all(r[1] == STAGES.get(r[0], "main") for r in rows)
    main = sum(sec for _, where, sec, _ in rows if where == "main")
    assert main == pytest.approx(10.0)  # other = the wall the main-loop stages leave


def test_rows_and_table() -> None:
    sw = Stopwatch()
    sw.add("forward", 2.0)
    sw.add("read", 5.0)  # reader seconds may exceed the wall (several workers)
    sw.add("write", 1.0)
    rows = {r[0]: r for r in sw.rows(4.0)}
    assert rows["forward"][3] == 0.5 and rows["read"][1] == "reader" and rows["other"][2] == 2.0
    assert list(rows) == ["read", "forward", "write", "other"]
    table = sw.table(4.0, "x")
    assert "| forward | main | 2.000 | 50.0 % |" in table and "peak RSS" in table
    with sw.stage("h2d"):
        pass
    assert sw.counts["h2d"] == 1 and list(sw.iterate([1, 2], "load wait")) == [1, 2]
    assert sw.counts["load wait"] == 2


def test_read_rows_reads_runs_as_slices_with_the_same_images(tmp_path: Path) -> None:
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.data import read_rows

    b = Build(make_build(tmp_path / "build", n_l1=23))  # shards of 5 rows: runs cross shard boundaries
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7, 8], [3, 4, 9, *range(11, 20), 21, 22], [1, 7, 20], [8], [],
                 list(range(23)), [4, 2, 3]):  # the last not sorted: read row by row
        rows = np.asarray(rows, dtype=np.int64)
        got, want = read_rows(b, "level1", "train", rows), b.images("level1", "train", rows)
        assert got.dtype == want.dtype and np.array_equal(got, want), rows
