"""Which cases a build takes and which split each one goes to, for any source.

Options (``spar-build``; each per-source option is ``SOURCE=VALUE``, or ``VALUE`` for every
source of the build):

* ``--cases [SOURCE=]ID,ID,...`` keeps only these case ids (unknown ids are refused);
* ``--limit [SOURCE=]N`` keeps N cases chosen by a seeded, patient-level draw;
* ``--split-ratio [SOURCE=]TRAIN,VAL,TEST`` re-splits a source by patient (seeded);
* ``--split-file CSV`` gives the split of listed cases (columns ``case_id,split``, and
  optionally ``source``).

Every draw ranks patients by ``derive_seed(seed, source, purpose, patient_id)`` (SHA-256),
so the same seed gives the same choice whatever the file listing order and worker count,
and cases of one patient always stay together. Each case records how it got its split
(:attr:`Choice.origins`), written to the build manifest as ``split_origin``.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path

from spar_bench.errors import ConfigError
from spar_bench.seeding import derive_seed

from .case import CaseRef
from .schema import SPLITS

#: Key of a per-source option value that applies to every source.
ALL = "*"


def parse_per_source(values: Sequence[str], option: str, sources: Sequence[str]) -> dict[str, str]:
    """``["lits=20", "5"]`` -> ``{"lits": "20", "*": "5"}``; refuses unknown sources and repeats."""
    out: dict[str, str] = {}
    for text in values:
        name, sep, value = text.partition("=")
        key, value = (name.strip(), value.strip()) if sep else (ALL, text.strip())
        if key != ALL and key not in sources:
            raise ConfigError(f"{option} {text}: {key!r} is not a --source of this build ({', '.join(sources)})")
        if key in out:
            raise ConfigError(f"{option} given twice for {'every source' if key == ALL else key}")
        out[key] = value
    return out


def parse_ratio(text: str) -> list[float]:
    """``"0.7,0.1,0.2"`` (or ``"70,10,20"``) -> fractions summing to 1."""
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split-ratio {text!r}: give three non-negative numbers TRAIN,VAL,TEST (e.g. 0.7,0.1,0.2)")
    total = sum(parts)
    return [p / total for p in parts]


def for_source(options: Mapping[str, object], source: str):
    """The value of a per-source option for ``source`` (its own, else the every-source one)."""
    return options.get(source, options.get(ALL))


def _patients(refs: Sequence[CaseRef]) -> list[str]:
    return sorted({r.patient for r in refs})


def _ranked(refs: Sequence[CaseRef], seed: int, purpose: str) -> list[str]:
    """Patients in a seeded order that depends only on (seed, source, purpose, patient id)."""
    return sorted(_patients(refs), key=lambda p: (derive_seed(seed, refs[0].source, purpose, p), p))


def split_counts(n: int, ratio: Sequence[float]) -> list[int]:
    """Patients per split: largest remainder of ``ratio * n`` (ties: train, val, test)."""
    exact = [r * n for r in ratio]
    counts = [int(x) for x in exact]
    order = sorted(range(3), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choose_cases(refs: list[CaseRef], *, cases: Sequence[str] | None, limit: int | None, seed: int) -> list[CaseRef]:
    """Keep the ``cases`` listed, then ``limit`` cases by a seeded patient-level draw."""
    if cases is not None:
        if not cases:
            raise ConfigError(f"--cases: the selection of source {refs[0].source} is empty (no case id given); "
                              "list ids (--cases ID,ID) or leave --cases out to take every case")  # fmt: skip
        known = [r.case_id for r in refs]
        missing = [c for c in cases if c not in set(known)]
        if missing:
            raise ConfigError(f"--cases: source {refs[0].source} has no case {missing[0]!r}"
                              f"{_did_you_mean(missing[0], known)}; {len(known)} cases found")
        refs = [r for r in refs if r.case_id in set(cases)]
    if limit is not None and limit < len(refs):
        rank = {p: i for i, p in enumerate(_ranked(refs, seed, "limit"))}
        keep = sorted(refs, key=lambda r: (rank[r.patient], r.case_id))[:limit]
        refs = sorted(keep, key=lambda r: r.case_id)
    return refs


def split_by_ratio(refs: list[CaseRef], ratio: Sequence[float], seed: int) -> list[CaseRef]:
    """Assign train/val/test by patient in the seeded order, ``ratio`` of the patients each."""
    ranked = _ranked(refs, seed, "split")
    counts = split_counts(len(ranked), ratio)
    split_of: dict[str, str] = {}
    i = 0
    for split, n in zip(("train", "val", "test"), counts, strict=True):
        for p in ranked[i : i + n]:
            split_of[p] = split
        i += n
    return [dataclasses.replace(r, split=split_of[r.patient]) for r in refs]


def read_split_file(path: str | Path) -> dict[tuple[str | None, str], str]:
    """``{(source or None, case_id): split}`` from a CSV with columns case_id,split[,source]."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--split-file {path}: no such file")
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        fields = [f.strip() for f in reader.fieldnames or []]
        if "case_id" not in fields or "split" not in fields:
            raise ConfigError(f"{path}: needs a header with columns case_id,split (and optionally source); "
                              f"found {fields or 'none'}")
        out: dict[tuple[str | None, str], str] = {}
        for line, row in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
            key = (row.get("source") or None, row["case_id"])
            if row["split"] not in SPLITS:
                raise ConfigError(f"{path} line {line}: split {row['split']!r} for {row['case_id']!r}; "
                                  f"expected one of {', '.join(SPLITS)}")
            if key in out:
                raise ConfigError(f"{path} line {line}: case {row['case_id']!r} listed twice")
            out[key] = row["split"]
    return out


def apply_split_file(refs: list[CaseRef], table: Mapping[tuple[str | None, str], str], path: str,
                     ratio_sources: set[str]) -> tuple[list[CaseRef], set[tuple[str, str]]]:
    """Set the split of every listed case; refuse rows naming no case of the build."""
    by_id: dict[str, list[CaseRef]] = {}
    for r in refs:
        by_id.setdefault(r.case_id, []).append(r)
    listed: set[tuple[str, str]] = set()
    for (source, cid), _split in table.items():
        hits = [r for r in by_id.get(cid, []) if source in (None, r.source)]
        if not hits:
            raise ConfigError(f"{path}: case {cid!r} is not in this build{_did_you_mean(cid, sorted(by_id))}")
        if len(hits) > 1:
            raise ConfigError(f"{path}: case id {cid!r} exists in several sources; add a source column")
        if hits[0].source in ratio_sources:
            raise ConfigError(f"{path}: case {cid!r} of source {hits[0].source} also has --split-ratio; pick one")
        listed.add((hits[0].source, cid))
    out = []
    for r in refs:
        split = table.get((r.source, r.case_id), table.get((None, r.case_id)))
        out.append(dataclasses.replace(r, split=split) if split else r)
    return out, listed


def select(config, found: Mapping[str, list[CaseRef]], rules: Mapping[str, str]):
    """Apply ``--cases``, ``--limit``, ``--split-ratio`` and ``--split-file`` of a build config.

    ``found`` maps each source to its refs (as the source listed them), ``rules`` to its
    own split rule. Returns ``(refs, origins)``: the chosen refs with their splits, and
    ``{(source, case_id): how the case got its split}``.
    """
    refs: list[CaseRef] = []
    origins: dict[tuple[str, str], str] = {}
    for source, listed in found.items():
        chosen = choose_cases(sorted(listed, key=lambda r: r.case_id), cases=for_source(config.cases, source),
                              limit=for_source(config.limit, source), seed=config.seed)
        ratio = for_source(config.split_ratio, source)
        if ratio is not None:
            chosen = split_by_ratio(chosen, ratio, config.seed)
            how = f"split-ratio {','.join(f'{r:g}' for r in ratio)} by patient, seed {config.seed}"
        else:
            how = rules[source]
        origins.update({(r.source, r.case_id): how for r in chosen})
        refs += chosen
    if config.split_file:
        ratio_sources = {s for s in found if for_source(config.split_ratio, s) is not None}
        refs, listed = apply_split_file(refs, read_split_file(config.split_file), config.split_file, ratio_sources)
        origins.update({key: f"split-file {Path(config.split_file).name}" for key in listed})
    return refs, origins
