"""Hugging Face dataset folder ``OUT/hf/`` and ``spar-build push``.

One Parquet shard per HDF5 shard (same ``<split>-NNNNN-of-MMMMM`` name), written with
pyarrow directly (deterministic bytes: no timestamps; the ``datasets`` features travel
in the Arrow schema metadata). Images are the ``Image`` feature (PNG bytes) so the Hub
viewer shows them. Level 3 rows are slices, with the slice's questions as a
list-of-struct column ``questions``. ``README.md`` is the dataset card: YAML front
matter (``configs``, ``dataset_info``) and prose. No loading script.

Load offline with ``datasets.load_dataset("OUT/hf", "level3", split="test")``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import numpy as np

from spar_bench.errors import ConfigError, SparError
from spar_bench.procs import process_pool

from .. import __version__
from ..schema import IMAGE_FIELDS, LEVEL3_PROBES, LEVEL4_PROBES, LEVEL_SPECS, ORGANS, ordered_splits

#: What the card shows of each source record: where (as seen from the build, or null) and
#: the sha256 of its inputs; never an absolute path.
SOURCE_FIELDS = ("root", "inputs_sha256", "n_inputs", "n_cases")
ROW_GROUP = 256
#: Voxels of one volume field per Parquet row group of a Level 4 shard (16 MiB of uint8).
ROW_GROUP_VOXELS = 2**24
#: Source licences as (SPDX-like Hub id, human name).
LICENCES: dict[str, tuple[str, str]] = {
    "word": ("gpl-3.0", "GPL-3.0 (WORD)"),
    "totalsegmentator": ("cc-by-4.0", "CC BY 4.0 (TotalSegmentator)"),
    "totalsegmentator-predicted": ("other", "that of the CT used; labels predicted by TotalSegmentator (Apache-2.0)"),
    "lits": ("cc-by-nc-sa-4.0", "CC BY-NC-SA 4.0 (LiTS)"),
    "phantom": ("apache-2.0", "Apache-2.0 (SPAR-Bench synthetic phantom)"),
    "nnunet": ("other", "that of the nnU-Net-format dataset used (see its own licence)"),
}

DESCRIPTIONS = {
    "key": "unique sample key `<source>/<case_id>/<level>/<index>` (+ `/mirror` for a mirrored copy)",
    "source": "source dataset", "case_id": "case within its source",
    "patient_id": "patient (bootstrap confidence intervals resample patients)",
    "split": "train / val / test (by patient)",
    "sample_index": "index of the sample within its case",
    "seed": "the sample's seed (spar_bench.seeding.derive_seed); regenerates the sample alone",
    "image": "224x224 uint8 windowed CT: a 4x4 mosaic of 56x56 organ tiles (Levels 1-2) or an axial slice (Level 3)",
    "present": "per canonical organ (16, class order): visible in the sample",
    "centroid": "per organ (16 x (x, y)) normalised centroid in its slice's 224 frame; x = column/224 "
                "(0 = patient's RIGHT), y = row/224 (0 = anterior); NaN if absent",
    "slice_index": "z of the slice (per tile for Levels 1-2, -1 if absent)",
    "mm_per_pixel": "millimetres per pixel of the 224 frame",
    "is_mirror": "left-right mirrored counterfactual copy",
    "origin_key": "key of the original of a mirrored copy, empty otherwise",
    "perm": "Level 2: perm[p] = organ index shown at mosaic position p",
    "target_slot": "Level 2: slot of the tile at position p in the centroid-based arrangement; -1 if absent",
    "present_pos": "Level 2: presence per mosaic position (= present[perm])",
    "label": "Level 3: canonical organ ids (0 background, 1..16) in the slice's 224 frame (PNG)",
    "lesion": "Level 3: lesion mask 0/1 (all zero when the source has none)",
    "questions": "Level 3: the slice's questions (probe index into "
                 + ", ".join(LEVEL3_PROBES) + "; answer = class index)",
}
#: Level 4 (volume) columns whose meaning differs from the 2-D levels', or that only it has.
VOLUME_DESCRIPTIONS = {
    "key": "unique volume key `<source>/<case_id>/level4/0` (+ `/mirror` or `/flip` for a counterfactual copy)",
    "seed": "the volume's seed (spar_bench.seeding.derive_seed); copies share the original's",
    "image": "(S, S, S) uint8 windowed CT cube [z, row, col] (z inferior->superior, row 0 anterior, "
             "col 0 = patient's right), isotropic, around all labelled organs",
    "label": "(S, S, S) uint8 canonical organ ids (0 background, 1..16), nearest neighbour",
    "lesion": "(S, S, S) uint8 lesion mask 0/1 (all zero when the case has no lesion channel)",
    "has_lesion": "the case has a lesion channel (else `lesion` is all zero by absence, not by finding)",
    "mm_per_voxel": "isotropic voxel side in mm",
    "origin_mm": "(z, row, col) mm position of voxel (0, 0, 0)'s centre in the case's canonical frame",
    "present": "per canonical organ (16, class order): at least one voxel in `label`",
    "centroid": "per organ (16 x (x, y, z)) normalised voxel centroid: x = (col + 0.5)/S (0 = patient's "
                "RIGHT), y = (row + 0.5)/S (0 = anterior), z = (z + 0.5)/S (0 = inferior); NaN if absent",
    "volume_mm3": "per organ (16) volume in `label` in mm^3 (0 if absent)",
    "is_mirror": "left-right mirrored counterfactual copy (col reversed, labels recomputed)",
    "is_flipped": "superior-inferior flipped counterfactual copy (z reversed, labels recomputed)",
    "origin_key": "key of the original volume (its own key for an original)",
    "questions": "Level 4: the volume's questions (probe index into "
                 + ", ".join(LEVEL4_PROBES) + "; answer = class index)",
}


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    # 2-D uint8 -> mode "L". compress_level 3: half the time of 6 for ~10% more bytes.
    Image.fromarray(np.ascontiguousarray(arr, dtype=np.uint8)).save(buf, format="PNG", compress_level=3)
    return buf.getvalue()


def _value(dtype: np.dtype):
    from datasets import Value

    dtype = np.dtype(dtype)
    if dtype.kind in ("S", "U", "O"):
        return Value("string")
    return Value("bool" if dtype.kind == "b" else str(dtype))


def _feature(name: str, arr: np.ndarray):
    from datasets import Array3D, Image, List

    if name in IMAGE_FIELDS and arr.ndim == 3:
        return Image()
    if name in IMAGE_FIELDS and arr.ndim == 4:  # Level 4 volumes: one (S, S, S) array a row
        return Array3D(shape=tuple(int(n) for n in arr.shape[1:]), dtype=str(arr.dtype))
    feat = _value(arr.dtype)
    for n in reversed(arr.shape[1:]):
        feat = List(feat, length=int(n))
    return feat


def _volumes(arr: np.ndarray, arrow_type):
    """(N, S, S, S) volumes as the Arrow array of their ``Array3D`` feature, built from the
    flat buffer (no Python lists: a 128^3 volume is 2M values)."""
    import pyarrow as pa

    values = pa.array(np.ascontiguousarray(arr).reshape(-1))
    for n in reversed(arr.shape[1:]):  # innermost axis first: lists of n items
        offsets = np.arange(0, len(values) + 1, n, dtype=np.int32)
        values = pa.ListArray.from_arrays(pa.array(offsets), values)
    return pa.ExtensionArray.from_storage(arrow_type, values.cast(arrow_type.storage_type))


def _column(name: str, arr: np.ndarray) -> list:
    if name in IMAGE_FIELDS and arr.ndim == 3:
        return [{"bytes": _png(a), "path": None} for a in arr]
    if arr.dtype.kind == "S":
        return [b.decode("utf-8") for b in arr.tolist()]
    return arr.tolist()


def _read_h5(path: Path) -> dict[str, np.ndarray]:
    from ..shards import open_shard

    with open_shard(path) as f:
        return {k: f[k][()] for k in sorted(f.keys())}


def shard_table(level: str, data: Mapping[str, np.ndarray]):
    """(pyarrow Table, datasets Features) for one shard's arrays."""
    import pyarrow as pa
    from datasets import Features, List

    spec = LEVEL_SPECS[level]
    row_fields = [k for k in data if not k.startswith("q_")]
    feats = {k: _feature(k, data[k]) for k in row_fields}
    volumes = [k for k in row_fields if k in IMAGE_FIELDS and data[k].ndim == 4]
    cols = {k: _column(k, data[k]) for k in row_fields if k not in volumes}
    if spec.questions:  # q_* fields: a list of questions per row
        qf = [k for k in data if k.startswith("q_") and k != spec.row_field]
        feats["questions"] = List({k[2:]: _feature(k, data[k]) for k in qf})
        n = len(data["key"])
        per: list[list[dict]] = [[] for _ in range(n)]
        qcols = {k: _column(k, data[k]) for k in qf}
        for j, s in enumerate(data[spec.row_field].tolist()):
            per[s].append({k[2:]: qcols[k][j] for k in qf})
        cols["questions"] = per
    features = Features(feats)
    schema = features.arrow_schema
    cols.update({k: _volumes(data[k], schema.field(k).type) for k in volumes})
    table = pa.Table.from_pydict({k: cols[k] for k in feats}, schema=schema)
    return table, features


def _row_group(data: Mapping[str, np.ndarray]) -> int:
    """Rows per Parquet row group: :data:`ROW_GROUP`, or for volumes as many as hold
    :data:`ROW_GROUP_VOXELS` voxels of one field (8 volumes of 128^3, 64 of 64^3): a reader
    decodes a whole row group at a time."""
    image = data.get("image")
    if image is None or image.ndim != 4:
        return ROW_GROUP
    return max(1, min(ROW_GROUP, ROW_GROUP_VOXELS // int(np.prod(image.shape[1:]))))


def convert_shard(job: tuple[str, str, str]) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Worker: one HDF5 shard -> one Parquet shard.

    Returns (manifest entry, features dict, Arrow bytes of the table: the ``num_bytes``
    a dataset card declares per split).
    """
    import pyarrow.parquet as pq

    from .manifest import sha256_file

    out_dir, level, h5_rel = Path(job[0]), job[1], job[2]
    data = _read_h5(out_dir / h5_rel)
    table, features = shard_table(level, data)
    rel = Path(h5_rel).with_suffix(".parquet").as_posix()
    dest = out_dir / "hf" / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, dest, row_group_size=_row_group(data), compression="zstd", write_statistics=False)
    entry = {"path": f"hf/{rel}", "sha256": sha256_file(dest), "rows": table.num_rows}
    return entry, features.to_dict(), int(table.nbytes)


def write_hf(
    out_dir: str | Path,
    shards: Mapping[str, Mapping[str, list[dict]]],
    *,
    config: Any,
    sample_config: Mapping[str, Any],
    sources: Mapping[str, Any],
    workers: int = 1,
) -> dict[str, Any]:
    """Write ``out_dir/hf`` from the build's HDF5 shards; return the manifest's ``hf`` record.

    Shards are converted in ``workers`` processes (PNG encoding dominates); the bytes do
    not depend on the worker count.
    """
    from datasets import Features
    from tqdm.auto import tqdm

    from .manifest import sha256_file

    out_dir = Path(out_dir)
    hf = out_dir / "hf"
    # an empty shard has no Parquet file (datasets cannot read a 0-row one): a level or split
    # without rows (Level 1-2 of a build of liver-only cases) has no config or split in the card
    jobs = [(str(out_dir), level, e["path"]) for level, by_split in shards.items()
            for entries in by_split.values() for e in entries if e["rows"]]
    if workers > 1 and len(jobs) > 1:
        with process_pool(workers) as pool:  # workers terminated if we are interrupted
            results = list(tqdm(pool.map(convert_shard, jobs), total=len(jobs), desc="parquet",
                                unit="shard", leave=False))
    else:
        results = [convert_shard(j) for j in tqdm(jobs, desc="parquet", unit="shard", leave=False)]
    files = [entry for entry, _, _ in results]
    features_by_level: dict[str, Any] = {}
    sizes: dict[str, dict[str, dict[str, int]]] = {}
    for (_, level, h5_rel), (entry, feats, nbytes) in zip(jobs, results, strict=True):
        features_by_level.setdefault(level, Features.from_dict(feats))
        split = next(sp for sp, entries in shards[level].items() if any(e["path"] == h5_rel for e in entries))
        size = sizes.setdefault(level, {}).setdefault(split, {"num_examples": 0, "num_bytes": 0, "files": 0})
        size["num_examples"] += entry["rows"]
        size["num_bytes"] += nbytes
        size["files"] += (out_dir / entry["path"]).stat().st_size
    card = hf / "README.md"
    hf.mkdir(parents=True, exist_ok=True)
    card.write_text(dataset_card(features_by_level, sizes, config=config,
                                 sample_config=sample_config, sources=sources), encoding="utf-8")
    return {"files": files, "card": {"path": "hf/README.md", "sha256": sha256_file(card)}}


def dataset_card(features_by_level, split_sizes, *, config, sample_config, sources) -> str:
    """README.md with YAML front matter (configs, dataset_info) and a prose description.

    ``split_sizes[level][split]`` holds ``num_examples``, ``num_bytes`` (Arrow bytes) and
    ``files`` (Parquet bytes): the ``splits``, ``dataset_size`` and ``download_size`` of
    ``dataset_info``, which ``datasets`` then reads without a warning. ``sources`` are the
    manifest's source records (name -> record); ``config`` a
    :class:`~spar_bench.builder.build.BuildConfig`. No absolute local path is written.
    """
    import yaml

    names = list(sources)
    front = _card_front_matter(features_by_level, split_sizes, names)
    lines = ["---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).rstrip(), "---", ""]
    lines += _card_intro(volumes=any(LEVEL_SPECS[level].volume for level in features_by_level))
    lines += _card_columns(features_by_level)
    lines += _card_volume_columns(features_by_level)
    lines += _card_licences(names)
    lines += _card_provenance(config, sample_config, sources)
    return "\n".join(lines)


def _card_front_matter(features_by_level, split_sizes, names: list[str]) -> dict[str, Any]:
    """The card's YAML front matter: licence, tags, one config per level, ``dataset_info``."""
    from spar_bench.compat import features_yaml_list

    lic_ids = sorted({LICENCES.get(s, ("other", s))[0] for s in names})
    return {
        "license": lic_ids[0] if len(lic_ids) == 1 else "other",
        "task_categories": ["image-classification"],
        "tags": ["medical", "ct", "spatial-reasoning", "probing", "spar-bench"],
        "pretty_name": "SPAR-Bench",
        "configs": [
            {"config_name": level,
             "data_files": [{"split": s, "path": f"{level}/{s}-*.parquet"}
                            for s in _ordered(split_sizes[level])]}
            for level in features_by_level
        ],
        "dataset_info": [_dataset_info(level, feats, split_sizes[level], features_yaml_list)
                         for level, feats in features_by_level.items()],
    }


def _card_intro(volumes: bool = False) -> list[str]:
    """Title, what the configs are (``volumes``: the build has Level 4), and the canonical
    frame (patient's left/right)."""
    level4 = ["Level 4 (`level4` config, opt-in) holds whole CT volumes with volumetric questions; "
              "see its section below.", ""] if volumes else []
    return [
        "# SPAR-Bench",
        "",
        "Spatial anatomical reasoning probes for vision encoders, built from abdominal CT "
        "with the SPAR-Bench builder. Three configs: `level1` (organ localisation from a 4x4 "
        "mosaic of organ tiles), `level2` (shuffled tiles; recover the centroid-based "
        "arrangement), `level3` (whole axial slices with six kinds of spatial questions: "
        + ", ".join(LEVEL3_PROBES) + ").",
        "",
        *level4,
        "## Canonical frame and left/right",
        "",
        "Every image is an axial slice (or tiles of slices) in the radiological display "
        "convention: image row 0 is ANTERIOR, image column 0 is the PATIENT'S RIGHT; the "
        "patient's left is at larger columns. Every left/right in a label or question is the "
        "PATIENT's. Organs in class order: " + ", ".join(f"{i} {o}" for i, o in enumerate(ORGANS)) + ".",
        "",
    ]


def _card_columns(features_by_level) -> list[str]:
    """One line per column (first seen across levels), then the Level 3 question fields."""
    if all(LEVEL_SPECS[level].volume for level in features_by_level):
        return []  # a Level 4-only build: its section says it all
    lines = ["## Columns", ""]
    seen = set()
    for level, feats in features_by_level.items():
        if LEVEL_SPECS[level].volume:  # its own section (:func:`_card_volume_columns`)
            continue
        for k in feats:
            if k not in seen:
                seen.add(k)
                lines.append(f"- `{k}`: {DESCRIPTIONS.get(k, 'see docs/FORMATS.md')}")
    return lines + [
        "",
        "Level 3 question fields (inside `questions`): `key`, `probe` (index into "
        f"{list(LEVEL3_PROBES)}), `axis` (relative position: 0 left/right, 1 "
        "anterior/posterior), `organ_a`/`organ_b` (organ indices), `answer` (class index), "
        "`centroid_a`/`centroid_b` (pixels), `area_a_mm2`/`area_b_mm2`, `distance_mm`, "
        "`count` (lesion components), `seed`.",
        "",
    ]


def _card_volume_columns(features_by_level) -> list[str]:
    """The ``level4`` config's section, when the build has it: what a row is, every column,
    its question fields. Nothing for a build without volumes (its card keeps its bytes)."""
    lines: list[str] = []
    for level, feats in features_by_level.items():
        if not LEVEL_SPECS[level].volume:
            continue
        lines += [f"## Level 4 (`{level}` config): one row per CT volume", "",
                  "Volume fields are `Array3D` features (with `.with_format(\"numpy\")` each is an "
                  "(S, S, S) array, indexed [z, row, col]).", ""]
        lines += [f"- `{k}`: {VOLUME_DESCRIPTIONS.get(k) or DESCRIPTIONS.get(k, 'see docs/FORMATS.md')}"
                  for k in feats]
        lines += ["", "Level 4 question fields (inside `questions`): `key`, `probe` (index into "
                  f"{list(LEVEL4_PROBES)}), `axis` (relative position: 0 left/right, 1 anterior/posterior, "
                  "2 superior/inferior; -1 otherwise), `organ_a`/`organ_b`/`organ_c` (organ indices, -1 none), "
                  "`answer` (class index), `measure_a`/`measure_b` (what the answer was computed from: mm, "
                  "mm^3 or counts; NaN unused), `seed`.", ""]
    return lines


def _card_licences(names: list[str]) -> list[str]:
    """The licence of every source used, and the note that derived data inherit them."""
    lines = ["## Licences of the sources used", ""]
    lines += [f"- {s}: {LICENCES.get(s, ('other', 'unknown: check the source'))[1]}" for s in names]
    return lines + ["", "The derived data inherit the licence terms of their sources.", ""]


def _card_provenance(config, sample_config, sources) -> list[str]:
    """Builder version, seed and the published build config, sample config and sources (JSON)."""

    return [
        "## How it was built",
        "",
        f"SPAR-Bench builder version {__version__}; global seed {config.seed}. "
        "The same command and inputs reproduce these files byte for byte.",
        "",
        "```json",
        json.dumps({"config": config.published(), "sample_config": dict(sample_config),
                    "sources": {n: {k: v for k, v in dict(rec).items() if k in SOURCE_FIELDS}
                                for n, rec in sources.items()}},
                   indent=2, sort_keys=True),
        "```",
        "",
    ]


def _dataset_info(level: str, features, sizes: Mapping[str, Mapping[str, int]], to_yaml) -> dict[str, Any]:
    """One config's ``dataset_info`` entry, in the form ``datasets.DatasetInfo`` reads."""
    splits = [{"name": s, "num_bytes": int(sizes[s]["num_bytes"]),
               "num_examples": int(sizes[s]["num_examples"])} for s in _ordered(sizes)]
    return {"config_name": level, "features": to_yaml(features), "splits": splits,
            "download_size": int(sum(v["files"] for v in sizes.values())),
            "dataset_size": int(sum(v["num_bytes"] for v in sizes.values()))}


def _ordered(splits) -> list[str]:
    return ordered_splits(splits)


def _check_repo_id(repo: str) -> None:
    """``--repo`` is a Hub repo id ``ORG/NAME`` (the hub's own rule), else one line."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if repo.count("/") != 1:
        raise ConfigError(f"--repo {repo!r}: expected ORG/NAME")
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ConfigError(f"--repo {repo!r}: not a Hub repo id ({str(e).splitlines()[0]})") from None


@click.command("push")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--repo", required=True, help="Hub dataset repo ORG/NAME.")
@click.option("--private", is_flag=True, help="Create the repo private.")
@click.option("--revision", default=None, help="Branch to upload to (created if missing).")
def push_command(out: Path, repo: str, private: bool, revision: str | None) -> None:
    """Upload OUT/hf (Parquet shards + dataset card) to the Hugging Face Hub."""
    from huggingface_hub import HfApi

    from ..shards import Build

    _check_repo_id(repo)
    build = Build(out)
    folder = out / "hf"
    if not (folder / "README.md").is_file():
        raise ConfigError(f"{folder}: no Hugging Face folder; rebuild without --no-hf")
    api = HfApi()
    try:
        api.create_repo(repo_id=repo, repo_type="dataset", private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id=repo, branch=revision, repo_type="dataset", exist_ok=True)
        api.upload_folder(
            folder_path=str(folder), repo_id=repo, repo_type="dataset", revision=revision,
            commit_message=f"SPAR-Bench build {build.fingerprint[:12]}",
        )
    except Exception as e:  # offline, no login, no write access, a refused name: the hub's many types
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise SparError(f"push of {folder} to the Hub dataset {repo} failed ({type(e).__name__}: {first}); check "
                        "the network (HF_HUB_OFFLINE unset), the login (`hf auth login` or HF_TOKEN) and your "
                        f"write access to {repo}") from None  # fmt: skip
    click.echo(f"pushed {folder} to https://huggingface.co/datasets/{repo}"
               + (f" (revision {revision})" if revision else ""))
