"""The feature cache: written from a build, aligned with its shards, resumable, fingerprinted."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from spar_bench.builder.shards import Build
from spar_bench.builder.writers.hdf5 import ShardSink
from spar_bench.builder.writers.manifest import write_manifest
from spar_bench.errors import ConfigError, IntegrityError
from spar_bench.probes.cache import CacheOptions, write_cache
from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.features import FeatureCache

from helpers import MAKERS


def _rows(level: str, split: str, lo: int, hi: int, rng: np.random.Generator) -> dict:
    n = hi - lo
    keys = [f"phantom/c{(lo + i) // 2:03d}/{level}/{(lo + i) % 2:05d}" for i in range(n)]
    img = rng.integers(0, 256, (n, 224, 224), dtype=np.uint8)
    img[:, :112] //= 4  # some structure, so tokens differ between rows
    return {"key": np.array(keys, dtype=object), "image": img,
            "split": np.array([split] * n, dtype=object)}


def make_build(out: Path, n_l1: int = 11, n_l3: int = 7, seed: int = 0) -> Path:
    """A tiny build through spar_bench.builder.writers (images are random bytes)."""
    rng = np.random.default_rng(seed)
    shards: dict = {}
    for level, split, n, per in (("level1", "train", n_l1, 5), ("level1", "test", 3, 5),
                                 ("level3", "test", n_l3, 4)):
        (out / level).mkdir(parents=True, exist_ok=True)
        sink = ShardSink(out, level, split, n, per, {"schema_version": "1.0"})
        for lo in range(0, n, 3):  # cases of 3 rows
            sink.add(_rows(level, split, lo, min(lo + 3, n), rng))
        shards.setdefault(level, {})[split] = sink.close()
    write_manifest(out, {"schema_version": "1.0", "shards": shards, "hf": None})
    return out


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    return make_build(tmp_path_factory.mktemp("cache") / "build")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


EXACT = dict(dtype="fp32", compute="fp32", batch_size=4, device="cpu")


def exact(**kw) -> CacheOptions:
    """The exact (fp32) CPU options of these tests, with ``kw`` on top."""
    return CacheOptions(**dict(EXACT, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MAKERS))
def test_cache_is_aligned_with_shards(family: str, build: Path, models: Path, tmp_path: Path) -> None:
    if family in ("hf", "open_clip"):
        pytest.importorskip({"hf": "transformers", "open_clip": "open_clip"}[family])
    sub = models / family
    sub.mkdir(exist_ok=True)
    name, kw = MAKERS[family](sub)
    enc = load_encoder(name, **kw)
    layers = [-1] if family == "open_clip" else [-1, -2]
    out = write_cache(name, build, tmp_path / "c.h5", exact(layers=layers), encoder_obj=enc, progress=False)
    b = Build(build)
    with FeatureCache(out) as fc:
        fc.check_matches(b)
        assert fc.levels() == ["level1", "level3"] and fc.splits("level1") == ["test", "train"]
        assert fc.layers() == layers and fc.meta["complete"] and fc.meta["dtype"] == "fp32"
        # a local model is named by base name + content hash, never by its path
        assert fc.meta["encoder_config"]["name"] == fc.meta["encoder"] == enc.spec.name
        assert enc.spec.name == name if family.startswith(("dummy", "timm")) else str(models) not in enc.spec.name
        assert fc.meta["weights"] == enc.spec.weights and fc.random_init == enc.spec.random_init
        assert set(fc.meta["versions"]) >= {"torch", "timm", "transformers", "open_clip_torch", "spar-bench"}
        for level in b.levels():
            for split in b.splits(level):
                keys = b.read(level, split, ["key"])["key"]
                np.testing.assert_array_equal(fc.keys(level, split), keys)
                rows = np.array([len(keys) - 1, 0, 2])
                imgs = torch.from_numpy(b.images(level, split, rows))
                want = enc(imgs, layers)
                for v in layers:
                    got = fc.tokens(level, split, v, rows=rows)
                    np.testing.assert_allclose(got, want[v][0].numpy(), rtol=1e-4, atol=1e-4)
                    np.testing.assert_allclose(fc.pooled(level, split, v)[rows], want[v][1].numpy(),
                                               rtol=1e-4, atol=1e-4)
                assert fc.tokens(level, split, layers[0]).shape[0] == len(keys)


def test_resume_after_interruption_is_identical(build: Path, tmp_path: Path) -> None:
    full = write_cache("dummy", build, tmp_path / "full.h5", exact(layers="-1,-2"), progress=False)

    class Stop(Exception):
        pass

    calls = []

    def stop_after_two(level, split, lo, hi):
        calls.append((level, split, lo))
        if len(calls) == 2:  # after 2 batches of 4 rows
            raise Stop

    part = tmp_path / "part.h5"
    with pytest.raises(Stop):
        write_cache("dummy", build, part, exact(layers="-1,-2"), progress=False, on_batch=stop_after_two)
    with pytest.raises(IntegrityError, match="incomplete.*rerun"):
        FeatureCache(part)
    b = Build(build)
    plan = [(lv, sp) for lv in b.levels() for sp in b.splits(lv)]
    with h5py.File(part) as f:
        # batches already handed to the writer thread (at most two behind the one that
        # raised) may still land; every row marked done is written
        done = {(lv, sp): f[f"{lv}/{sp}/done"][()] for lv, sp in plan}
    n_done = sum(int(d.sum()) for d in done.values())
    assert 8 <= n_done <= 16 and n_done < sum(d.size for d in done.values())
    first_todo = next((lv, sp, int(np.flatnonzero(~d)[0])) for (lv, sp), d in done.items() if not d.all())
    assert first_todo != (*plan[0], 0)
    with pytest.raises(ConfigError, match="differs in: dtype"):
        write_cache("dummy", build, part, exact(layers="-1,-2", dtype="fp16"), progress=False)
    resumed = []
    write_cache("dummy", build, part, exact(layers="-1,-2"), progress=False,
                on_batch=lambda lv, sp, lo, hi: resumed.append((lv, sp, lo)))
    assert resumed[0] == first_todo  # continued, not restarted
    with FeatureCache(full) as a, FeatureCache(part) as b:
        for level in a.levels():
            for split in a.splits(level):
                np.testing.assert_array_equal(a.keys(level, split), b.keys(level, split))
                for v in (-1, -2):
                    np.testing.assert_array_equal(a.tokens(level, split, v), b.tokens(level, split, v))
                    np.testing.assert_array_equal(a.pooled(level, split, v), b.pooled(level, split, v))
    # a complete cache with the same arguments is left alone; other arguments are refused
    write_cache("dummy", build, part, exact(layers="-1,-2"), progress=False)
    with pytest.raises(ConfigError, match="complete cache made with other arguments.*layers"):
        write_cache("dummy", build, part, exact(layers="-1"), progress=False)
    write_cache("dummy", build, part, exact(layers="-1", overwrite=True), progress=False)
    assert FeatureCache(part).layers() == [-1]


def test_a_start_killed_while_writing_the_header_is_rerun(build: Path, tmp_path: Path, monkeypatch) -> None:
    """A SIGTERM between two header attributes left a file with some of them: the rerun
    (as the experiment runner's, after a kill) must start it afresh, not call it foreign."""
    import spar_bench.probes.cache as cache_mod

    full = write_cache("dummy", build, tmp_path / "full.h5", exact(), progress=False)

    class Stop(Exception):
        pass

    written, real = [], cache_mod._attr

    def attr_then_stop(value):
        written.append(value)
        if len(written) == 3:
            raise Stop
        return real(value)

    part = tmp_path / "part.h5"
    with monkeypatch.context() as m:
        m.setattr(cache_mod, "_attr", attr_then_stop)
        with pytest.raises(Stop):
            write_cache("dummy", build, part, exact(), progress=False)
    with h5py.File(part, "r") as f:
        assert 0 < len(f.attrs) and "cache_args" not in f.attrs and not len(f.keys())
    with pytest.raises(IntegrityError):
        FeatureCache(part)  # nothing that looks complete
    write_cache("dummy", build, part, exact(), progress=False)
    with FeatureCache(full) as a, FeatureCache(part) as b:
        for level in a.levels():
            for split in a.splits(level):
                np.testing.assert_array_equal(a.tokens(level, split, -1), b.tokens(level, split, -1))
    # a header-only file is ours for --overwrite too; a file with data or foreign attributes is not
    with h5py.File(tmp_path / "header.h5", "w") as f:
        f.attrs["schema_version"] = "x"
    write_cache("dummy", build, tmp_path / "header.h5", exact(overwrite=True), progress=False)
    for name, fill in (("data.h5", lambda f: f.create_dataset("x", data=[1])),
                       ("attr.h5", lambda f: f.attrs.__setitem__("mine", 1))):
        with h5py.File(tmp_path / name, "w") as f:
            f.attrs["schema_version"] = "x"
            fill(f)
        with pytest.raises(ConfigError, match=f"{name}: exists and is not a SPAR-Bench cache"):
            write_cache("dummy", build, tmp_path / name, exact(), progress=False)


class _Killed(Exception):
    pass


def _kill_at(monkeypatch, k: int) -> list[int]:
    """Raise :class:`_Killed` at the ``k``-th HDF5 write (attribute, dataset made, rows written):
    where a SIGTERM, turned into SystemExit between two Python calls, can stop a cache."""
    count = [0]

    def wrap(real):
        def write(*a, **kw):
            count[0] += 1
            if count[0] == k:
                raise _Killed
            return real(*a, **kw)
        return write

    monkeypatch.setattr(h5py.AttributeManager, "__setitem__", wrap(h5py.AttributeManager.__setitem__))
    monkeypatch.setattr(h5py.Group, "create_dataset", wrap(h5py.Group.create_dataset))
    monkeypatch.setattr(h5py.Dataset, "__setitem__", wrap(h5py.Dataset.__setitem__))
    return count


@pytest.mark.slow
def test_a_cache_killed_at_any_write_resumes_to_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """Kill a reduced (projected, int8) cache at every one of its HDF5 writes in turn; each
    rerun must finish to the features of an uninterrupted run, never call its own file foreign
    or fail on a half-made dataset."""
    from spar_bench.probes.token_storage import TokenStorage

    b = make_build(tmp_path / "b", n_l1=3, n_l3=5)
    opts = exact(token_storage=TokenStorage.parse(grid=2, proj="random:4", int8=True), batch_size=3)
    full = write_cache("dummy", b, tmp_path / "full.h5", opts, progress=False)
    with monkeypatch.context() as m:
        writes = _kill_at(m, 0)
        write_cache("dummy", b, tmp_path / "count.h5", opts, progress=False)
    assert writes[0] > 30
    with FeatureCache(full) as a:
        want = {(lv, sp): (a.tokens(lv, sp, -1), a.pooled(lv, sp, -1)) for lv in a.levels() for sp in a.splits(lv)}
    for k in range(1, writes[0] + 1):
        out = tmp_path / f"k{k}.h5"
        with monkeypatch.context() as m:
            _kill_at(m, k)
            with pytest.raises(_Killed):
                write_cache("dummy", b, out, opts, progress=False)
        write_cache("dummy", b, out, opts, progress=False)
        with FeatureCache(out) as c:
            for (lv, sp), (tok, pooled) in want.items():
                np.testing.assert_array_equal(c.tokens(lv, sp, -1), tok, err_msg=f"killed at write {k}")
                np.testing.assert_array_equal(c.pooled(lv, sp, -1), pooled, err_msg=f"killed at write {k}")


def test_other_shards_are_rejected(build: Path, tmp_path: Path) -> None:
    out = write_cache("dummy", build, tmp_path / "c.h5", exact(), progress=False)
    other = make_build(tmp_path / "other", seed=1)
    with pytest.raises(ConfigError) as e:
        FeatureCache(out).check_matches(Build(other))
    msg = str(e.value)
    assert str(out) in msg and str(other) in msg
    assert Build(build).fingerprint[:16] in msg and Build(other).fingerprint[:16] in msg


def test_dataset_dir_is_relative_or_empty_never_a_local_path(build: Path, tmp_path: Path) -> None:
    """The build as seen from the cache's folder when both lie in one project folder; else
    empty (fit then needs --data): no absolute path, no climb through the home folder."""
    from spar_bench.probes.cache import _relative_dir
    from spar_bench.probes.runs.inputs import open_cache, resolve_build

    proj = tmp_path / "proj"
    assert _relative_dir(proj / "shards", proj / "cache" / "c.h5") == "../shards"
    assert _relative_dir(proj / "shards", proj / "c.h5") == "shards"
    assert _relative_dir(build, tmp_path / "a" / "b" / "c.h5") == ""
    out = write_cache("dummy", build, tmp_path / "a" / "b" / "c.h5", exact(levels=["level1"]), progress=False)
    cache = open_cache(out)
    assert cache.meta["dataset_dir"] == ""
    with pytest.raises(ConfigError, match="pass --data"):
        resolve_build(cache, None)
    assert resolve_build(cache, build).fingerprint == cache.fingerprint


def test_fp16_storage_is_close_to_fp32(build: Path, tmp_path: Path) -> None:
    a = write_cache("dummy", build, tmp_path / "32.h5", exact(), progress=False)
    # fp16 storage, and shards read by a DataLoader worker process: same rows, same order
    b = write_cache("dummy", build, tmp_path / "16.h5", exact(loader_workers=1, dtype="fp16"), progress=False)
    with FeatureCache(a) as fa, FeatureCache(b) as fb:
        x, y = fa.pooled("level1", "train"), fb.pooled("level1", "train")
        assert fb.tokens("level1", "train").dtype == np.float16
        np.testing.assert_array_equal(fa.keys("level3", "test"), fb.keys("level3", "test"))
        assert np.abs(x - y).max() <= 1e-3 * np.abs(x).max() + 1e-6


def test_cache_options_are_checked_when_made() -> None:
    """A meaningless option is one ConfigError line before any file is read; layers are ints."""
    import dataclasses

    assert CacheOptions(layers="-1, -4").layers == (-1, -4) and CacheOptions(levels=["level1"]).levels == ("level1",)
    for kw, words in (({"tile_encoding": "tiles"}, "--tile-encoding must be one of mosaic, per-tile; got 'tiles'"),
                      ({"layers": "a"}, "--layers must be comma-separated integers"),
                      ({"dtype": "fp8"}, "--dtype must be fp16 or fp32; got 'fp8'")):
        with pytest.raises(ConfigError, match=words):
            CacheOptions(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheOptions().batch_size = 1  # type: ignore[misc]


def fake_cpu(monkeypatch, avx512_bf16: bool) -> None:
    """torch's CPU probes report AVX512-BF16 (or not) and no AMX; ``SPAR_CPU_BF16`` unset, so
    the probes are what ``--compute auto`` asks."""
    import torch

    from spar_bench.probes.hardware import FORCE_ENV

    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)


@pytest.mark.parametrize("native", [True, False])
def test_auto_compute_follows_the_cpu_and_is_recorded(build: Path, tmp_path: Path, monkeypatch,
                                                      native: bool) -> None:
    fake_cpu(monkeypatch, avx512_bf16=native)
    out = write_cache("dummy", build, tmp_path / "auto.h5", exact(compute="auto"), progress=False)
    want = "bf16" if native else "fp32"
    with FeatureCache(out) as fc:
        assert fc.meta["compute_dtype"] == want
        assert json.loads(fc._f.attrs["cache_args"])["compute_dtype"] == want
        reason = fc._f.attrs["compute_reason"]
    assert ("native bf16 (AVX512-BF16)" in reason) if native else ("emulated" in reason)


def _interrupted_bf16_cache(build: Path, out: Path, monkeypatch) -> None:
    """A ``--compute auto`` cache started where the CPU reports native bf16 and interrupted after
    its first batch; the CPU then reports neither AVX512-BF16 nor AMX."""
    fake_cpu(monkeypatch, avx512_bf16=True)

    def stop(level, split, lo, hi):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_cache("dummy", build, out, exact(compute="auto"), progress=False, on_batch=stop)
    fake_cpu(monkeypatch, avx512_bf16=False)


def test_auto_compute_resumes_with_the_recorded_choice(build: Path, tmp_path: Path,
                                                       monkeypatch) -> None:
    """An interrupted cache started in bf16 is finished in bf16, whatever this CPU reports."""

    out = tmp_path / "r.h5"
    _interrupted_bf16_cache(build, out, monkeypatch)
    write_cache("dummy", build, out, exact(compute="auto"), progress=False)
    with FeatureCache(out) as fc:
        assert fc.meta["compute_dtype"] == "bf16"


def test_overwrite_chooses_the_precision_afresh(build: Path, tmp_path: Path, monkeypatch) -> None:
    """Unlike a resume, --overwrite starts over: the interrupted cache's bf16 is not kept."""

    out = tmp_path / "o.h5"
    _interrupted_bf16_cache(build, out, monkeypatch)
    write_cache("dummy", build, out, exact(compute="auto", overwrite=True), progress=False)
    with FeatureCache(out) as fc:
        assert fc.meta["compute_dtype"] == "fp32"


def test_cpu_precision_selection_logic(monkeypatch) -> None:
    from spar_bench.probes.hardware import FORCE_ENV, cpu_precision

    monkeypatch.delenv(FORCE_ENV, raising=False)  # the probes decide here, not the environment
    assert cpu_precision(lambda: {"AMX": True, "AVX512-BF16": False}).dtype == "bf16"
    p = cpu_precision(lambda: {"AMX": False, "AVX512-BF16": False})
    assert p.dtype == "fp32" and "AMX and AVX512-BF16" in p.reason
    # no probes in this torch: the timing decides, with a margin against noise
    slow_bf16 = {"bf16": 0.030, "fp32": 0.001}
    assert cpu_precision(lambda: None, slow_bf16.__getitem__).dtype == "fp32"
    fast_bf16 = {"bf16": 0.0004, "fp32": 0.001}
    p = cpu_precision(lambda: None, fast_bf16.__getitem__)
    assert p.dtype == "bf16" and "bf16 0.40 ms, fp32 1.00 ms" in p.reason
    close = {"bf16": 0.0009, "fp32": 0.001}
    assert cpu_precision(lambda: None, close.__getitem__).dtype == "fp32"


@pytest.mark.parametrize("stated, dtype", [("native", "bf16"), ("none", "fp32")])
def test_auto_on_either_kind_of_cpu(monkeypatch, stated, dtype) -> None:
    """``SPAR_CPU_BF16`` fakes the CPU's bf16 (AMX/AVX512-BF16 or AVX2 only) for ``--compute
    auto``, whatever this CPU has: its probes and its timing are not asked."""
    import torch

    from spar_bench.probes.hardware import FORCE_ENV, cpu_precision, pick_compute

    def ask(*_):
        raise AssertionError("the CPU was asked")

    monkeypatch.setenv(FORCE_ENV, stated)
    p = pick_compute("auto", torch.device("cpu"))
    assert p == cpu_precision(ask, ask) and p.dtype == dtype and p.reason == f"stated by {FORCE_ENV}={stated}"
    assert pick_compute("fp32", torch.device("cpu")).dtype == "fp32"  # an explicit choice is kept
    monkeypatch.setenv(FORCE_ENV, "amx")
    with pytest.raises(ConfigError, match=f"^{FORCE_ENV}=amx: must be native or none"):
        pick_compute("auto", torch.device("cpu"))


def test_cli(build: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from spar_bench.probes.cli import cli

    out = tmp_path / "cli.h5"
    args = ["cache", "--encoder", "timm:resnet10t", "--data", str(build), "--out", str(out),
            "--levels", "level3", "--device", "cpu", "--batch", "8"]
    r = CliRunner().invoke(cli, args)
    assert isinstance(r.exception, ConfigError) and "--random-init" in str(r.exception)
    r = CliRunner().invoke(cli, [*args, "--random-init", "--layers", "-1,-3"])
    assert r.exit_code == 0, r.output
    with FeatureCache(out) as fc:
        assert fc.levels() == ["level3"] and fc.random_init and fc.meta["weights"]["kind"] == "random-init"
        assert fc.meta["dtype"] == "fp16" and fc.layers() == [-1, -3]
        assert fc.tokens("level3", "test", -1).shape == (7, 36, 512)
    r = CliRunner().invoke(cli, [*args, "--random-init", "--layers", "-1,x"])
    assert isinstance(r.exception, ConfigError)


@pytest.fixture(scope="session")
def phantom_build(tmp_path_factory) -> Path:
    """The real pipeline: ``spar-build phantom`` then ``spar-build --source phantom`` (~20-40 s)."""
    from click.testing import CliRunner

    from spar_bench.builder.cli import cli as build_cli

    tmp = tmp_path_factory.mktemp("phantom")
    runner = CliRunner()
    r = runner.invoke(build_cli, ["phantom", "--out", str(tmp / "P"), "--n", "6", "--layout", "canonical"])
    if r.exit_code != 0:
        pytest.fail(f"spar-build phantom failed: {r.output} {r.exception!r}")
    r = runner.invoke(build_cli, ["--source", "phantom", "--root", str(tmp / "P"), "--out", str(tmp / "B"),
                                  "--samples-per-case", "2", "--no-hf", "--images", "synthesize"])
    if r.exit_code != 0:
        pytest.fail(f"spar-build --source phantom failed: {r.output} {r.exception!r}")
    return tmp / "B"


@pytest.mark.slow
def test_end_to_end_on_phantom_build(phantom_build: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from spar_bench.probes.cli import cli

    out = tmp_path / "dummy.h5"
    r = CliRunner().invoke(cli, ["cache", "--encoder", "dummy", "--data", str(phantom_build), "--out",
                                 str(out), "--layers", "-1,-2", "--device", "cpu", "--compute", "fp32",
                                 "--dtype", "fp32", "--batch", "32"])
    assert r.exit_code == 0, r.output
    b = Build(phantom_build)
    enc = load_encoder("dummy")
    with FeatureCache(out) as fc:
        fc.check_matches(b)
        assert fc.levels() == b.levels() == ["level1", "level2", "level3"]
        for level in b.levels():
            assert fc.splits(level) == sorted(b.splits(level))
            for split in b.splits(level):
                keys = b.read(level, split, ["key"])["key"]
                np.testing.assert_array_equal(fc.keys(level, split), keys)
                rows = np.array([0, len(keys) - 1])
                want = enc(torch.from_numpy(b.images(level, split, rows)), [-2])[-2]
                np.testing.assert_allclose(fc.tokens(level, split, -2, rows=rows), want[0].numpy(),
                                           rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_full_size_paper_pair_on_cpu(phantom_build: Path, tmp_path: Path) -> None:
    n = Build(phantom_build).count("level1", "train")
    for name, shape in (("timm:resnet50", (49, 2048)), ("timm:vit_base_patch32_224", (50, 768))):
        out = write_cache(name, phantom_build, tmp_path / "c.h5",
                          CacheOptions(random_init=True, levels=["level1"], splits=["train"], device="cpu",
                                       batch_size=16, overwrite=True), progress=False)
        with FeatureCache(out) as fc:
            assert fc.random_init and fc.meta["weights"] == {"kind": "random-init"}
            assert fc.tokens("level1", "train").shape == (n, *shape)
            assert fc.tokens("level1", "train").dtype == np.float16
            assert np.isfinite(fc.pooled("level1", "train")).all()
