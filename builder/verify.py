"""``spar-build verify OUT``: check a build against its manifest.

Re-hashes every HDF5 shard, every Parquet file and the dataset card, re-counts rows
(samples, slices, volumes) and questions per level and split from the files themselves, recomputes
the fingerprint and the sha256 of every other field of the manifest (``field_sha256``: a hand-edited
``config`` or ``thresholds`` is named), and flags every file in the build that the manifest does not list.
Prints ``OK`` or every difference, and exits non-zero on any.
"""

from __future__ import annotations

from pathlib import Path

import click

from spar_bench.errors import IntegrityError, SparError
from spar_bench.outputs import files_under

from .schema import LEVEL_SPECS
from .writers.manifest import (
    MANIFEST_NAME,
    listed_files,
    manifest_problems,
    read_manifest,
    sha256_file,
)


def _h5_counts(path: Path, level: str) -> tuple[int, int]:
    """(rows, questions) of one shard: questions counted by the level's row field
    (``q_slice``, ``q_volume``: ``LevelSpec.row_field``)."""
    from .shards import open_shard
    from .writers.hdf5 import row_field

    pointer = row_field(level)
    with open_shard(path) as f:
        return len(f["key"]), (len(f[pointer]) if pointer in f else 0)


def _unit_count(level: str, counts: dict) -> int | None:
    """The rows a manifest's ``counts[level][split]`` announces (samples, slices, volumes)."""
    spec = LEVEL_SPECS.get(level)
    units = (spec.unit,) if spec is not None else ("samples", "slices", "volumes")
    return next((counts[u] for u in units if u in counts), None)


def _unlisted(out: Path, manifest: dict) -> list[str]:
    """Files under ``out`` that the manifest does not list (a stray Parquet or HDF5 file)."""

    return sorted(files_under(out) - listed_files(manifest))


def _check_file(out: Path, entry: dict, problems: list[str]) -> Path | None:
    """The path of a listed file if it is there (its sha256 compared with ``entry``), else None."""
    p = out / entry["path"]
    if not p.is_file():
        problems.append(f"{entry['path']}: missing")
        return None
    got = sha256_file(p)
    if got != entry["sha256"]:
        problems.append(f"{entry['path']}: sha256 {got[:16]}... != manifest {entry['sha256'][:16]}...")
    return p


def _check_shards(out: Path, m: dict, problems: list[str]) -> None:
    """Every HDF5 shard: present, its sha256, its rows and questions; each split's total
    against ``counts``."""
    for level, by_split in m["shards"].items():
        for split, entries in by_split.items():
            rows = qs = 0
            for e in entries:
                p = _check_file(out, e, problems)
                if p is None:
                    continue
                try:
                    n, nq = _h5_counts(p, level)
                except (OSError, KeyError, SparError) as err:
                    problems.append(f"{e['path']}: unreadable HDF5 ({err})")
                    continue
                if n != e["rows"] or nq != e.get("questions", 0):
                    problems.append(f"{e['path']}: {n} rows / {nq} questions, manifest says "
                                    f"{e['rows']} / {e.get('questions', 0)}")
                rows, qs = rows + n, qs + nq
            c = m.get("counts", {}).get(level, {}).get(split)
            if c is not None:
                want = _unit_count(level, c)
                if want != rows or c.get("questions", 0) != qs:
                    problems.append(f"{level}/{split}: {rows} rows / {qs} questions in the shards, "
                                    f"counts say {want} / {c.get('questions', 0)}")


def _check_hf(out: Path, hf: dict, problems: list[str]) -> None:
    """Every Parquet file (present, sha256, rows) and the dataset card of ``manifest["hf"]``."""
    import pyarrow.parquet as pq

    for e in hf.get("files", []):
        p = _check_file(out, e, problems)
        if p is not None:
            try:
                n = pq.ParquetFile(p).metadata.num_rows
            except Exception as err:  # pyarrow raises several types for corrupt files
                problems.append(f"{e['path']}: unreadable Parquet ({err})")
                continue
            if n != e["rows"]:
                problems.append(f"{e['path']}: {n} rows, manifest says {e['rows']}")
    if hf.get("card"):
        _check_file(out, hf["card"], problems)


def verify_build(out: str | Path) -> list[str]:
    """Every difference between ``out`` and its manifest (empty list = intact): the files, and
    the manifest against itself (fingerprint, ``field_sha256``: :func:`manifest_problems`)."""
    out = Path(out)
    m = read_manifest(out)
    problems: list[str] = []
    _check_shards(out, m, problems)
    if m.get("hf"):
        _check_hf(out, m["hf"], problems)
    problems += [f"{path}: not listed in manifest.json (a stray file: readers that glob the "
                 "folder would load it; remove it)" for path in _unlisted(out, m)]
    return problems + [f"{MANIFEST_NAME}: {line}" for line in manifest_problems(m)]


@click.command("verify")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def verify_command(out: Path) -> None:
    """Re-hash and re-count every file of build OUT against its manifest."""
    problems = verify_build(out)
    if problems:
        for p in problems:
            click.echo(f"DIFF {p}")
        raise IntegrityError(f"{out}: {len(problems)} difference(s) from manifest.json")
    m = read_manifest(out)
    click.echo(f"OK {out} fingerprint {m['fingerprint']}")
