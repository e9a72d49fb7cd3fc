"""Counting from real lesions: LiTS-like and KiTS-like folders, nnU-Net lesion label names."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.builder.ontology import label_map_from_names
from spar_bench.builder.samples import SampleConfig, process_case
from spar_bench.builder.schema import LEVEL3_PROBES, ORGAN_ID, ORGANS
from spar_bench.builder.sources.lits import LitsSource
from spar_bench.builder.sources.nnunet import NnUNetSource

from lesion_folders import make_kits_folder, make_lits_folder

COUNTING = LEVEL3_PROBES.index("counting")
CFG = SampleConfig(levels=("level3",))


def counting_answers(case) -> np.ndarray:
    q = process_case(case, CFG, 0)["level3_questions"]
    return q["q_answer"][q["q_probe"] == COUNTING]


@pytest.mark.parametrize(
    "dataset, labels, host",
    [
        ("MSD Liver", {"background": 0, "liver": 1, "cancer": 2}, "liver"),
        ("MSD Pancreas", {"background": 0, "pancreas": 1, "cancer": 2}, "pancreas"),
        ("KiTS19", {"background": 0, "Kidney": 1, "Tumor": 2}, "kidney"),
        ("MSD Colon", {"background": 0, "colon cancer primaries": 1}, None),
        ("LiTS as nnU-Net", {"background": 0, "liver": 1, "liver tumour": 2}, "liver"),
    ],
)
def test_lesion_names_make_a_lesion_channel(dataset, labels, host):
    lm = label_map_from_names(dataset, labels)
    assert lm.has_lesions and len(lm.lesion_ids) == 1, dataset
    raw = lm.lesion_ids[0]
    assert lm.ids[raw] == host  # the lesion voxels belong to the host organ (or background)
    if host is None:  # a lesion alone never annotates its organ
        assert not any(lm.annotated)
    elif host == "kidney":
        assert lm.sided and lm.annotated[ORGANS.index("kidney_left")] and lm.annotated[ORGANS.index("kidney_right")]
    else:
        assert lm.annotated[ORGANS.index(host)] and sum(lm.annotated) == 1


def test_two_organs_and_an_unqualified_tumour_stay_background():
    lm = label_map_from_names("x", {"liver": 1, "spleen": 2, "tumor": 3})
    assert lm.has_lesions and lm.ids[3] is None  # which organ hosts it is unknown


def test_lits_like_folder_gives_counting_questions(tmp_path):
    root = make_lits_folder(tmp_path / "lits", 3)
    src = LitsSource(root)
    refs = src.find()
    assert [r.case_id for r in refs] == ["lits_0000", "lits_0001", "lits_0002"]
    case = src.load(refs[0])
    assert case.provenance["orientation"]["axcodes"] == "RAS"
    liver_cols = np.nonzero(case.mask == ORGAN_ID["liver"])[2]
    assert liver_cols.mean() < case.shape[2] / 2  # liver on the patient's right: small columns
    assert case.lesion is not None and case.lesion.any()
    assert not (case.lesion.astype(bool) & (case.mask != ORGAN_ID["liver"])).any()
    out = process_case(case, CFG, 0)
    q = out["level3_questions"]
    assert len(out["level3"]["slice_index"]) > 0  # one organ only, yet Level 3 slices
    assert set(q["q_probe"].tolist()) == {COUNTING}  # organ probes keep the two-organ rule
    answers = np.concatenate([counting_answers(src.load(r)) for r in refs])
    assert (answers >= 2).any() and (answers == 0).any()  # several components per slice, and none


def test_kits_like_folder_kidneys_split_by_side_with_lesions(tmp_path):
    root = make_kits_folder(tmp_path / "kits", 2)
    src = NnUNetSource(root)
    refs = src.find()
    assert src.has_lesions and [r.split for r in refs] == ["train", "test"]
    case = src.load(refs[0])
    cols = {o: np.nonzero(case.mask == ORGAN_ID[o])[2] for o in ("kidney_left", "kidney_right")}
    assert cols["kidney_right"].max() < case.shape[2] / 2 < cols["kidney_left"].min()
    assert case.provenance["sided_split"]["stem"] == "kidney"
    assert case.provenance["orientation"]["axcodes"] == "SPL"
    assert case.lesion.any() and not (case.lesion.astype(bool) & (case.mask == 0)).any()
    q = process_case(case, CFG, 0)["level3_questions"]
    probes = set(q["q_probe"].tolist())
    assert COUNTING in probes and LEVEL3_PROBES.index("symmetry") in probes  # two kidneys: pair probes too


# --- splits and case choice -------------------------------------------------------------


def refs_of(n: int, source: str = "lits") -> list:
    from spar_bench.builder.case import CaseRef

    return [CaseRef(source, f"c{i:03d}", "test", {}) for i in range(n)]


def test_split_ratio_and_limit_are_seeded_patient_level_and_order_free():
    from spar_bench.builder.selection import choose_cases, split_by_ratio, split_counts

    assert split_counts(20, [0.7, 0.1, 0.2]) == [14, 2, 4] and split_counts(3, [1 / 3] * 3) == [1, 1, 1]
    refs = refs_of(40)
    a = split_by_ratio(choose_cases(refs, cases=None, limit=20, seed=7), [0.7, 0.1, 0.2], 7)
    b = split_by_ratio(choose_cases(refs[::-1], cases=None, limit=20, seed=7), [0.7, 0.1, 0.2], 7)
    assert [(r.case_id, r.split) for r in a] == [(r.case_id, r.split) for r in b]  # listing order free
    assert [sum(r.split == s for r in a) for s in ("train", "val", "test")] == [14, 2, 4]
    c = choose_cases(refs, cases=None, limit=20, seed=8)
    assert {r.case_id for r in c} != {r.case_id for r in a}  # the seed matters
    # patients stay together: two scans per patient never straddle a split
    from dataclasses import replace

    paired = [replace(r, patient_id=f"p{i // 2}") for i, r in enumerate(refs)]
    split = split_by_ratio(paired, [0.5, 0.25, 0.25], 1)
    by_patient = {}
    for r in split:
        by_patient.setdefault(r.patient_id, set()).add(r.split)
    assert all(len(s) == 1 for s in by_patient.values())


def test_cases_list_and_split_file_refuse_unknown_ids(tmp_path):
    from spar_bench.builder.selection import apply_split_file, choose_cases, read_split_file
    from spar_bench.errors import ConfigError

    refs = refs_of(5)
    assert [r.case_id for r in choose_cases(refs, cases=["c003", "c001"], limit=None, seed=0)] == ["c001", "c003"]
    with pytest.raises(ConfigError, match="did you mean 'c001'"):
        choose_cases(refs, cases=["c01"], limit=None, seed=0)
    csv = tmp_path / "splits.csv"
    csv.write_text("case_id,split\nc000,train\nc004,val\n")
    out, listed = apply_split_file(refs, read_split_file(csv), str(csv), set())
    assert [r.split for r in out] == ["train", "test", "test", "test", "val"] and len(listed) == 2
    csv.write_text("case_id,split\nc009,train\n")
    with pytest.raises(ConfigError, match="c009"):
        apply_split_file(refs, read_split_file(csv), str(csv), set())
    csv.write_text("case_id,split\nc000,training\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_split_file(csv)


def word_plus_lits_args(tmp_path):
    from lesion_folders import make_word_folder

    word = make_word_folder(tmp_path / "word")
    lits = make_lits_folder(tmp_path / "lits", 8)
    return ["--source", "word", "--root", str(word), "--source", "lits", "--root", str(lits),
            "--limit", "lits=6", "--split-ratio", "lits=0.5,0.17,0.33", "--levels", "level3",
            "--no-hf", "--seed", "2"]


def test_word_plus_lits_build_counting_in_train_and_test(tmp_path, capsys):
    """The paper's training build, small: WORD's official split + LiTS chosen and split by patient."""
    import json

    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    out = tmp_path / "out"
    assert run_cli(cli, [*word_plus_lits_args(tmp_path), "--out", str(out)]) == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    lits_cases = [c for c in m["cases"] if c["source"] == "lits"]
    assert len(lits_cases) == 6 and m["config"]["limit"] == {"lits": 6}
    assert {c["split"] for c in lits_cases} == {"train", "val", "test"}
    assert all(c["split_origin"].startswith("split-ratio 0.5,0.17,0.33 by patient") for c in lits_cases)
    assert all(c["split_origin"].startswith("official split") for c in m["cases"] if c["source"] == "word")
    counting = {s: c["classes"]["counting"] for s, c in m["counts"]["level3"].items()}
    assert sum(counting["train"]) > 0 and sum(counting["test"]) > 0
    assert m["sample_config"]["lesion_min_voxels"] == 3
    assert m["sources"]["lits"]["n_cases"] == 8 and m["sources"]["lits"]["n_chosen"] == 6
    assert "n_chosen" not in m["sources"]["word"]


@pytest.mark.slow
def test_word_plus_lits_choice_independent_of_workers(tmp_path):
    """Same seed: the same cases, splits and bytes with 1 or 2 workers."""
    import json

    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    args = word_plus_lits_args(tmp_path)
    assert run_cli(cli, [*args, "--out", str(tmp_path / "a")]) == 0
    assert run_cli(cli, [*args, "--out", str(tmp_path / "b"), "--jobs", "2"]) == 0
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert [(c["case_id"], c["split"]) for c in a["cases"]] == [(c["case_id"], c["split"]) for c in b["cases"]]
    assert a["fingerprint"] == b["fingerprint"]


def test_choice_options_refuse_bad_values():
    from spar_bench.builder.selection import parse_per_source, parse_ratio
    from spar_bench.errors import ConfigError

    assert parse_per_source(["lits=20", "5"], "--limit", ["word", "lits"]) == {"lits": "20", "*": "5"}
    with pytest.raises(ConfigError, match="'wrod' is not a --source"):
        parse_per_source(["wrod=3"], "--limit", ["word", "lits"])
    with pytest.raises(ConfigError, match="given twice"):
        parse_per_source(["lits=3", "lits=4"], "--limit", ["lits"])
    assert parse_ratio("70,10,20") == pytest.approx([0.7, 0.1, 0.2])
    for bad in ("1,2", "a,b,c", "-1,1,1", "0,0,0"):
        with pytest.raises(ConfigError, match="--split-ratio"):
            parse_ratio(bad)


def test_split_file_with_a_source_column_through_the_cli(tmp_path, capsys):
    import json

    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    lits = make_lits_folder(tmp_path / "lits", 3)
    csv = tmp_path / "splits.csv"
    csv.write_text("source,case_id,split\nlits,lits_0000,train\nlits,lits_0002,val\n")
    out = tmp_path / "out"
    args = ["--source", "lits", "--root", str(lits), "--levels", "level3", "--no-hf", "--split-file", str(csv),
            "--cases", "lits_0000,lits_0002", "--out", str(out)]
    assert run_cli(cli, args) == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    assert [(c["case_id"], c["split"], c["split_origin"]) for c in m["cases"]] == [
        ("lits_0000", "train", "split-file splits.csv"), ("lits_0002", "val", "split-file splits.csv")]
    csv.write_text("case_id,split\nlits_0009,train\n")
    assert run_cli(cli, [*args[:-1], str(tmp_path / "bad")]) == 2
    assert "lits_0009" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_kits_like_nnunet_build_counting_in_train_and_test(tmp_path, capsys):
    import json

    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    kits = make_kits_folder(tmp_path / "kits", 4)  # 3 Tr + 1 Ts
    out = tmp_path / "out"
    assert run_cli(cli, ["--source", "nnunet", "--root", str(kits), "--levels", "level3", "--no-hf",
                         "--out", str(out)]) == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    counting = {s: c["classes"]["counting"] for s, c in m["counts"]["level3"].items()}
    assert sum(counting["train"]) > 0 and sum(counting["test"]) > 0
    assert m["sources"]["nnunet"]["label_map"]["sided"] == {"1": "kidney", "2": "kidney"}  # tumour voxels: kidney too
    assert {c["split_origin"] for c in m["cases"]} == {"folders (Tr = train, Ts = test)"}


def test_build_help_lists_the_choice_options(capsys):
    from spar_bench.builder.cli import cli
    from spar_bench.clitools import run_cli

    assert run_cli(cli, ["--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--cases", "--limit", "--split-ratio", "--split-file", "--unknown-labels"):
        assert opt in out
