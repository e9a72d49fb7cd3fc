"""Level 1/2 samples, the 224 frame and the sample config, on tiny synthetic cases."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import ndimage

from spar_bench.builder.case import Case
from spar_bench.builder.samples import SampleConfig, process_case
from spar_bench.builder.samples.frame224 import (
    frame_for_case,
    resample_slices,
    slice_stats,
    window_to_uint8,
)
from spar_bench.builder.samples.level12 import arrangement_slots, compose_mosaic
from spar_bench.builder.schema import IMAGE_SIZE, N_ORGANS, ORGAN_ID, TILE_SIZE
from spar_bench.errors import CaseError, ConfigError

# the synthetic case has 5 organs: below the default Level 1-2 floor (test_level12_floor.py)
CFG = SampleConfig(levels=("level1", "level2"), samples_per_case=6, l12_min_organs=1)


def synthetic_case(case_id: str = "c0", shape=(10, 60, 80), spacing=(2.0, 1.5, 1.2)) -> Case:
    """A body ellipse with a few box organs; organs whose size varies with z."""
    z_n, h, w = shape
    rr, cc = np.mgrid[:h, :w]
    body = ((rr - h / 2) / (h * 0.48)) ** 2 + ((cc - w / 2) / (w * 0.45)) ** 2 <= 1
    image = np.where(body, 20, -1000).astype(np.int16)[None].repeat(z_n, axis=0)
    mask = np.zeros(shape, dtype=np.uint8)
    for z in range(z_n):
        grow = z % 4
        mask[z, 15 : 30 + grow, 12 : 30 + grow] = ORGAN_ID["liver"]  # patient's right: small col
        mask[z, 18:28, 55 : 62 + grow] = ORGAN_ID["spleen"]
        mask[z, 35:45, 20:28] = ORGAN_ID["kidney_right"]
        mask[z, 35:44, 50:58] = ORGAN_ID["kidney_left"]
    mask[2:6, 8:14, 36:44] = ORGAN_ID["stomach"]
    image[mask > 0] = 60 + 5 * mask[mask > 0]
    return Case("synth", case_id, "train", mask, spacing, image=image)


def test_config_round_trip_and_errors():
    cfg = SampleConfig(samples_per_case=3, counterfactual="mirror", arrangement="rank-x")
    d = json.loads(json.dumps(cfg.to_dict()))
    assert SampleConfig.from_dict(d) == cfg
    with pytest.raises(ConfigError, match="did you mean 'samples_per_case'"):
        SampleConfig.from_dict({"sample_per_case": 3})
    with pytest.raises(ConfigError, match="arrangement"):
        SampleConfig(arrangement="by-colour")
    with pytest.raises(ConfigError, match="samples_per_case"):
        SampleConfig(samples_per_case=0)
    with pytest.raises(ConfigError, match="levels"):
        SampleConfig(levels=("level5",))


def test_window_to_uint8():
    hu = np.array([-1000, -160, 40, 240, 3000])
    assert window_to_uint8(hu, 40, 400).tolist() == [0, 0, 128, 255, 255]


def test_frame_is_square_around_body_and_maps_centroids():
    case = synthetic_case()
    frame = frame_for_case(case, margin_mm=10.0)
    rows = np.flatnonzero((case.image > -500).any(axis=(0, 2)))
    cols = np.flatnonzero((case.image > -500).any(axis=(0, 1)))
    extent_r = (rows[-1] - rows[0] + 1) * 1.5 + 20
    extent_c = (cols[-1] - cols[0] + 1) * 1.2 + 20
    assert frame.side_mm == pytest.approx(max(extent_r, extent_c))
    assert frame.mm_per_pixel == pytest.approx(frame.side_mm / IMAGE_SIZE)
    # the resampled (nearest) label's centroid agrees with the mapped native centroid
    stats = slice_stats(case)
    label = resample_slices(case.mask, np.array([3]), frame, mode="nearest", fill=0)[0]
    for organ in ("liver", "kidney_left"):
        oid = ORGAN_ID[organ]
        y224, x224 = ndimage.center_of_mass(label == oid)
        x, y = frame.to_frame(*stats.centroid_rc[3, oid])
        assert abs(x - x224) < 0.5 and abs(y - y224) < 0.5
    # outside the volume the image is air
    hu = resample_slices(case.image, np.array([0]), frame, mode="bilinear", fill=-1000.0)[0]
    assert hu[0, 0] == pytest.approx(-1000.0)


def test_level1_fields_presence_and_tiles():
    case = synthetic_case()
    out = process_case(case, CFG, global_seed=7)
    l1 = out["level1"]
    n = CFG.samples_per_case
    assert l1["image"].shape == (n, IMAGE_SIZE, IMAGE_SIZE) and l1["image"].dtype == np.uint8
    assert l1["key"][2] == "synth/c0/level1/00002"
    present_ids = {
        ORGAN_ID[o] - 1 for o in ("liver", "spleen", "kidney_left", "kidney_right", "stomach")
    }
    stats = slice_stats(case)
    for i in range(n):
        tiles = (
            l1["image"][i]
            .reshape(4, TILE_SIZE, 4, TILE_SIZE)
            .transpose(0, 2, 1, 3)
            .reshape(16, TILE_SIZE, TILE_SIZE)
        )
        for o in range(N_ORGANS):
            if o in present_ids:
                assert l1["present"][i, o]
                z = l1["slice_index"][i, o]
                area = stats.area_px[:, o + 1]
                assert area[z] >= CFG.tile_min_area_frac * area.max()
                assert tiles[o].any()
                assert np.all((l1["centroid"][i, o] >= 0) & (l1["centroid"][i, o] <= 1))
            else:
                assert not l1["present"][i, o]
                assert np.isnan(l1["centroid"][i, o]).all()
                assert l1["slice_index"][i, o] == -1
                assert not tiles[o].any()
    # tiles only show the organ: the liver tile holds the liver's uniform window value or 0
    liver_value = window_to_uint8(np.array([60 + 5 * ORGAN_ID["liver"]]), 40, 400)[0]
    liver_tile = l1["image"][0, :TILE_SIZE, :TILE_SIZE]
    assert liver_tile.max() <= liver_value and (liver_tile == liver_value).sum() > 100
    # liver (patient's right) has a smaller x than the spleen
    assert np.all(l1["centroid"][:, 0, 0] < l1["centroid"][:, 1, 0])


def test_arrangement_slots_by_hand():
    present = np.zeros(16, bool)
    present[[0, 1, 2, 3, 4, 5]] = True
    c = np.full((16, 2), np.nan)
    #           x     y
    c[0] = (0.10, 0.50)
    c[1] = (0.90, 0.10)
    c[2] = (0.50, 0.20)
    c[3] = (0.30, 0.15)
    c[4] = (0.70, 0.60)
    c[5] = (0.20, 0.30)
    # rows-by-y: sorted by y -> 1, 3, 2, 5 | 0, 4 ; row 1 by x -> 5, 3, 2, 1 ; row 2 -> 0, 4
    slots = arrangement_slots(c, present, "rows-by-y")
    assert [int(np.flatnonzero(slots == s)[0]) for s in range(6)] == [5, 3, 2, 1, 0, 4]
    assert (slots[~present] == -1).all()
    assert [
        int(np.flatnonzero(arrangement_slots(c, present, "rank-x") == s)[0]) for s in range(6)
    ] == [0, 5, 3, 2, 4, 1]
    assert [
        int(np.flatnonzero(arrangement_slots(c, present, "rank-y") == s)[0]) for s in range(6)
    ] == [1, 3, 2, 5, 0, 4]
    # ties broken by organ index
    c[5] = c[3]
    assert arrangement_slots(c, present, "rank-x")[3] < arrangement_slots(c, present, "rank-x")[5]


@pytest.mark.parametrize("arrangement", ["rows-by-y", "rank-x", "rank-y"])
def test_level2_perm_and_target_slot_reconstruct_the_arrangement(arrangement):
    case = synthetic_case()
    cfg = SampleConfig(levels=("level1", "level2"), samples_per_case=4, arrangement=arrangement,
                       l12_min_organs=1)
    out = process_case(case, cfg, global_seed=3)
    l1, l2 = out["level1"], out["level2"]
    for i in range(4):
        perm, slot = l2["perm"][i].astype(int), l2["target_slot"][i].astype(int)
        assert sorted(perm.tolist()) == list(range(16))
        assert (l2["present_pos"][i] == l1["present"][i][perm]).all()
        assert ((slot >= 0) == l2["present_pos"][i]).all()
        n_present = int(l1["present"][i].sum())
        assert sorted(slot[slot >= 0].tolist()) == list(range(n_present))
        # organs in slot order == the arrangement recomputed from the Level 1 centroids
        organs_by_slot = perm[np.argsort(np.where(slot >= 0, slot, 99))][:n_present]
        expected = arrangement_slots(l1["centroid"][i], l1["present"][i], arrangement)
        assert (expected[organs_by_slot] == np.arange(n_present)).all()
        # the Level 2 mosaic shows the Level 1 tiles at the permuted positions
        tiles1 = l1["image"][i].reshape(4, 56, 4, 56).transpose(0, 2, 1, 3).reshape(16, 56, 56)
        assert (l2["image"][i] == compose_mosaic(tiles1[perm])).all()


def test_determinism_order_and_seed():
    a, b = synthetic_case("a"), synthetic_case("b")
    first = process_case(a, CFG, 11)
    process_case(b, CFG, 11)
    again = process_case(a, CFG, 11)
    for level in ("level1", "level2"):
        for name, arr in first[level].items():
            np.testing.assert_array_equal(arr, again[level][name], err_msg=f"{level}.{name}")
    other = process_case(a, CFG, 12)
    assert not np.array_equal(first["level2"]["perm"], other["level2"]["perm"])
    assert not np.array_equal(first["level1"]["seed"], other["level1"]["seed"])


def test_bad_cases_raise_case_errors():
    case = synthetic_case()
    no_image = Case("synth", "noimg", "train", case.mask, case.spacing)
    with pytest.raises(CaseError, match="noimg.*has no image"):
        process_case(no_image, CFG, 0)
    bad = case.mask.copy()
    bad[1, 0, 0] = 40
    with pytest.raises(CaseError, match="label id 40 on slice z=1"):
        process_case(Case("synth", "badlab", "train", bad, case.spacing, image=case.image), CFG, 0)
    negative = case.mask.astype(np.int16)
    negative[2, 3, 3] = -1
    with pytest.raises(CaseError, match="neglab.*negative label id -1"):
        process_case(
            Case("synth", "neglab", "train", negative, case.spacing, image=case.image), CFG, 0
        )
