"""Unknown label ids (--unknown-labels fail|ignore) and TotalSegmentator's multi-label file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from spar_bench.builder.cli import cli
from spar_bench.builder.sources.totalsegmentator import TotalSegmentatorSource
from spar_bench.builder.sources.volume import MaskFile, MaskRead
from spar_bench.builder.sources.word import WordSource
from spar_bench.clitools import run_cli
from spar_bench.errors import CaseError

from lesion_folders import make_word_folder


def add_extra_label(path: Path, value: int = 42) -> None:
    img = nib.load(str(path))
    data = np.asarray(img.dataobj).copy()
    data[0, 0, : data.shape[2] // 2] = value
    nib.save(nib.Nifti1Image(data, img.affine, img.header), str(path))


def test_extra_label_fails_by_default_and_is_ignored_and_recorded(tmp_path, capsys):
    root = make_word_folder(tmp_path / "word", (2, 0, 1))
    add_extra_label(root / "labelsTr" / "word_0000.nii.gz")
    src = WordSource(root)
    with pytest.raises(CaseError, match=r"unknown label value\(s\) \[42\].*--unknown-labels ignore"):
        src.load(src.find()[0])
    case = WordSource(root, unknown_labels="ignore").load(src.find()[0])
    assert 42 not in np.unique(case.mask) and case.provenance["ignored_label_ids"] == {"42": 10}
    out = tmp_path / "out"
    base = ["--source", "word", "--root", str(root), "--levels", "level3", "--no-hf", "--out"]
    assert run_cli(cli, [*base, str(tmp_path / "refused")]) == 2
    assert "word_0000" in capsys.readouterr().err
    assert run_cli(cli, [*base, str(out), "--unknown-labels", "ignore"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    ignored = {c["case_id"]: c["provenance"].get("ignored_label_ids") for c in m["cases"]}
    assert ignored == {"word_0000": {"42": 10}, "word_0001": None, "word_0002": None}
    assert m["config"]["unknown_labels"] == "ignore"
    assert run_cli(cli, ["inspect", "--source", "word", "--root", str(root), "--case", "word_0000",
                         "--unknown-labels", "ignore"]) == 0
    assert "ignored label ids: 42 (10 voxels)" in capsys.readouterr().out


def test_real_word_map_with_an_extra_id(word_labels_dir, tmp_path):
    root = tmp_path / "word"
    (root / "labelsTs").mkdir(parents=True)
    shutil.copy(word_labels_dir / "labelsTs" / "word_0014.nii.gz", root / "labelsTs")
    add_extra_label(root / "labelsTs" / "word_0014.nii.gz", 99)
    src = WordSource(root, images="synthesize", unknown_labels="ignore")
    read = src.read_mask(src.find()[0])
    mask, extra = read.mask, read.extra
    assert isinstance(read, MaskRead) and [type(f) for f in read.files] == [MaskFile]
    assert extra["ignored_label_ids"] == {"99": mask.shape[2] // 2} and mask.max() == 16


def write_multilabel(case_dir: Path, extra_id: int | None = None) -> dict[int, str]:
    """Combine segmentations/<class>.nii.gz into segmentations.nii.gz with a Caret XML class table."""
    files = sorted((case_dir / "segmentations").glob("*.nii.gz"))
    table = {i + 1: f.name[: -len(".nii.gz")] for i, f in enumerate(files)}
    ref = nib.load(str(files[0]))
    data = np.zeros(ref.shape, np.uint8)
    for i, f in enumerate(files):
        data[np.asarray(nib.load(str(f)).dataobj) > 0] = i + 1
    if extra_id is not None:
        data[0, 0, 0] = extra_id
    img = nib.Nifti1Image(data, ref.affine)
    body = "".join(f'<Label Key="{k}" Red="1" Green="0" Blue="0" Alpha="1"><![CDATA[{v}]]></Label>\n'
                   for k, v in table.items())
    xml = ('<?xml version="1.0" encoding="UTF-8"?> <CaretExtension><VolumeInformation Index="0"><LabelTable>\n'
           f"{body}</LabelTable></VolumeInformation></CaretExtension>")
    img.header.extensions.append(nib.nifti1.Nifti1Extension(0, xml.encode("utf-8")))
    nib.save(img, str(case_dir / "segmentations.nii.gz"))
    return table


def test_totalsegmentator_multilabel_file_equals_the_class_folder(totalseg_dir, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(totalseg_dir, folder)
    single = tmp_path / "single"
    shutil.copytree(totalseg_dir, single)
    write_multilabel(single / "s0001")
    shutil.rmtree(single / "s0001" / "segmentations")
    a_src, b_src = TotalSegmentatorSource(folder), TotalSegmentatorSource(single)
    a, b = a_src.load(a_src.find()[0]), b_src.load(b_src.find()[0])
    assert b.provenance["files"]["segmentations"].endswith("segmentations.nii.gz")
    mapped = b.provenance["class_table"]
    assert set(mapped.values()) == set(a_src._classes)
    overlap = a.provenance["overlap_voxels"]
    assert overlap == 0 and np.array_equal(a.mask, b.mask) and a.annotated == b.annotated
    ra, rb = a_src.read_mask(a_src.find()[0]), b_src.read_mask(b_src.find()[0])
    assert isinstance(ra, MaskRead) and isinstance(rb, MaskRead) and rb.lesion is None
    assert len(ra.files) > 1 and all(isinstance(f, MaskFile) and f.shape == ra.mask.shape for f in ra.files)


def test_totalsegmentator_multilabel_unknown_id(totalseg_dir, tmp_path):
    root = tmp_path / "ts"
    shutil.copytree(totalseg_dir, root)
    write_multilabel(root / "s0001", extra_id=200)
    shutil.rmtree(root / "s0001" / "segmentations")
    src = TotalSegmentatorSource(root)
    with pytest.raises(CaseError, match=r"\[200\]"):
        src.load(src.find()[0])
    case = TotalSegmentatorSource(root, unknown_labels="ignore").load(src.find()[0])
    assert case.provenance["ignored_label_ids"] == {"200": 1}
