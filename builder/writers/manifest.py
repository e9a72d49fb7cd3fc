"""``OUT/manifest.json``: what a build is, how it was made, and the sha256 of every file.

The manifest is written LAST, after every shard: its presence means the build is
complete. Layout (top-level keys, as :func:`spar_bench.builder.build.build` writes them)::

    format            "spar-bench-build"
    schema_version    spar_bench.builder.schema.SCHEMA_VERSION
    builder_version   spar_bench.builder.__version__
    complete          true
    config            BuildConfig.published(): every option that shapes the bytes (never the
                      worker count); folders as seen from OUT, or null (no absolute path)
    seed              the global seed
    sample_config     SampleConfig.to_dict()
    levels            the levels built, e.g. ["level1", "level2", "level3"] (+ "level4", opt-in)
    sources           {name: {"root", "inputs_sha256", "n_inputs", "n_cases", "needs", "label_map",
                      "level12"}}; "level12" (builds with a mosaic level): see :func:`level12_reach`
    thresholds        {"values": {...} | null, "origin": "..."}
    shards            {level: {split: [{"path", "sha256", "rows", "questions"}]}}
    hf                {"files": [{"path", "sha256", "rows"}], "card": {"path", "sha256"}} | null
    counts            {level: {split: {"samples"|"slices"|"volumes" (LevelSpec.unit), "questions",
                      "classes"}}}; "classes" holds "present" (organs present, per organ) for mosaic
                      and volume levels and one count per answer class for each probe with questions
    cases             [{"source", "case_id", "split", "patient_id", "image_synthesized", "rows",
                        "provenance"}]; provenance["files"] are relative to the source's folder
    skipped           [{"source", "case_id", "split", "reason"}]
    versions          {distribution: version | null} (spar_bench.provenance.BUILD_PACKAGES)
    fingerprint       see :func:`fingerprint`
    field_sha256      {key: sha256} of every other top-level key: see :func:`field_digests`

Paths are relative to ``OUT`` with forward slashes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_file  # noqa: F401  (re-exported for writers and verify)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "spar-bench-build"
#: Keys without which a manifest is not a usable build.
REQUIRED_KEYS = ("format", "schema_version", "complete", "shards", "fingerprint")
#: The top-level key recording the sha256 of every other one (:func:`field_digests`).
DIGESTS_KEY = "field_sha256"
#: Top-level keys no digest covers: the fingerprint (checked against the shard list) and the digests.
UNDIGESTED = ("fingerprint", DIGESTS_KEY)


def fingerprint(entries: Iterable[tuple[str, str]]) -> str:
    """sha256 over the sorted ``(relative path, sha256)`` pairs of every shard.

    The text hashed is one ``"<path>\\t<sha256>\\n"`` line per shard, sorted by path,
    so the fingerprint changes whenever any shard's bytes, name or count changes.
    """
    lines = "".join(f"{p}\t{s}\n" for p, s in sorted(entries))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def field_digests(manifest: Mapping[str, Any]) -> dict[str, str]:
    """``{key: sha256}`` of every top-level key of ``manifest`` but :data:`UNDIGESTED`.

    The text hashed is the value's JSON with sorted keys and no whitespace
    (``json.dumps(value, sort_keys=True, separators=(",", ":"))``), so a hand edit of any
    field (``config``, ``thresholds``, ``counts``...) changes its digest. (NaN is allowed here so
    that a hand-edited NaN is reported as an edit; :func:`write_manifest` refuses it.)
    """
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()
            for k, v in manifest.items() if k not in UNDIGESTED}


def edited_fields(manifest: Mapping[str, Any]) -> list[str]:
    """One line per top-level field that differs from the manifest's :data:`DIGESTS_KEY`
    (edited, added or removed after the build; empty list = as written), without the file name."""
    recorded = manifest.get(DIGESTS_KEY)
    if recorded is None:
        return [f"no {DIGESTS_KEY} (written before spar-bench 0.2.0): its config and thresholds "
                "cannot be checked; rebuild it"]
    if not isinstance(recorded, dict):
        return [f"{DIGESTS_KEY} is not a {{field: sha256}} object; rebuild it"]
    got = field_digests(manifest)
    lines = []
    for key in sorted(set(got) | set(recorded)):
        if key not in got:
            lines.append(f"field {key!r} removed after the build ({DIGESTS_KEY} lists it); restore it or rebuild")
        elif key not in recorded:
            lines.append(f"field {key!r} added after the build ({DIGESTS_KEY} does not list it); remove it")
        elif got[key] != recorded[key]:
            lines.append(f"field {key!r} edited after the build (sha256 {got[key][:16]}... != {DIGESTS_KEY} "
                         f"{str(recorded[key])[:16]}...); restore it or rebuild")
    return lines


def manifest_problems(manifest: Mapping[str, Any]) -> list[str]:
    """Every way ``manifest`` disagrees with itself, one line each without the file name: its
    ``fingerprint`` against its shard list, and each field against :data:`DIGESTS_KEY`."""
    lines = []
    fp, want = fingerprint(shard_entries(manifest)), str(manifest.get("fingerprint"))
    if fp != want:
        lines.append(f"fingerprint {want[:16]}... does not match its shard list ({fp[:16]}...)")
    return lines + edited_fields(manifest)


def shard_entries(manifest: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every ``(path, sha256)`` the fingerprint covers: HDF5 shards and Parquet files."""
    pairs = [
        (e["path"], e["sha256"])
        for splits in manifest.get("shards", {}).values()
        for entries in splits.values()
        for e in entries
    ]
    hf = manifest.get("hf") or {}
    pairs += [(e["path"], e["sha256"]) for e in hf.get("files", [])]
    return pairs


def level12_reach(label_map: Mapping[str, Any], min_organs: int,
                  case_rows: list[Mapping[str, int]]) -> dict[str, Any]:
    """What one source gives Levels 1-2: the manifest's ``sources[name]["level12"]``.

    A Level 1/2 sample needs ``min_organs`` present organs (``SampleConfig.l12_min_organs``).
    ``reachable`` is False when the source's label map annotates fewer organs (LiTS: liver
    only), so none of its cases can give a sample; None when the label map does not say which
    organs it annotates. ``cases_with_samples`` / ``cases_without`` count the built cases
    (``case_rows``: each case's rows per level) that gave / did not give Level 1 or 2 rows:
    a reachable source can still hold cases whose field of view shows too few organs.
    """
    annotated = label_map.get("annotated")
    n_annotated = len(annotated) if isinstance(annotated, list) else None
    reachable = None if n_annotated is None else n_annotated >= min_organs
    with_rows = sum(1 for r in case_rows if r.get("level1", 0) or r.get("level2", 0))
    out: dict[str, Any] = {
        "min_present_organs": min_organs, "annotated_organs": n_annotated, "reachable": reachable,
        "cases_with_samples": with_rows, "cases_without": len(case_rows) - with_rows,
    }  # fmt: skip
    if reachable is False:
        out["note"] = (f"the label map annotates {n_annotated} organ(s) ({', '.join(annotated)}); a "
                       f"Level 1-2 sample needs {min_organs} present: no Level 1-2 samples from this source")
    return out


def dumps(manifest: Mapping[str, Any]) -> str:
    """Canonical JSON text (sorted keys, 2-space indent, trailing newline, NaN refused)."""
    return json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Fill in ``format``, ``complete``, ``fingerprint`` and :data:`DIGESTS_KEY` and write
    ``out_dir/manifest.json``. The digests are taken over the manifest as read back (JSON
    turns tuples into lists and keys into strings), so a reader recomputes the same ones."""
    manifest = json.loads(json.dumps({**manifest, "format": MANIFEST_FORMAT, "complete": True}, allow_nan=False))
    manifest["fingerprint"] = fingerprint(shard_entries(manifest))
    manifest[DIGESTS_KEY] = field_digests(manifest)
    path = Path(out_dir) / MANIFEST_NAME
    path.write_text(dumps(manifest), encoding="utf-8")
    return path


def listed_files(manifest: Mapping[str, Any]) -> set[str]:
    """Every file a build consists of, relative to ``OUT``: shards, Parquet, card, manifest."""
    files = {path for path, _ in shard_entries(manifest)} | {MANIFEST_NAME}
    card = (manifest.get("hf") or {}).get("card")
    if card:
        files.add(card["path"])
    return files


def owned_build(out: Path) -> set[str] | None:
    """The files of the SPAR-Bench build at ``out``, or None if its manifest does not say so."""
    try:
        manifest = json.loads((Path(out) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    return listed_files(manifest)


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """Read and sanity-check ``out_dir/manifest.json`` (raises ConfigError)."""

    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ConfigError(
            f"{path}: no manifest.json - {out_dir} is not a finished SPAR-Bench build "
            "(build one with `spar-build --source ... --out DIR`, or resume it with --resume)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable manifest ({e}); rebuild with --overwrite") from None
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ConfigError(f"{path}: incomplete manifest, missing {', '.join(missing)}; rebuild it")
    if manifest["format"] != MANIFEST_FORMAT:
        raise ConfigError(f"{path}: format {manifest['format']!r} is not {MANIFEST_FORMAT!r}")
    if manifest["complete"] is not True:
        raise ConfigError(f"{path}: build marked incomplete; finish it with --resume")
    return manifest
