"""Partitioned builds: ``spar-build ... --partition i/N`` on N machines, then ``spar-build merge``.

A build has two phases. Phase 1 turns each case into its samples and raw measurements
(the per-case spill files); phase 2 fits the size/distance thresholds on the training
split's original questions *over all cases*, then writes shards, the Hugging Face folder
and the manifest. A partition runs phase 1 for its share of the cases; ``merge``
(:mod:`.merge`) runs phase 2 once over all of them, with the code of a one-machine build,
so the result is byte-identical to ``spar-build`` without ``--partition`` (same options,
same seed). This module is the partition folder: which cases, its record, reading and
gathering partitions; the build (:mod:`.build`) uses it, and it uses no build code.

* Case ``(source, case_id)`` belongs to partition ``sha256("source/case_id") mod N``: stable
  under any reordering of the files and independent of the machine.
* Case choice and splits (``--cases``, ``--limit``, ``--split-ratio``, ``--split-file``) are
  decided before partitioning, on the full list of cases every partition sees, so each
  partition records the same selection and merge checks that they agree.
* A partition folder holds ``partition.json`` (format ``spar-bench-partition``: config,
  ``i/N``, the whole selection, this partition's case records, sha256 of every spill file)
  and ``cases/``. It is written through ``OUT.tmp`` like a build, so ``--resume`` works per
  partition and an interrupted one never looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError, IntegrityError
from spar_bench.hashing import sha256_file
from spar_bench.outputs import claim, remove
from spar_bench.partitions import bucket

PARTITION_FORMAT = "spar-bench-partition"
PARTITION_FILE = "partition.json"


def partition_of(source: str, case_id: str, n: int) -> int:
    """The partition of one case: sha256 of ``source/case_id`` modulo ``n``."""
    return bucket(f"{source}/{case_id}", n)


def owned_partition(out: Path) -> set[str] | None:
    """The files of the partition folder at ``out``, or None if it is not one."""
    try:
        record = json.loads((Path(out) / PARTITION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != PARTITION_FORMAT:
        return None
    return {PARTITION_FILE} | {f"cases/{name}" for name in record.get("files", {})}


def finish_partition(recorded: dict[str, Any], partition: tuple[int, int], selection: list[list[str]],
                     records: list[dict], sources: dict[str, Any], origins: dict, work: Path,
                     out: Path) -> Path:
    """Phase 1 is done: move the spills and ``partition.json`` into ``out``; return it."""

    folder = work / "out"
    folder.mkdir()
    os.replace(work / "cases", folder / "cases")
    files = {p.name: sha256_file(p) for p in sorted((folder / "cases").iterdir())}
    record = {
        "format": PARTITION_FORMAT, "partition": list(partition), "config": recorded,
        "selection": selection, "records": records, "sources": sources,
        "origins": [[s, c, o] for (s, c), o in sorted(origins.items())], "files": files,
    }
    (folder / PARTITION_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n",
                                         encoding="utf-8")
    if out.exists():
        claim(out, overwrite=True, owned=owned_partition, what="partition folder")
        remove(out)
    os.replace(folder, out)
    shutil.rmtree(work)
    return out


def read_partitions(parts: list[Path]) -> list[dict[str, Any]]:
    """Read and cross-check every ``partition.json``: one config, one selection, all of 0..N-1."""
    records = []
    for p in parts:
        try:
            rec = json.loads((p / PARTITION_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise ConfigError(f"{p}: no readable {PARTITION_FILE}; is it a finished "
                              "`spar-build --partition I/N` folder?") from None
        if rec.get("format") != PARTITION_FORMAT:
            raise ConfigError(f"{p / PARTITION_FILE}: not a SPAR-Bench partition")
        records.append(rec)
    first = records[0]
    n = first["partition"][1]
    for p, rec in zip(parts, records, strict=True):
        for key in ("config", "selection", "sources"):
            if rec[key] != first[key]:
                raise ConfigError(f"{p}: its {key} differs from {parts[0]}'s; partitions of one "
                                  "build need the same options, data and seed")
        if rec["partition"][1] != n:
            raise ConfigError(f"{p}: partition {rec['partition'][0]}/{rec['partition'][1]} is not of N={n}")
    have = sorted(rec["partition"][0] for rec in records)
    if have != list(range(n)):
        missing = sorted(set(range(n)) - set(have))
        raise ConfigError(f"merge needs partitions 0..{n - 1} exactly once; got {have}"
                          + (f" (missing {missing})" if missing else " (repeated)"))
    return records


def gather_cases(parts: list[Path], records: list[dict[str, Any]], cases_dir: Path) -> None:
    """Link (or copy) every partition's spill files into one ``cases_dir``, checking sha256."""
    cases_dir.mkdir(parents=True, exist_ok=True)
    for part, rec in zip(parts, records, strict=True):
        for name, sha in rec["files"].items():
            src, dst = part / "cases" / name, cases_dir / name
            if dst.exists():
                raise IntegrityError(f"{src}: case file also in another partition")
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            if sha256_file(dst) != sha:
                raise IntegrityError(f"{src}: sha256 differs from {part / PARTITION_FILE}; "
                                     "rebuild that partition with --overwrite")
