"""The procedural phantom, the pseudo-CT renderer and the phantom dataset writer/source."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from spar_bench.builder.phantom.generate import (
    PAINT_ORDER,
    PhantomOptions,
    assign_splits,
    make_phantom,
    render_phantom,
    sample_phantom_params,
    split_counts,
    write_phantom_dataset,
)
from spar_bench.builder.schema import ORGAN_ID, ORGANS
from spar_bench.builder.synth.render import RenderError, derive_body, render_pseudo_ct
from spar_bench.errors import ConfigError, SparError

from helpers import tree_hashes

GRID = {"in_plane": 96, "n_slices": 32}  # small grid: fast, big enough for every organ


def col(vol, organ: str) -> float:
    """Mean column of an organ (patient's right = small columns)."""
    cols = np.nonzero(vol.mask == ORGAN_ID[organ])[2]
    assert cols.size, f"{organ} absent"
    return float(cols.mean())


@pytest.fixture(scope="module")
def batch() -> dict[tuple[str, int], object]:
    """Rendered phantoms: 5 seeds of canonical and mirrored, 12 of random."""
    out = {}
    for layout, seeds in (("canonical", range(5)), ("mirrored", range(5)), ("random", range(12))):
        for s in seeds:
            out[(layout, s)] = make_phantom(s, layout, **GRID)
    return out


# ---- generator -----------------------------------------------------------------------
def test_same_seed_identical_different_seed_differs():
    a = make_phantom(7, "random", **GRID)
    b = make_phantom(7, "random", **GRID)
    c = make_phantom(8, "random", **GRID)
    for name in ("mask", "lesion", "image", "body", "bone"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.params == b.params
    assert a.mask.shape != c.mask.shape or not np.array_equal(a.mask, c.mask)
    assert a.params != c.params


def test_params_are_json_and_render_is_pure():
    params = sample_phantom_params(np.random.default_rng(3), "canonical", **GRID)
    again = json.loads(json.dumps(params))
    a, b = render_phantom(params), render_phantom(again)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_array_equal(a.image, b.image)
    assert params["layout"] == "canonical" and len(params["organs"]) == 16


def test_default_size_has_every_organ_and_plausible_geometry():
    vol = make_phantom(0, "canonical")
    nz, nr, nc = vol.mask.shape
    assert (nr, nc) == (160, 160) and 40 <= nz <= 60
    assert 4.5 <= vol.spacing[0] <= 5.5 and 1.5 <= vol.spacing[1] <= 2.6
    counts = np.bincount(vol.mask.ravel(), minlength=17)
    assert all(counts[1:] > 0), [o for o, c in zip(ORGANS, counts[1:], strict=True) if not c]
    # liver is the largest solid organ; femoral heads are the most inferior organs
    assert counts[ORGAN_ID["liver"]] > counts[ORGAN_ID["spleen"]] > counts[ORGAN_ID["adrenal"]]
    z = {o: np.nonzero(vol.mask == ORGAN_ID[o])[0].mean() for o in ORGANS}
    assert z["head_of_femur_left"] < z["kidney_left"] < z["esophagus"]
    assert z["bladder"] < z["liver"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_canonical_layout_left_right(batch, seed):
    vol = batch[("canonical", seed)]
    assert col(vol, "liver") < col(vol, "spleen")
    assert col(vol, "kidney_right") < col(vol, "kidney_left")
    assert col(vol, "head_of_femur_right") < col(vol, "head_of_femur_left")
    # kidneys lie posterior to the liver's centre, either side of the spine
    rows = {o: np.nonzero(vol.mask == ORGAN_ID[o])[1].mean() for o in ("kidney_left", "liver")}
    assert rows["kidney_left"] > rows["liver"]
    spine_col = np.nonzero(vol.bone)[2].mean()
    assert col(vol, "kidney_right") < spine_col < col(vol, "kidney_left")


@pytest.mark.parametrize("seed", range(5))
def test_mirrored_layout_is_situs_inversus(batch, seed):
    vol = batch[("mirrored", seed)]
    assert col(vol, "liver") > col(vol, "spleen")
    assert col(vol, "kidney_right") > col(vol, "kidney_left")  # kidney_left on the patient's RIGHT
    assert col(vol, "head_of_femur_right") > col(vol, "head_of_femur_left")
    # the same subject mirrored: the liver's column mirrors about the body midline
    canon = batch[("canonical", seed)]
    mid = (vol.mask.shape[2] - 1) / 2
    assert abs((col(vol, "liver") - mid) + (col(canon, "liver") - mid)) < 3.0


def test_random_layout_breaks_canonical_relations(batch):
    liver_right = [
        col(batch[("random", s)], "liver") < col(batch[("random", s)], "spleen") for s in range(12)
    ]
    kidneys = [
        col(batch[("random", s)], "kidney_right") < col(batch[("random", s)], "kidney_left")
        for s in range(12)
    ]
    assert any(liver_right) and not all(liver_right), liver_right
    assert any(kidneys) and not all(kidneys), kidneys


def test_random_layout_moves_organs_between_slots(batch):
    # in canonical anatomy the liver is superior to the bladder; random slots break it
    z = [
        np.nonzero(batch[("random", s)].mask == ORGAN_ID["liver"])[0].mean()
        > np.nonzero(batch[("random", s)].mask == ORGAN_ID["bladder"])[0].mean()
        for s in range(12)
        if (batch[("random", s)].mask == ORGAN_ID["bladder"]).any()
    ]
    assert not all(z)


@pytest.mark.parametrize("layout", ["canonical", "mirrored", "random"])
def test_organs_inside_body_off_spine_lesions_in_liver(batch, layout):
    for (lay, _), vol in batch.items():
        if lay != layout:
            continue
        organ = vol.mask > 0
        assert not (organ & ~vol.body).any()
        assert not (organ & vol.bone).any()
        assert vol.lesion.dtype == np.uint8 and set(np.unique(vol.lesion)) <= {0, 1}
        assert not ((vol.lesion > 0) & (vol.mask != ORGAN_ID["liver"])).any()


def test_first_painted_organ_is_never_carved():
    """Non-overlap by priority: the first organ painted keeps its whole shape."""
    from spar_bench.builder.phantom.generate import organ_shape
    from spar_bench.builder.synth.render import inplane_depth

    vol = make_phantom(2, "canonical", **GRID)
    first = vol.params["organs"][0]
    assert first["name"] == PAINT_ORDER[0]
    shape, sp = vol.mask.shape, vol.spacing
    full = organ_shape(first, shape, sp)
    full &= (inplane_depth(vol.body, sp) > vol.params["wall_mm"]) & ~vol.bone
    np.testing.assert_array_equal(vol.mask == first["id"], full)


def test_lesions_drawn_and_optional():
    with_les = [make_phantom(s, "canonical", **GRID) for s in range(6)]
    assert any(v.lesion.sum() > 0 for v in with_les)
    assert all(len(v.params["lesions"]) <= 4 for v in with_les)
    none = make_phantom(0, "canonical", lesions=False, **GRID)
    assert none.params["lesions"] == [] and none.lesion.sum() == 0


def test_bad_layout_and_size_raise_config_error():
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="layout 'situs'"):
        sample_phantom_params(rng, "situs")
    with pytest.raises(ConfigError, match="size 'huge'"):
        sample_phantom_params(rng, "canonical", size="huge")


# ---- renderer ------------------------------------------------------------------------
def test_phantom_hu_ranges(batch):
    vol = batch[("canonical", 1)]
    img, mask = vol.image, vol.mask
    assert img.dtype == np.int16

    def mean(sel):
        return float(img[sel].mean())

    assert mean(~vol.body) < -900
    assert 30 < mean(mask == ORGAN_ID["liver"]) < 90
    assert 25 < mean(mask == ORGAN_ID["spleen"]) < 80
    assert mean(mask == ORGAN_ID["kidney_left"]) > 100
    assert mean(mask == ORGAN_ID["head_of_femur_left"]) > 300
    assert mean(vol.bone) > 300
    soft = vol.body & (mask == 0) & ~vol.bone
    assert -120 < mean(soft) < 20  # fat and muscle
    assert img[mask == ORGAN_ID["colon"]].min() < -500  # gas pockets
    assert img.min() >= -1024 and img.max() <= 3071
    lesion_vol = next(v for v in (batch[("canonical", s)] for s in range(5)) if v.lesion.sum() > 30)
    liver_only = (lesion_vol.mask == ORGAN_ID["liver"]) & (lesion_vol.lesion == 0)
    assert lesion_vol.image[lesion_vol.lesion > 0].mean() < lesion_vol.image[liver_only].mean() - 20


def test_render_is_seeded():
    vol = make_phantom(4, "canonical", **GRID)
    a = render_pseudo_ct(vol.mask, vol.spacing, seed=1)
    b = render_pseudo_ct(vol.mask, vol.spacing, seed=1)
    c = render_pseudo_ct(vol.mask, vol.spacing, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_render_rejects_bad_input():
    mask = np.zeros((4, 8, 8), np.uint8)
    mask[1:3, 2:6, 2:6] = 1
    with pytest.raises(RenderError, match="label 20"):
        render_pseudo_ct(np.where(mask, 20, 0).astype(np.uint8), (1, 1, 1), seed=0)
    with pytest.raises(RenderError, match="spacing"):
        render_pseudo_ct(mask, (1, 0, 1), seed=0)
    with pytest.raises(RenderError, match="lesion shape"):
        render_pseudo_ct(mask, (1, 1, 1), seed=0, lesion=np.zeros((4, 8, 7), np.uint8))
    with pytest.raises(RenderError, match="3-D"):
        render_pseudo_ct(mask[0], (1, 1, 1), seed=0)
    with pytest.raises(RenderError, match="no organ voxel"):
        render_pseudo_ct(np.zeros_like(mask), (1, 1, 1), seed=0)
    assert issubclass(RenderError, SparError)


def test_derived_body_encloses_organs_with_margin():
    vol = make_phantom(3, "canonical", **GRID)
    body = derive_body(vol.mask, vol.spacing)
    assert not ((vol.mask > 0) & ~body).any()
    # 30 mm lateral margin: the body reaches beyond the organs' column extent
    cols = np.nonzero(vol.mask > 0)[2]
    bcols = np.nonzero(body)[2]
    assert bcols.min() < cols.min() and bcols.max() > cols.max()


@pytest.mark.slow
def test_render_real_word_label_map(word_labels_dir):
    from spar_bench.builder.sources.word import WordSource

    src = WordSource(word_labels_dir, images="synthesize", seed=0)
    ref = next(r for r in src.find() if r.case_id == "word_0014")
    case = src.load(ref)
    img, mask = case.image, case.mask
    assert img.dtype == np.int16 and img.shape == mask.shape
    assert case.image_synthesized
    # field of view: air in the corners, body in the middle
    assert img[:, :8, :8].mean() < -900 and img[:, -8:, -8:].mean() < -900
    assert img[mask > 0].mean() > -200
    assert 30 < img[mask == ORGAN_ID["liver"]].mean() < 90
    assert img[mask == ORGAN_ID["kidney_left"]].mean() > 100
    body = derive_body(mask, case.spacing)
    mid = int(np.argmax((mask > 0).sum(axis=(1, 2))))
    frac = body[mid].mean()
    assert 0.15 < frac < 0.9, frac
    assert img[mid][body[mid]].mean() > img[mid][~body[mid]].mean() + 800


# ---- dataset writer and source -------------------------------------------------------
def test_split_counts():
    assert split_counts(150) == {"train": 100, "val": 20, "test": 30}
    assert split_counts(3) == {"train": 1, "val": 1, "test": 1}
    assert split_counts(1) == {"train": 1, "val": 0, "test": 0}
    assert split_counts(2) == {"train": 1, "val": 0, "test": 1}
    s = assign_splits(30, 5)
    assert s == assign_splits(30, 5) and sorted(set(s)) == ["test", "train", "val"]
    with pytest.raises(ConfigError):
        split_counts(0)


#: a 48 x 48 x 10 grid: cases render in a fraction of a second
SMALL = PhantomOptions(in_plane=48, n_slices=10)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ph") / "mirrored"
    opts = PhantomOptions(layout="mirrored", seed=11, in_plane=64, n_slices=20)
    record = write_phantom_dataset(out, 3, opts, progress=False)
    return out, record


def test_write_layout_and_record(written):
    out, record = written
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["phantom.json", "imagesTr", "labelsTr", "imagesVal", "labelsVal", "imagesTs", "labelsTs"]
    )
    on_disk = json.loads((out / "phantom.json").read_text())
    assert on_disk == json.loads(json.dumps(record))
    assert on_disk["layout"] == "mirrored" and on_disk["seed"] == 11 and on_disk["n"] == 3
    assert on_disk["splits"] == {"train": 1, "val": 1, "test": 1}
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # temp dir renamed away
    import nibabel as nib

    lab = nib.load(out / "labelsTr" / next((out / "labelsTr").iterdir()).name)
    assert nib.aff2axcodes(lab.affine) == ("L", "P", "S")
    assert lab.get_data_dtype() == np.uint8


def test_written_cases_read_back_through_phantom_source(written):
    from spar_bench.builder.sources import SOURCES

    out, record = written
    src = SOURCES.get("phantom")(out)
    assert src.has_lesions and src.label_map()["lesion_ids"] == [17]
    refs = src.find()
    assert [r.case_id for r in refs] == sorted(record["cases"])
    for ref in refs:
        case = src.load(ref)
        assert ref.split == record["cases"][ref.case_id]["split"]
        vol = render_phantom(record["cases"][ref.case_id]["params"])
        np.testing.assert_array_equal(case.mask, vol.mask)  # reoriented back exactly
        np.testing.assert_array_equal(case.lesion, vol.lesion)
        np.testing.assert_array_equal(case.image, vol.image)
        np.testing.assert_allclose(case.spacing, vol.spacing, rtol=1e-5)
        assert case.provenance["layout"] == "mirrored"
        assert not case.image_synthesized


def test_phantom_record_is_parsed_once_and_reread_when_it_changes(written, tmp_path):
    """The builder opens one source per case: the record is parsed once per file version, not
    per case (a 1,000-case build was quadratic), and a rewritten record is read afresh."""
    import shutil

    from spar_bench.builder.sources import SOURCES
    from spar_bench.builder.sources.phantom import _parsed_record

    out, record = written
    copy = tmp_path / "ph"
    shutil.copytree(out, copy)
    src_cls = SOURCES.get("phantom")
    _parsed_record.cache_clear()
    for ref in src_cls(copy).find():
        assert src_cls(copy).load(ref).provenance["layout"] == "mirrored"
    assert _parsed_record.cache_info().misses == 1
    rec = json.loads((copy / "phantom.json").read_text())
    (copy / "phantom.json").write_text(json.dumps({**rec, "layout": "random"}))
    assert src_cls(copy).record()["layout"] == "random"
    (copy / "phantom.json").write_text('{"layout": ')  # torn
    with pytest.raises(ConfigError, match=r"phantom\.json: invalid JSON .*regenerate"):
        src_cls(copy).record()


def test_writer_refuses_non_empty_out(written, tmp_path):
    out, _ = written
    with pytest.raises(ConfigError, match="not empty"):
        write_phantom_dataset(out, 1, SMALL, progress=False)
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a SPAR-Bench phantom dataset"):
        write_phantom_dataset(other, 1, SMALL, overwrite=True, progress=False)
    assert (other / "notes.txt").read_text() == "keep me"


def test_overwrite_replaces_a_phantom_dataset(tmp_path):
    out = tmp_path / "ds"
    write_phantom_dataset(out, 1, replace(SMALL, layout="random"), progress=False)
    rec = write_phantom_dataset(out, 2, replace(SMALL, layout="canonical", seed=1), overwrite=True,
                                progress=False)
    assert json.loads((out / "phantom.json").read_text())["layout"] == "canonical"
    assert rec["splits"] == {"train": 1, "val": 0, "test": 1}
    assert len(list(out.glob("labels*/*.nii.gz"))) == 2


def test_cli_writes_and_reports(tmp_path, capsys):
    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    out = tmp_path / "cli"
    rc = run_cli(
        cli,
        [
            "phantom",
            "--out",
            str(out),
            "--n",
            "1",
            "--layout",
            "random",
            "--seed",
            "2",
            "--no-lesions",
        ],
    )
    assert rc == 0
    assert "wrote 1 random phantom cases" in capsys.readouterr().out
    rec = json.loads((out / "phantom.json").read_text())
    assert rec["lesions"] is False and rec["layout"] == "random"
    rc = run_cli(cli, ["phantom", "--out", str(out), "--n", "1"])
    assert rc == 2
    assert "pass --overwrite" in capsys.readouterr().err


def test_cli_grid_overrides_the_size_preset_and_is_recorded(tmp_path: Path, capsys) -> None:
    import nibabel as nib

    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    out = tmp_path / "g"
    assert run_cli(cli, ["phantom", "--out", str(out), "--n", "2", "--in-plane", "48", "--slices", "10"]) == 0
    assert "48x48 in-plane, 10-10 slices" in capsys.readouterr().out
    rec = json.loads((out / "phantom.json").read_text())
    assert (rec["in_plane"], rec["n_slices"]) == (48, 10)
    assert all(c["shape"] == [10, 48, 48] for c in rec["cases"].values())
    (img,) = (out / "imagesTr").glob("*.nii.gz")
    assert nib.load(img).shape == (48, 48, 10)  # stored L,P,S: x, y, z
    default = write_phantom_dataset(tmp_path / "d", 1, progress=False)
    assert "in_plane" not in default and "n_slices" not in default  # default records unchanged
    assert run_cli(cli, ["phantom", "--out", str(tmp_path / "x"), "--n", "1", "--in-plane", "16"]) == 2
    assert "--in-plane" in capsys.readouterr().err


def test_phantom_bytes_do_not_depend_on_the_number_of_workers(tmp_path: Path) -> None:
    """``spar-build phantom --workers N`` renders cases in N processes: same files, same bytes."""
    one = write_phantom_dataset(tmp_path / "w1", 3, replace(SMALL, seed=5), progress=False)
    three = write_phantom_dataset(tmp_path / "w3", 3, replace(SMALL, seed=5), progress=False, workers=3)
    assert one == three
    hashes = tree_hashes(tmp_path / "w1")
    assert len(hashes) == 7  # phantom.json + an image and a label map per case
    assert hashes == tree_hashes(tmp_path / "w3")


def test_phantom_options_refuse_a_bad_choice_in_one_line() -> None:
    for field, bad, valid in (("layout", "diagonal", "canonical"), ("size", "huge", "small"),
                              ("intensities", "mri", "distinct")):
        with pytest.raises(ConfigError, match=rf"unknown phantom {field} '{bad}'; choose one of .*{valid}"):
            PhantomOptions(**{field: bad})
