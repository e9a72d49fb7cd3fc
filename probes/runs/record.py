"""The run record: what one finished run of any kind was, in one typed class (``config.json``).

A :class:`RunRecord` is written beside every run's files and read back by every reader (the
finished-run check, transfer evaluation, both reports), as HF datasets' ``DatasetInfo`` is:
one class, :meth:`RunRecord.write` and :meth:`RunRecord.read`, instead of one dict literal per
run kind. Its fields are what every kind has (``kind``, the probe, head, variant and seed, the
model and the build with its fingerprint, the identity of its inputs, its options, versions
and protocol); ``extra`` holds what one kind alone records (a head's resolved config and
width, a finetune's encoder config and precision, an MLLM's decoding), and ``files`` the
sha256 of each file the run declares (``None``: checked for presence only, such as a timing).

A run is identified by :meth:`RunRecord.identity`: kind, probe, head, seed, model, build
fingerprint, inputs and options (what a run would write again with the same spec). Runs
written before the record (no ``kind``) are read through :func:`from_legacy`, which names
their kind from the markers they carried; their identity is the part those files recorded
alike (:data:`LEGACY_IDENTITY`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.outputs import write_bytes
from spar_bench.provenance import json_safe

CONFIG_FILE = "config.json"
#: The record layout this code writes (a reader refuses a newer one).
RECORD_VERSION = 1
#: What a run written before the record is compared on (its files recorded these alike).
LEGACY_IDENTITY = ("kind", "probe", "head", "seed", "build_fingerprint")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class RunRecord:
    """One run's ``config.json`` (see the module doc); JSON-safe, no local path in any field."""

    kind: str
    probe: str
    head: str
    seed: int
    variant: str = ""
    model: str | None = None
    build: str | None = None
    build_fingerprint: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    protocol: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str | None] = field(default_factory=dict)
    legacy: bool = False  # read from a run written before the record (see from_legacy)

    # ------------------------------------------------------------------ identity
    def identity(self) -> dict[str, Any]:
        """What makes two runs the same run (JSON-normalised, so a record read back compares equal)."""
        names = LEGACY_IDENTITY if self.legacy else (
            "kind", "probe", "head", "seed", "model", "build_fingerprint", "inputs", "options")
        return json.loads(json.dumps(json_safe({k: getattr(self, k) for k in names}), default=str))

    def differences(self, other: RunRecord) -> list[str]:
        """``key=old (now new)`` for every leaf in which ``other`` (this run) differs from
        ``self`` (a finished run), compared as the older of the two records allows."""
        names = LEGACY_IDENTITY if self.legacy or other.legacy else None
        had, want = _flat(self.identity()), _flat(other.identity())
        if names:
            had, want = ({k: v for k, v in d.items() if k.split(".")[0] in names} for d in (had, want))
        return [f"{k}={had.get(k)} (now {want.get(k)})" for k in sorted(set(had) | set(want))
                if had.get(k) != want.get(k)]  # fmt: skip

    def get(self, name: str, default: Any = None) -> Any:
        """A kind's own field: from ``inputs``, else ``extra`` (where a run before the record kept it)."""
        return self.inputs.get(name, self.extra.get(name, default))

    def replace(self, **changes: Any) -> RunRecord:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "legacy"}
        return {"record": RECORD_VERSION, **json_safe(d)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str | Path = CONFIG_FILE) -> RunRecord:
        """The record of ``d`` (a ``config.json``); one written before the record is converted."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: not a run record (a JSON object is expected)")
        if "kind" not in d:
            return from_legacy(d, where)
        if int(d.get("record", 1)) > RECORD_VERSION:
            raise ConfigError(f"{where}: a run record of layout {d['record']} (this spar-bench reads up to "
                              f"{RECORD_VERSION}); upgrade spar-bench to read it")  # fmt: skip
        names = {f.name for f in dataclasses.fields(cls)} - {"legacy"}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise ConfigError(f"{where}: an incomplete run record ({e})") from None

    @classmethod
    def from_saved(cls, saved: str | dict[str, Any], where: str | Path) -> RunRecord:
        """The record a ``head.pt`` holds: its JSON text (a dict in runs before the record)."""
        if isinstance(saved, str):
            try:
                saved = json.loads(saved)
            except ValueError as e:
                raise ConfigError(f"{where}: an unreadable run record ({e})") from None
        return cls.from_dict(saved, where)

    def write(self, rd: Path) -> None:
        """``rd/config.json``, whole or not at all."""

        write_bytes(Path(rd) / CONFIG_FILE, json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    @classmethod
    def read(cls, rd: Path) -> RunRecord:
        """The record of run folder ``rd``; a missing or unreadable one is a one-line error."""
        p = Path(rd) / CONFIG_FILE
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{p}: unreadable run record ({e}); delete the run folder to rerun it") from None
        return cls.from_dict(d, p)

    # ------------------------------------------------------------------ files
    def with_files(self, rd: Path, declared: dict[str, bool]) -> RunRecord:
        """This record with ``files``: the sha256 of each declared file of ``rd`` (``False``:
        presence only, a file whose bytes differ between two runs, such as a timing)."""
        return self.replace(files={n: file_sha256(Path(rd) / n) if checked else None
                                   for n, checked in sorted(declared.items())})  # fmt: skip

    def damaged(self, rd: Path) -> list[str]:
        """The declared files of ``rd`` that are missing or whose bytes changed."""
        out = []
        for name, sha in self.files.items():
            p = Path(rd) / name
            if not p.is_file():
                out.append(f"{name} missing")
            elif sha is not None and file_sha256(p) != sha:
                out.append(f"{name} changed")
        return out


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"inputs": {"a": 1}}`` -> ``{"inputs.a": 1}`` (a refusal names the leaf)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --------------------------------------------------------------------------- runs written before the record
def legacy_kind(d: dict[str, Any]) -> str:
    """The kind of a run written before the record, from the marker each kind carried."""
    if d.get("track") == "vqa":
        return "mllm"
    if d.get("command") == "finetune":
        return "finetune"
    if d.get("predictor"):
        return str(d["predictor"])
    return "head"


def from_legacy(d: dict[str, Any], where: str | Path = CONFIG_FILE) -> RunRecord:
    """A :class:`RunRecord` of a ``config.json`` written before the record (spar-bench <= 0.2.0.dev0)."""
    if not {"probe", "head", "seed"} <= set(d):
        raise ConfigError(f"{where}: not a run record (no kind, probe, head and seed); delete the folder to rerun it")
    kind = legacy_kind(d)
    common = {"probe", "head", "seed", "variant", "encoder", "model", "dataset_dir", "dataset",
              "dataset_fingerprint", "versions", "protocol_version", "build_protocol_version", "run"}
    return RunRecord(
        kind=kind, probe=str(d["probe"]), head=str(d["head"]), seed=int(d["seed"]), variant=str(d.get("variant") or ""),
        model=d.get("model") if kind == "mllm" else d.get("encoder"),
        build=d.get("dataset_dir") or d.get("dataset"), build_fingerprint=d.get("dataset_fingerprint"),
        options=d.get("run") or {}, versions=d.get("versions") or {},
        protocol={k: d.get(k) for k in ("protocol_version", "build_protocol_version")},
        extra={k: v for k, v in d.items() if k not in common}, legacy=True,
    )  # fmt: skip
