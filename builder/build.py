"""Build orchestration: sources -> per-case samples -> shards + Hugging Face folder + manifest.

Pipeline of :func:`build`:

1. find the cases of every source (cheap), sorted by ``(source, case_id)``;
2. process cases in parallel (``workers`` processes): each worker loads ONE case
   (volumes read once), runs :func:`spar_bench.builder.samples.process_case`, and spills the
   arrays to ``OUT.tmp/cases/<source>__<case_id>.npz`` (+ a ``.json`` index written
   after it, which marks the case done). Memory stays bounded; ``resume`` reuses a done
   case only while its inputs' sha256, the config and the spilled file are unchanged,
   and rebuilds any other (an edited input, a torn spill);
3. fit the thresholds that finish a level's open answers (its hooks,
   :mod:`spar_bench.builder.samples.levels`) on the train split's original (non-mirror)
   questions, or take them from another build's manifest, or fit them on a named split;
4. stream the cases, in ``(source, case_id)`` order whatever the completion order,
   through :class:`~spar_bench.builder.writers.hdf5.ShardSink` (the level's hooks finish
   the answers on the way);
5. convert each HDF5 shard to a Parquet shard and write the dataset card;
6. write ``manifest.json`` last, then move ``OUT.tmp/out`` to ``OUT`` atomically.

The worker count never changes a byte of the output.

``spar-build --help`` loads this module (the options), so the steps' modules are imported
where they are used (docs/DEVELOPING.md, Imports).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from spar_bench.errors import CaseError, ConfigError, IntegrityError, SparError
from spar_bench.fields import check_fields, limited
from spar_bench.hashing import sha256_file, sha256_json
from spar_bench.outputs import check_target, claim, disk_full_is_an_error, files_under, remove
from spar_bench.partitions import parse_partition
from spar_bench.procs import check_stop
from spar_bench.provenance import (
    BUILD_PACKAGES,
    PROTOCOL_VERSION,
    json_safe,
    local_paths,
    local_prefixes,
    package_versions,
    path_from_build,
    portable_path,
)

from . import __version__
from .partition import finish_partition, owned_partition, partition_of
from .writers.hdf5 import ShardSink, volume_shard_rows

if TYPE_CHECKING:
    from .case import CaseRef
    from .samples import SampleConfig

from .schema import (
    LEVEL_PARTS,
    LEVEL_SPECS,
    LEVELS,
    N_ORGANS,
    ORGANS,
    SCHEMA_VERSION,
    LevelSpec,
    ordered_splits,
)
from .writers.hdf5 import COMPRESSIONS

ON_ERROR = ("fail", "skip")
UNKNOWN_LABELS = ("fail", "ignore")
#: Options added after builder 0.1.0: left out of the recorded config while at their
#: default, so a build without them keeps the bytes of its dataset card and manifest config.
#: Fields holding a file or folder: published as seen from OUT, or null (BuildConfig.recorded).
PATH_FIELDS = ("thresholds_from", "split_file")
OPTIONAL_FIELDS = {"cases": {}, "limit": {}, "split_ratio": {}, "split_file": None, "unknown_labels": "fail",
                   "preset": None}
#: Fields of the build config that never change the output bytes (kept out of the manifest).
RUNTIME_FIELDS = ("out", "workers", "resume", "overwrite", "partition")


@dataclass(frozen=True)
class BuildConfig:
    """Everything that defines a build.

    Attributes:
        sources: source names (``SOURCES``); several make a transfer build.
        roots: one data folder per source, same order.
        out: output folder (must be empty or absent unless ``resume``/``overwrite``).
        sample: :class:`spar_bench.builder.samples.SampleConfig` fields that differ from its defaults.
        seed: global seed; every random draw derives from it.
        workers: processes (>= 1; ``spar-build --jobs``). Never affects the output.
        images: ``auto`` | ``require`` | ``synthesize`` (pseudo-CT for masks-only sources).
        shard_size: rows (samples, or Level 3 slices) per HDF5/Parquet shard.
        compression: HDF5 image compression, ``blosc`` (needs hdf5plugin to read) or
            ``gzip`` | ``lzf`` | ``none`` (plain h5py reads them).
        thresholds_from: a build folder or its manifest.json to copy thresholds from.
        fit_thresholds_on: split whose questions fit the thresholds when there is no train split.
        resume / overwrite: reuse ``OUT.tmp`` / replace an existing ``OUT``.
        on_error: ``fail`` stops at the first bad case; ``skip`` records it in the manifest.
        hf: also write the Hugging Face folder ``OUT/hf``.
        cases / limit / split_ratio: per source (key a source name, or ``"*"`` for every
            source): case ids to keep, a seeded patient-level number of cases, a
            patient-level train/val/test ratio (:mod:`spar_bench.builder.selection`).
        split_file: CSV ``case_id,split[,source]`` giving the split of listed cases.
        unknown_labels: ``fail`` on a label id the label map does not know, or
            ``ignore`` it (background; listed per case in the manifest).
        partition: ``(i, n)``: run phase 1 only, for the cases of partition i of n, into a
            partition folder that ``spar-build merge`` combines (:mod:`.partition`).
        preset: ``{"name", "options", "overridden"}`` of a ``--preset`` (:mod:`spar_bench.presets`):
            which options it set and which explicit options overrode it; None without one.
    """

    sources: tuple[str, ...]
    roots: tuple[str, ...]
    out: str
    sample: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    workers: int = 1
    images: str = limited("auto", choices=("auto", "require", "synthesize"))
    shard_size: int = 2000
    compression: str = "blosc"
    thresholds_from: str | None = None
    fit_thresholds_on: str | None = None
    resume: bool = False
    overwrite: bool = False
    on_error: str = "fail"
    hf: bool = True
    cases: dict[str, list[str]] = field(default_factory=dict)
    limit: dict[str, int] = field(default_factory=dict)
    split_ratio: dict[str, list[float]] = field(default_factory=dict)
    split_file: str | None = None
    unknown_labels: str = "fail"
    partition: tuple[int, int] | None = None
    preset: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("no --source given; list them with `spar-build sources`")
        if len(self.roots) != len(self.sources):
            raise ConfigError(f"{len(self.sources)} source(s) but {len(self.roots)} --root folder(s)")
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"--on-error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.workers < 1:
            raise ConfigError(f"--jobs must be >= 1, got {self.workers}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"--compression must be one of {', '.join(COMPRESSIONS)}, "
                              f"got {self.compression!r}")
        if self.shard_size < 1:
            raise ConfigError(f"--shard-size must be >= 1, got {self.shard_size}")
        if self.unknown_labels not in UNKNOWN_LABELS:
            raise ConfigError(f"--unknown-labels must be one of {UNKNOWN_LABELS}, got {self.unknown_labels!r}")
        check_fields(self)
        for key, n in self.limit.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ConfigError(f"--limit {key}={n!r}: must be an integer >= 1")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other; pick one")

    def recorded(self) -> dict[str, Any]:
        """Everything that shapes the bytes, paths as given: what ``OUT.tmp/config.json`` and a
        partition record, so a resume or a merge is checked against the same options. Never
        published as it is: the manifest and the card hold :meth:`published`."""
        d = asdict(self)
        for k in RUNTIME_FIELDS:
            d.pop(k)
        d["sources"], d["roots"] = list(self.sources), list(self.roots)
        for k, default in OPTIONAL_FIELDS.items():
            if d[k] == default:
                d.pop(k)
        return d

    def published(self) -> dict[str, Any]:
        """:meth:`recorded` as the manifest and the dataset card show it: no absolute path.

        Paths (``roots``, ``thresholds_from``, ``split_file``) are written as seen from OUT
        (``"../data/word"``, :func:`spar_bench.provenance.path_from_build`) when they lie in
        the folder that holds OUT, else ``null``. The manifest's ``sources`` and
        ``thresholds`` identify the inputs by sha256 and fingerprint instead.
        """
        d = self.recorded()
        d["roots"] = [path_from_build(r, self.out) for r in self.roots]
        for k in PATH_FIELDS:
            if d.get(k):
                d[k] = path_from_build(d[k], self.out)
        return d


def _sample_config(config: BuildConfig):
    from .samples import SampleConfig

    return SampleConfig.from_dict(dict(config.sample))


# -- work dir --------------------------------------------------------------------------
def _case_stem(source: str, case_id: str) -> str:
    return f"{source}__{case_id}".replace("/", "_")


def _to_storable(arr: Any) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind == "O":
        return np.array([str(v) for v in arr.reshape(-1)], dtype=str).reshape(arr.shape)
    return arr


@dataclass(frozen=True)
class CaseJob:
    """One case for a worker (:func:`process_one`); picklable, so any start method runs it."""

    ref: CaseRef
    source_cls: type
    root: str
    images: str
    seed: int
    sample: dict[str, Any]
    cases_dir: str
    config_sha256: str
    unknown_labels: str = "fail"
    resume: bool = False

    @property
    def stem(self) -> str:
        return _case_stem(self.ref.source, self.ref.case_id)


@dataclass(frozen=True)
class CaseRecord:
    """A processed case's index record: ``OUT.tmp/cases/<stem>.json`` (written after its
    ``.npz``: the case is done), an entry of ``partition.json``, a row of the manifest's cases.

    ``status`` is ``"ok"`` (then ``provenance``, ``image_synthesized``, ``rows`` and
    ``spill_sha256`` are set) or ``"error"`` (then ``reason``); :meth:`to_json` leaves the
    other fields out.
    """

    source: str
    case_id: str
    split: str
    patient_id: str
    config_sha256: str
    status: str
    inputs: dict[str, str]
    reason: str | None = None
    provenance: dict[str, Any] | None = None
    image_synthesized: bool | None = None
    rows: dict[str, int] | None = None
    spill_sha256: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        """The record as its ``.json`` file and ``partition.json`` hold it (unset fields left out)."""
        return json_safe({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, record: Any) -> CaseRecord | None:
        """The record read back from :meth:`to_json`'s dict, or None when it is not one."""
        try:
            return cls(**record)
        except TypeError:
            return None


def _spill(cases_dir: Path, stem: str, result: dict[str, dict[str, Any]], record: CaseRecord) -> CaseRecord:
    """Write the case's arrays, then its ``.json`` record (with the arrays' sha256): done."""

    arrays = {f"{part}/{name}": _to_storable(v) for part, d in result.items() for name, v in d.items()}
    tmp = cases_dir / f"{stem}.part.npz"
    np.savez(tmp, **arrays)
    record = replace(record, spill_sha256=sha256_file(tmp))
    os.replace(tmp, cases_dir / f"{stem}.npz")
    tmp_json = cases_dir / f"{stem}.part.json"
    tmp_json.write_text(json.dumps(record.to_json(), sort_keys=True), encoding="utf-8")
    os.replace(tmp_json, cases_dir / f"{stem}.json")
    return record


def load_case_result(
    cases_dir: Path, stem: str, parts: Iterable[str] = LEVEL_PARTS
) -> dict[str, dict[str, np.ndarray]]:
    """Read a spilled case back (only the parts asked for)."""
    out: dict[str, dict[str, np.ndarray]] = {p: {} for p in parts}
    with np.load(cases_dir / f"{stem}.npz", allow_pickle=False) as z:
        for key in z.files:
            part, _, name = key.partition("/")
            if part in out:
                out[part][name] = z[key]
    return out


def _rows(d: dict[str, np.ndarray]) -> int:
    return len(next(iter(d.values()))) if d else 0


def open_source(cls: type, root: str, *, images: str, seed: int, unknown_labels: str = "fail"):
    """A source instance; ``unknown_labels`` is passed only when set, so plugin sources
    written before the option keep working."""
    if unknown_labels == "fail":
        return cls(root, images=images, seed=seed)
    return cls(root, images=images, seed=seed, unknown_labels=unknown_labels)


def input_digest(ref: Any) -> dict[str, str]:
    """sha256 of every input file (or DICOM / segmentation folder) of a case, by role.

    A file this process has just read keeps the digest taken while reading it
    (:func:`~spar_bench.builder.readers.file_sha256`: not read a second time). A file that
    cannot be read is ``"unreadable"`` (its case's error names it; a resume rebuilds it)."""
    return {role: _digest(p) for role, p in sorted(ref.files.items())}


def _digest(path: str | Path) -> str:
    from .readers import file_sha256

    if not Path(path).exists():
        return "missing"
    try:
        return file_sha256(path)
    except OSError:
        return "unreadable"


#: The fields that say which case, split, patient and config a record is of.
_CASE_IDENTITY = ("source", "case_id", "split", "patient_id", "config_sha256")


def _reusable_spill(job: CaseJob, expected: CaseRecord) -> CaseRecord | None:
    """The spilled record of a case if it still holds, else None (the case is rebuilt).

    It holds when its ``.json`` parses, names the same case, split, patient and config,
    its ``.npz`` has the sha256 recorded at spill time (not torn, not edited), and every
    input file still has the sha256 it had when the case was processed.
    """

    cases_dir = Path(job.cases_dir)
    try:
        rec = CaseRecord.from_json(json.loads((cases_dir / f"{job.stem}.json").read_text(encoding="utf-8")))
        npz_sha = sha256_file(cases_dir / f"{job.stem}.npz")
    except (OSError, ValueError):
        return None
    if rec is None or not rec.ok or rec.spill_sha256 != npz_sha:
        return None
    if any(getattr(rec, k) != getattr(expected, k) for k in _CASE_IDENTITY):
        return None
    return rec if rec.inputs == input_digest(job.ref) else None


def process_one(job: CaseJob) -> CaseRecord:
    """Worker: load one case, make its samples, spill them; return its index record.

    With ``job.resume`` a spilled case whose inputs, config and spill file are
    unchanged is returned as it is (:func:`_reusable_spill`); any other is rebuilt.
    Top-level and argument-only (picklable), so it runs under any multiprocessing
    start method. A :class:`CaseError` becomes a record with ``status="error"``.
    """
    from .samples import SampleConfig, process_case

    ref, cases_dir = job.ref, Path(job.cases_dir)
    record = CaseRecord(source=ref.source, case_id=ref.case_id, split=ref.split, patient_id=ref.patient,
                        config_sha256=job.config_sha256, status="", inputs={})
    if job.resume and (rec := _reusable_spill(job, record)) is not None:
        return rec
    (cases_dir / f"{job.stem}.json").unlink(missing_ok=True)  # stale or torn
    inputs = None
    try:
        src = open_source(job.source_cls, job.root, images=job.images, seed=job.seed,
                          unknown_labels=job.unknown_labels)
        case = src.load(ref)
        inputs = input_digest(ref)  # after the read: its file digests are reused
        result = process_case(case, SampleConfig.from_dict(job.sample), job.seed)
    except CaseError as e:
        return replace(record, inputs=inputs or input_digest(ref), status="error", reason=str(e))
    result = _checked_result(ref.case_id, result, job.sample["levels"])
    record = replace(record, inputs=inputs, status="ok",
                     provenance=_portable_provenance(case.provenance, job.root),
                     image_synthesized=bool(case.image_synthesized),
                     rows={p: _rows(result[p]) for p in result})
    return _spill(cases_dir, job.stem, result, record)


#: The parts every case record lists, built or not (those of builder 0.2: Levels 1-3); an
#: opt-in level's parts (Level 4) only when it is built, so builds without it keep the bytes
#: of their manifest (``cases[].rows``).
RECORDED_PARTS = ("level1", "level2", "level3", "level3_questions")


def _parts_of(levels: Iterable[str]) -> list[str]:
    """The result parts of ``levels``: each level's rows and its questions table, if any."""
    return [*levels, *(q for lv in levels if (q := LEVEL_SPECS[lv].questions))]


def _checked_result(case_id: str, result: dict[str, dict[str, Any]], levels: list[str]) -> dict[str, dict[str, Any]]:
    """``process_case``'s result with every recorded part (empty where not built); SparError
    when a level asked for is missing or its rows have no key."""
    wanted = _parts_of(levels)
    missing = [p for p in wanted if p not in result]
    if missing:
        raise SparError(f"case {case_id}: process_case returned no {', '.join(missing)}")
    result = {p: result.get(p, {}) for p in LEVEL_PARTS if p in RECORDED_PARTS or p in wanted}
    for part in LEVELS:
        if result.get(part) and "key" not in result[part]:
            raise SparError(f"case {case_id}: process_case gave {part} rows without 'key'")
    return result


# -- thresholds ------------------------------------------------------------------------
def _load_thresholds_from(path: str) -> tuple[dict[str, Any], str]:
    """(thresholds, fingerprint) of the build at ``path`` (a folder or its manifest.json); a
    manifest that disagrees with itself (a hand-edited ``thresholds`` or ``config``, a fingerprint
    that is not its shard list's: :func:`~.writers.manifest.manifest_problems`) is refused."""
    from .writers.manifest import MANIFEST_FORMAT, manifest_problems

    p = Path(path)
    p = p / "manifest.json" if p.is_dir() else p
    if not p.is_file():
        raise ConfigError(f"--thresholds-from {path}: no manifest.json there; give a finished build")
    not_one = f"{p}: has no thresholds.values; is it a SPAR-Bench build manifest?"
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
        th = m["thresholds"]["values"]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(not_one) from None
    if m.get("format") != MANIFEST_FORMAT:
        raise ConfigError(not_one)
    problems = manifest_problems(m)
    if problems:
        raise ConfigError(f"--thresholds-from {path}: {p}: {'; '.join(problems)} (`spar-build verify` "
                          "checks a build); give an intact build")
    if th is None:
        raise ConfigError(f"{p}: that build recorded no thresholds (built without level3?)")
    return th, str(m.get("fingerprint", "unknown"))


def _fitting_levels(levels: tuple[str, ...]) -> list[str]:
    """The built levels whose questions may need thresholds (:mod:`.samples.levels`)."""
    from .samples.levels import level_hooks

    return [lv for lv in levels if level_hooks(lv).fits_thresholds]


def _needs_thresholds(level: str, records: list[CaseRecord], cases_dir: Path) -> bool:
    """Whether any case has a question of ``level`` that the thresholds decide."""
    from .samples.levels import level_hooks

    part = LEVEL_SPECS[level].questions
    return any(level_hooks(level).needs_thresholds(
        load_case_result(cases_dir, _case_stem(r.source, r.case_id), (part,))[part]) for r in records)


def _thresholds(config: BuildConfig, records: list[CaseRecord], cases_dir: Path, levels: tuple[str, ...]):
    """(thresholds, origin) of the build: fitted, taken from another build, or not needed."""
    from .samples.levels import level_hooks

    fitting = _fitting_levels(levels)
    if not fitting:
        return None, f"not needed (no {' or '.join(_fitting_levels(LEVELS))})"
    level = fitting[0]  # LEVEL_HOOKS: at most one level fits thresholds
    hooks, spec = level_hooks(level), LEVEL_SPECS[level]
    if config.thresholds_from:
        th, fp = _load_thresholds_from(config.thresholds_from)
        where = path_from_build(Path(config.thresholds_from), config.out)
        return th, f"from build {fp}" + (f" ({where})" if where else "")
    if not _needs_thresholds(level, records, cases_dir):  # e.g. a lesion-only (LiTS) build
        return None, f"not needed (no {hooks.threshold_questions} in this build)"
    splits = sorted({r.split for r in records})
    fit_split = config.fit_thresholds_on or ("train" if "train" in splits else None)
    if fit_split is None:
        raise ConfigError(
            f"this build has no train split (splits: {', '.join(splits) or 'none'}), so the thresholds of "
            f"its {hooks.threshold_questions} cannot be fitted on it; pass --thresholds-from "
            "BUILD/manifest.json (reuse a training build's thresholds) or --fit-thresholds-on SPLIT"
        )
    if fit_split not in splits:
        raise ConfigError(f"--fit-thresholds-on {fit_split}: no such split; splits: {', '.join(splits)}")
    tables = []
    for r in records:
        if r.split == fit_split:
            res = load_case_result(cases_dir, _case_stem(r.source, r.case_id), (level, spec.questions))
            tables.append(hooks.fit_input(res[level], res[spec.questions]))
    return json_safe(hooks.fit(tables)), f"fitted on split {fit_split!r} (original, non-mirror questions)"


# -- output ----------------------------------------------------------------------------
#: In ``OUT.tmp`` of a build that stopped on an error: that error's line.
FAILED = "failed.txt"
WORK_ENTRIES = {"config.json", "config.part.json", "cases", "out", FAILED}


def owned_work(work: Path) -> set[str] | None:
    """All files of an interrupted build's ``OUT.tmp``, or None if it is not one."""

    names = {p.name for p in work.iterdir()} if work.is_dir() else set()
    if "config.json" not in names or not names <= WORK_ENTRIES:
        return None
    return files_under(work)


def _prepare_dirs(config: BuildConfig) -> tuple[Path, Path]:
    """Check OUT and OUT.tmp before any work; never delete what SPAR-Bench did not write."""

    from .writers.manifest import owned_build

    out = Path(config.out)
    work = out.parent / (out.name + ".tmp")
    inputs = list(config.roots) + ([config.thresholds_from] if config.thresholds_from else [])
    check_target(out, inputs=inputs)
    check_target(work, inputs=inputs, option="work folder")
    owned, what = (owned_partition, "partition folder") if config.partition else (owned_build, "build")
    is_build = owned(out) is not None
    if config.resume:
        if is_build and not work.exists():
            raise ConfigError(f"{out} is already a finished build; nothing to resume (use --overwrite)")
        if out.exists() and any(out.iterdir()) and not is_build:
            raise ConfigError(f"{out} is not empty and not a SPAR-Bench build; refusing to touch it")
    else:
        claim(out, overwrite=config.overwrite, owned=owned, what=what,
              hint=", --resume to finish an interrupted build")
    if work.exists() and config.overwrite:
        claim(work, overwrite=True, owned=owned_work, what="work folder (OUT.tmp)",
              option="work folder")
        remove(work)
    if work.exists() and not config.resume:
        raise ConfigError(f"{work} holds {_unfinished(work)}; pass --resume to finish it or --overwrite to start over")
    (work / "cases").mkdir(parents=True, exist_ok=True)
    rec = config.recorded()
    if config.partition:  # a partition resumes only as the same partition
        rec["partition"] = list(config.partition)
    recorded = json.dumps(rec, sort_keys=True, indent=2)
    cfg = work / "config.json"
    if cfg.exists() and _resume_record(cfg.read_text(encoding="utf-8")) != _resume_record(recorded):
        raise ConfigError(
            f"{cfg}: the unfinished build used other options; resume with the same options "
            "or pass --overwrite to start over"
        )
    (work / FAILED).unlink(missing_ok=True)  # resumed: its error is no longer the state
    cfg_tmp = work / "config.part.json"
    cfg_tmp.write_text(recorded, encoding="utf-8")
    os.replace(cfg_tmp, cfg)
    if (work / "out").exists():
        shutil.rmtree(work / "out")  # outputs are always rewritten from the spilled cases
    return work, out


#: options a resume may change: how a bad case is met (a failed build is resumed with
#: ``--on-error skip``, as its error line says), not what a finished case holds
RESUME_FREE = ("on_error",)


def _resume_record(text: str) -> Any:
    """A recorded config as a resume compares it (:data:`RESUME_FREE` left out)."""
    try:
        d = json.loads(text)
    except ValueError:
        return text
    return {k: v for k, v in d.items() if k not in RESUME_FREE} if isinstance(d, dict) else d


def _unfinished(work: Path) -> str:
    """What an ``OUT.tmp`` left behind is: a build stopped by an error (named), or interrupted."""
    try:
        reason = (work / FAILED).read_text(encoding="utf-8").strip()
    except OSError:
        return "an interrupted build (killed or stopped before it finished)"
    return f"a build that stopped on an error ({reason})"


@contextmanager
def _failure_recorded(work: Path) -> Iterator[None]:
    """A :class:`SparError` inside leaves its line in ``OUT.tmp/failed.txt``: the next run says
    what the leftover ``OUT.tmp`` is (a full disk may leave nothing: then it is 'interrupted')."""
    try:
        yield
    except SparError as e:
        with suppress(OSError):
            (work / FAILED).write_text(str(e).splitlines()[0] + "\n", encoding="utf-8")
        raise


def _find(config: BuildConfig) -> tuple[list[tuple[Any, str, type]], dict[str, Any], dict[tuple[str, str], str]]:
    """Every chosen case ``(ref, root, source class)`` sorted, the sources' records, split origins."""
    from .selection import select
    from .sources import SOURCES

    found, label_maps, where, rules = {}, {}, {}, {}
    for name, root in zip(config.sources, config.roots, strict=True):
        cls = SOURCES.get(name)
        src = open_source(cls, root, images=config.images, seed=config.seed, unknown_labels=config.unknown_labels)
        found[name] = src.find()
        if not found[name]:
            raise ConfigError(f"source {name}: no cases found under {root} ({src.needs})")
        where[name], rules[name] = (root, cls), src.split_rule
        label_maps[name] = {"root": str(root), "label_map": json_safe(src.label_map()),
                            "needs": src.needs, "n_cases": len(found[name])}
    chosen, origins = select(config, found, rules)
    for name, info in label_maps.items():
        n_chosen = sum(r.source == name for r in chosen)
        if n_chosen != info["n_cases"]:
            info["n_chosen"] = n_chosen
    refs = [(r, *where[r.source]) for r in chosen]
    refs.sort(key=lambda t: (t[0].source, t[0].case_id))
    seen = set()
    for r, _, _ in refs:
        if (r.source, r.case_id) in seen:
            raise ConfigError(f"source {r.source}: case id {r.case_id!r} found twice; ids must be unique")
        seen.add((r.source, r.case_id))
    return refs, label_maps, origins


def _portable_provenance(provenance: dict[str, Any], root: str) -> dict[str, Any]:
    """A case's provenance with its input files relative to the source folder (as published)."""
    files = provenance.get("files")
    if not isinstance(files, dict):
        return provenance
    rel = {role: portable_path(p, root) or Path(p).name for role, p in files.items()}
    return {**provenance, "files": rel}


def _portable_text(text: str, root: str) -> str:
    """``text`` (an error message) with the source folder's own path dropped from file paths."""
    for form in sorted({str(Path(root)), str(Path(root).absolute()), str(Path(root).resolve())},
                       key=len, reverse=True):
        text = text.replace(form + os.sep, "")
    return text


def _published_sources(config: BuildConfig, sources_info: dict[str, dict[str, Any]],
                       records: list[CaseRecord]) -> dict[str, dict[str, Any]]:
    """The sources' records as published: ``root`` as seen from OUT (or None), and
    ``inputs_sha256`` over the sha256 of every input file of the source's built cases.

    The text hashed is one ``"<case_id>/<role>\\t<sha256>"`` line per file, sorted (as the
    build's fingerprint); ``n_inputs`` counts the files.
    """
    from .writers.manifest import fingerprint

    roots = dict(zip(config.sources, config.roots, strict=True))
    out = {}
    for name, info in sources_info.items():
        entries = [(f"{r.case_id}/{role}", sha) for r in records if r.source == name
                   for role, sha in (r.provenance or {}).get("sha256", {}).items()]
        out[name] = {**info, "root": path_from_build(roots[name], config.out),
                     "inputs_sha256": fingerprint(entries), "n_inputs": len(entries)}
    return out


def _refuse_local_paths(config: BuildConfig, manifest: dict[str, Any], out_dir: Path) -> None:
    """IntegrityError if the manifest or the dataset card would publish an absolute local path."""

    paths = [getattr(config, k) for k in PATH_FIELDS if getattr(config, k)]
    prefixes = local_prefixes(*config.roots, config.out, *paths)
    card = out_dir / "hf" / "README.md"
    texts = {"manifest.json": manifest, "hf/README.md": card.read_text(encoding="utf-8") if card.is_file() else ""}
    for name, obj in texts.items():
        found = local_paths(obj, prefixes)
        if found:
            raise IntegrityError(f"{name} would publish a local path ({found[0][:120]!r}); "
                                 "this is a bug in SPAR-Bench, please report it")


def _run_cases(config: BuildConfig, refs, cases_dir: Path, sample: dict) -> dict[tuple[str, str], CaseRecord]:
    from tqdm.auto import tqdm

    done: dict[tuple[str, str], CaseRecord] = {}
    config_sha = sha256_json(config.recorded())
    todo = [CaseJob(ref=ref, source_cls=cls, root=str(root), images=config.images, seed=config.seed,
                    sample=sample, cases_dir=str(cases_dir), config_sha256=config_sha,
                    unknown_labels=config.unknown_labels, resume=config.resume) for ref, root, cls in refs]
    bar = tqdm(total=len(refs), desc="cases", unit="case")

    def accept(rec: CaseRecord) -> None:
        if not rec.ok and config.on_error == "fail":
            raise CaseError(rec.case_id, None, rec.reason.removeprefix(f"case {rec.case_id}: ")
                            + " (rerun with --resume --on-error skip to leave bad cases out)")
        done[(rec.source, rec.case_id)] = rec
        bar.update(1)

    try:
        if config.workers == 1 or len(todo) <= 1:
            for job in todo:
                check_stop()  # a SIGTERM whose SystemExit a finalizer swallowed (completed() checks too)
                accept(process_one(job))
        else:
            from spar_bench.procs import completed, process_pool

            # spawn workers that die with us, killed on any exception (a signal, an error)
            with process_pool(config.workers) as pool:
                futures = [pool.submit(process_one, job) for job in todo]
                for fut in completed(futures):
                    accept(fut.result())
    finally:
        bar.close()
    return done


def _class_counts(level: str, res: dict[str, dict[str, np.ndarray]], acc: dict) -> None:
    """Add one case to ``acc``: organs present (mosaic and volume levels) and answers per
    class (levels with questions)."""
    spec = LEVEL_SPECS[level]
    if spec.mosaic or spec.volume:
        d = res[level]
        if "present" in d and _rows(d):
            acc["present"] = (np.asarray(acc.get("present", np.zeros(N_ORGANS, np.int64)))
                              + d["present"].sum(axis=0)).tolist()
    if spec.questions:
        _answer_counts(spec, res[spec.questions], acc)


def _answer_counts(spec: LevelSpec, q: dict[str, np.ndarray], acc: dict) -> None:
    """Add a questions table's answers to ``acc[probe]`` (a count per answer class)."""
    if not q or not _rows(q):
        return
    for p, (probe, names) in enumerate(zip(spec.probes, spec.classes, strict=True)):
        sel = q["q_answer"][q["q_probe"] == p]
        n_cls = len(names)
        hist = np.bincount(sel[sel >= 0].astype(np.int64), minlength=n_cls)[:n_cls]
        prev = acc.setdefault(probe, [0] * n_cls)
        acc[probe] = [int(a + b) for a, b in zip(prev, hist, strict=True)]


def _shard_rows(spec: LevelSpec, config: BuildConfig, sample_cfg: SampleConfig) -> int:
    """Rows per shard of a level: ``--shard-size``, capped for volumes
    (:func:`~spar_bench.builder.writers.hdf5.volume_shard_rows`: a shard's volumes stay in memory
    until it is written)."""
    if not spec.volume:
        return config.shard_size

    return volume_shard_rows(config.shard_size, sample_cfg.volume_size)


def _write_shards(config, records, cases_dir: Path, out_dir: Path, levels, thresholds, sample_cfg):
    from tqdm.auto import tqdm

    splits = ordered_splits(r.split for r in records)
    shards: dict[str, dict[str, list]] = {}
    counts: dict[str, dict[str, dict]] = {}
    unanswerable: dict[str, dict[str, list[int]]] = {}  # source -> probe -> [dropped, asked]
    for level in levels:
        spec = LEVEL_SPECS[level]
        shards[level], counts[level] = {}, {}
        for split in splits:
            recs = [r for r in records if r.split == split]
            n_rows = sum(r.rows[level] for r in recs)
            attrs = {"schema_version": SCHEMA_VERSION, "builder_version": __version__}
            if spec.shuffled:
                attrs["arrangement"] = sample_cfg.arrangement
            sink = ShardSink(out_dir, level, split, n_rows, _shard_rows(spec, config, sample_cfg), attrs,
                             compression=config.compression)
            classes: dict[str, Any] = {}
            n_q = 0
            for r in tqdm(recs, desc=f"{level}/{split}", unit="case", leave=False):
                check_stop()
                parts = (level, spec.questions) if spec.questions else (level,)
                res = load_case_result(cases_dir, _case_stem(r.source, r.case_id), parts)
                if spec.questions:
                    q = _screened(spec, level, res, thresholds, sample_cfg, unanswerable.setdefault(r.source, {}))
                    res[spec.questions] = q
                    n_q += _rows(q)
                    sink.add(res[level], q)
                else:
                    sink.add(res[level])
                _class_counts(level, res, classes)
            shards[level][split] = sink.close()
            counts[level][split] = {spec.unit: n_rows, "questions": n_q, "classes": classes}
    return shards, counts, unanswerable


def _screened(spec: LevelSpec, level: str, res: dict, thresholds, sample_cfg: SampleConfig,
              tally: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """One case's finished questions (the level's hooks), less those its hooks do not keep
    (Level 3: the pixel reader's answer is not the label); ``tally[probe]`` += [dropped, asked]."""
    from .samples.levels import level_hooks

    hooks = level_hooks(level)
    q = hooks.finalise(res[level], res[spec.questions], thresholds, sample_cfg)
    if not q or not _rows(q):
        return q
    keep = hooks.answerable(q, thresholds)
    for p, probe in enumerate(spec.probes):
        mine = np.asarray(q["q_probe"]) == p
        if mine.any():
            prev = tally.setdefault(probe, [0, 0])
            tally[probe] = [prev[0] + int((mine & ~keep).sum()), prev[1] + int(mine.sum())]
    return q if keep.all() else {k: v[keep] for k, v in q.items()}


def unanswerable_record(tally: dict[str, dict[str, list[int]]], levels: tuple[str, ...]) -> dict[str, Any] | None:
    """The manifest's ``unanswerable``: questions dropped because the pixel reader (the stored
    224 masks, docs/PROTOCOL.md §5) does not give their label, per probe and per source x probe."""
    probes = [p for lv in levels for p in LEVEL_SPECS[lv].probes if LEVEL_SPECS[lv].questions
              and not LEVEL_SPECS[lv].volume]
    if not probes:
        return None

    def entry(dropped: int, asked: int) -> dict[str, Any]:
        return {"dropped": dropped, "asked": asked, "share": round(dropped / asked, 6) if asked else 0.0}

    per_source = {src: {p: entry(*t[p]) for p in probes if p in t} for src, t in sorted(tally.items())}
    totals = {p: [sum(t.get(p, [0, 0])[i] for t in tally.values()) for i in (0, 1)] for p in probes}
    return {"rule": "dropped: the pixel answer (q_pixel_answer, from the stored 224 masks) is not the label",
            "per_probe": {p: entry(*totals[p]) for p in probes if totals[p][1]}, "per_source": per_source}


def _print_summary(counts: dict, skipped: list[dict], unanswerable: dict[str, Any] | None = None) -> None:
    click.echo(f"\n{'level':8} {'split':6} {'rows':>8} {'questions':>10}")
    for level, by_split in counts.items():
        for split, c in by_split.items():
            rows = c.get(LEVEL_SPECS[level].unit, 0)
            click.echo(f"{level:8} {split:6} {rows:>8} {c['questions']:>10}")
    for level, by_split in counts.items():
        spec = LEVEL_SPECS[level]
        if not (spec.mosaic or spec.volume):
            continue
        for split, c in by_split.items():
            present, n = c["classes"].get("present"), c.get(spec.unit, 0)
            if present and n:
                rare = sorted(range(N_ORGANS), key=lambda i: present[i])[:3]
                click.echo(f"  {level} {split}: {sum(present) / n:.1f} organs present per {spec.unit[:-1]}; "
                           "rarest " + ", ".join(f"{ORGANS[i]} {present[i] / n:.0%}" for i in rare))
    for level, by_split in counts.items():
        spec = LEVEL_SPECS[level]
        if not spec.questions:
            continue
        click.echo(f"\n{level} class balance (fraction per class):")
        for probe, names in zip(spec.probes, spec.classes, strict=True):
            for split, c in by_split.items():
                hist = c["classes"].get(probe)
                if not hist or not sum(hist):
                    continue
                fr = " ".join(f"{n}={h / sum(hist):.2f}" for n, h in zip(names, hist, strict=True))
                click.echo(f"  {probe:18} {split:6} n={sum(hist):<6} {fr}")
    if unanswerable:
        click.echo("\nlevel3 questions dropped as not answerable from the 224 masks (docs/PROTOCOL.md 5):")
        click.echo("  " + ", ".join(f"{p} {e['share']:.1%} ({e['dropped']}/{e['asked']})"
                                    for p, e in unanswerable["per_probe"].items()))
    if skipped:
        click.echo(f"\nskipped {len(skipped)} case(s):")
        for s in skipped:
            click.echo(f"  {s['source']}/{s['case_id']}: {s['reason']}")


def build(config: BuildConfig, *, quiet: bool = False) -> Path:
    """Run the whole pipeline; return the finished build (or partition) folder ``config.out``.

    ``OUT.lock`` keeps a second build away from OUT while this one runs; a full disk is one
    :class:`~spar_bench.outputs.DiskFullError` line (free space, then ``--resume``).
    """
    from spar_bench.locks import output_lock

    sample_cfg = _sample_config(config)
    if sample_cfg.counterfactual == "mirror+flip" and "level4" not in sample_cfg.levels and not quiet:
        click.echo(f"note: --counterfactual mirror+flip: the flipped copies are of Level 4 volumes, and the levels "
                   f"are {','.join(sample_cfg.levels)}; this build adds the mirrored copies only (as mirror)",
                   err=True)  # fmt: skip
    if "level4" in sample_cfg.levels:  # memory now, before anything is written
        from .samples.config import check_volume_size

        check_volume_size(sample_cfg.volume_size)
    refs, sources_info, origins = _find(config)  # reads only
    selection = [[r.source, r.case_id] for r, _, _ in refs]
    if config.partition:
        i, n = config.partition
        refs = [t for t in refs if partition_of(t[0].source, t[0].case_id, n) == i]
    with disk_full_is_an_error(config.out, rerun="rerun the same command with --resume"), \
            output_lock(config.out, what="build (spar-build)"):
        work, out = _prepare_dirs(config)  # refuses a bad OUT before anything is written
        with _failure_recorded(work):
            done = _run_cases(config, refs, work / "cases", sample_cfg.to_dict())
            ordered = [done[(r.source, r.case_id)] for r, _, _ in refs]
            if not config.partition:
                return write_outputs(config, ordered, sources_info, origins, work, out, quiet=quiet)

            path = finish_partition(config.recorded(), config.partition, selection, [r.to_json() for r in ordered],
                                    sources_info, origins, work, out)
    if not quiet:
        click.echo(f"partition {config.partition[0]}/{config.partition[1]}: {len(ordered)} "
                   f"of {len(selection)} cases")
    return path


def write_outputs(config: BuildConfig, ordered: list[CaseRecord], sources_info: dict[str, Any],
                  origins: dict, work: Path, out: Path, *, quiet: bool = False) -> Path:
    """Phase 2: thresholds over all cases, shards, HF folder, manifest; move ``work/out`` to ``out``.

    ``ordered`` holds every case's index record in ``(source, case_id)`` order; their spill
    files are in ``work/cases``.
    """
    from .writers.manifest import write_manifest

    sample_cfg = _sample_config(config)
    levels = tuple(lv for lv in LEVELS if lv in sample_cfg.levels)
    cases_dir = work / "cases"
    records = [r for r in ordered if r.ok]
    skipped = _skipped_cases(config, ordered)
    if not records:
        raise SparError(f"every case failed; first: {skipped[0]['reason'] if skipped else 'none found'}")
    sources_info = _published_sources(config, sources_info, records)
    if any(LEVEL_SPECS[lv].mosaic for lv in levels):  # which sources can give Level 1-2 samples
        from .writers.manifest import level12_reach

        for name, info in sources_info.items():
            info["level12"] = level12_reach(info.get("label_map") or {}, sample_cfg.l12_min_organs,
                                            [r.rows for r in records if r.source == name])
    th, th_origin = _thresholds(config, records, cases_dir, levels)
    out_dir = work / "out"
    shards, counts, dropped = _write_shards(config, records, cases_dir, out_dir, levels, th, sample_cfg)
    hf_info = None
    if config.hf:
        from .writers.hf import write_hf

        hf_info = write_hf(out_dir, shards, config=config, sample_config=sample_cfg.to_dict(),
                           sources=sources_info, workers=config.workers)
    manifest = json_safe(_manifest(
        config, sample_cfg, levels, sources_info, {"values": th, "origin": th_origin},
        shards=shards, hf_info=hf_info, counts=counts, records=records, origins=origins,
        skipped=skipped, unanswerable=unanswerable_record(dropped, levels),
    ))
    _refuse_local_paths(config, manifest, out_dir)
    write_manifest(out_dir, manifest)
    _replace_build(out_dir, out)
    shutil.rmtree(work)
    if not quiet:
        _print_summary(counts, skipped, manifest.get("unanswerable"))
    return out


def _skipped_cases(config: BuildConfig, ordered: list[CaseRecord]) -> list[dict[str, Any]]:
    """The manifest's ``skipped`` entries: source, case id, split and a portable reason."""
    roots = dict(zip(config.sources, config.roots, strict=True))
    return [{"source": r.source, "case_id": r.case_id, "split": r.split,
             "reason": _portable_text(r.reason, roots[r.source])}
            for r in ordered if not r.ok]


def _manifest(config: BuildConfig, sample_cfg: SampleConfig, levels: tuple[str, ...],
              sources_info: dict[str, Any], thresholds: dict[str, Any], *, shards, hf_info,
              counts, records: list[CaseRecord], origins: dict, skipped: list[dict],
              unanswerable: dict[str, Any] | None = None) -> dict[str, Any]:
    """The build's ``manifest.json`` record (before :func:`json_safe`)."""

    return {
        "schema_version": SCHEMA_VERSION,
        "protocol_version": PROTOCOL_VERSION,
        "builder_version": __version__,
        "config": config.published(),
        "seed": config.seed,
        "sample_config": sample_cfg.to_dict(),
        "levels": list(levels),
        "sources": sources_info,
        "thresholds": thresholds,
        "shards": shards,
        "hf": hf_info,
        "counts": counts,
        **({"unanswerable": unanswerable} if unanswerable else {}),
        "cases": [{**{k: getattr(r, k) for k in ("source", "case_id", "split", "patient_id",
                                                 "image_synthesized", "rows", "provenance")},
                   "split_origin": origins[(r.source, r.case_id)]}
                  for r in records],
        "skipped": skipped,
        "versions": package_versions(BUILD_PACKAGES),
    }


def _replace_build(out_dir: Path, out: Path) -> None:
    """Move the finished ``out_dir`` to ``out``, replacing an empty folder or an earlier build."""
    if out.exists():  # empty, or an earlier build that --overwrite / --resume may replace
        from .writers.manifest import owned_build

        claim(out, overwrite=True, owned=owned_build, what="build")
        remove(out)
    os.replace(out_dir, out)


def default_root(source: str) -> Path:
    """``$SPAR_DATA_<SOURCE>`` if set, else ``./data/<source>``."""
    env = f"SPAR_DATA_{source.upper()}"
    return Path(os.environ[env]) if os.environ.get(env) else Path("data") / source


def resolve_roots(sources: tuple[str, ...], roots: tuple[str, ...]) -> tuple[str, ...]:
    """One root per source; missing ones from :func:`default_root`; each must exist."""
    if roots and len(roots) != len(sources):
        raise ConfigError(f"give one --root per --source ({len(sources)} source(s), {len(roots)} root(s))")
    out = []
    for i, src in enumerate(sources):
        if roots:
            path = Path(roots[i])
            how = "--root"
        else:
            path = default_root(src)
            env = f"SPAR_DATA_{src.upper()}"
            how = f"${env}" if os.environ.get(env) else f"the default ./data/{src} (no ${env} set)"
        if not path.is_dir():
            raise ConfigError(
                f"source {src}: data folder {path.resolve()} does not exist (looked at {how}); "
                f"pass --root DIR or set SPAR_DATA_{src.upper()}=DIR"
            )
        out.append(str(path))
    return tuple(out)


def choice_options(options: dict[str, Any], sources: tuple[str, ...]) -> dict[str, Any]:
    """``--cases``, ``--limit``, ``--split-ratio``, ``--split-file`` as BuildConfig fields."""
    from .selection import parse_per_source, parse_ratio

    def ints(key: str, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--limit {key}={text!r}: not an integer") from None

    def ids(text: str) -> list[str]:
        if text.startswith("@"):
            path = Path(text[1:])
            if not path.is_file():
                raise ConfigError(f"--cases {text}: no such file")
            return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [c.strip() for c in text.split(",") if c.strip()]

    cases = parse_per_source(options.get("cases") or (), "--cases", sources)
    limit = parse_per_source(options.get("limit") or (), "--limit", sources)
    ratio = parse_per_source(options.get("split_ratio") or (), "--split-ratio", sources)
    return {
        "cases": {k: ids(v) for k, v in cases.items()},
        "limit": {k: ints(k, v) for k, v in limit.items()},
        "split_ratio": {k: parse_ratio(v) for k, v in ratio.items()},
        "split_file": options.get("split_file"),
    }


#: the options :func:`config_from_options` reads (``spar-build``'s, by parameter name): the
#: vocabulary of a build's options everywhere (the CLI, :data:`spar_bench.presets.Preset.build`,
#: an experiment file's ``builds.<b>.options``)
BUILD_OPTIONS = ("source", "root", "out", "levels", "volume_size", "samples_per_case", "l12_min_organs", "seed",
                 "jobs", "counterfactual", "images", "arrangement", "partition", "shard_size", "compression",
                 "thresholds_from", "fit_thresholds_on", "resume", "overwrite", "on_error", "no_hf", "cases",
                 "limit", "split_ratio", "split_file", "unknown_labels", "preset", "window")  # fmt: skip


def parse_window(value: Any) -> tuple[float, float]:
    """``--window LEVEL,WIDTH`` (HU; a text or a 2-list) as ``(level, width)``; one line if not."""
    parts = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else []
    try:
        level, width = (float(p) for p in parts)
    except (TypeError, ValueError):
        raise ConfigError(f"--window {value!r}: expected LEVEL,WIDTH in HU, e.g. 40,400 or 0,2000") from None
    if width <= 0:
        raise ConfigError(f"--window {value!r}: the width must be > 0 HU")
    return level, width


def config_from_options(options: dict[str, Any], explicit: set[str] | None = None) -> BuildConfig:
    """A :class:`BuildConfig` from ``spar-build``'s options (:data:`BUILD_OPTIONS`; absent ones
    take their defaults), with a ``preset``'s options filled in where ``explicit`` (the options
    given, default: every key of ``options``) has none."""
    unknown = sorted(set(options) - set(BUILD_OPTIONS) - {"preset_record"})
    if unknown:
        raise ConfigError(f"build options: unknown {', '.join(unknown)}; known: {', '.join(BUILD_OPTIONS)}")
    options = {k: options.get(k) for k in BUILD_OPTIONS} | {k: v for k, v in options.items() if k == "preset_record"}
    if options.get("preset"):
        from spar_bench.presets import apply_build_preset

        given = {k for k, v in options.items() if v is not None} if explicit is None else set(explicit)
        options, options["preset_record"] = apply_build_preset(options["preset"], options, given)
    if not options.get("out"):
        raise ConfigError("missing --out DIR (where the build is written); see spar-build --help")
    sources = tuple(options.get("source") or ())
    if not sources:
        raise ConfigError("missing --source NAME; list the sources with `spar-build sources`")

    from .sources import SOURCES

    for name in sources:  # names first: a typo is named before any folder is looked at
        SOURCES.check(name)
    sample: dict[str, Any] = {}
    if options.get("levels"):  # a comma list, or a list
        given = options["levels"].split(",") if isinstance(options["levels"], str) else options["levels"]
        sample["levels"] = [str(s).strip() for s in given if str(s).strip()]
    for opt in ("samples_per_case", "l12_min_organs", "arrangement", "counterfactual", "volume_size"):
        if options.get(opt) is not None:
            sample[opt] = options[opt]
    if options.get("window") is not None:  # the uint8 window of every level's images (HU)
        sample["window_level"], sample["window_width"] = parse_window(options["window"])
    return BuildConfig(
        sources=sources,
        roots=resolve_roots(sources, tuple(options.get("root") or ())),
        out=str(options["out"]),
        sample=sample,
        **_given_settings(options),
        thresholds_from=options.get("thresholds_from"),
        fit_thresholds_on=options.get("fit_thresholds_on"),
        resume=bool(options.get("resume")),
        overwrite=bool(options.get("overwrite")),
        hf=not options.get("no_hf"),
        partition=parse_partition(options.get("partition")),
        preset=options.get("preset_record"),
        **choice_options(options, sources),
    )


def _given_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The build settings among ``spar-build``'s options that were given (not None: 0 and "" are
    values); the others keep :class:`BuildConfig`'s defaults, which the command line shows."""
    ints = {"seed": "seed", "workers": "jobs", "shard_size": "shard_size"}
    given = {k: int(options[o]) for k, o in ints.items() if options.get(o) is not None}
    return given | {k: options[k] for k in ("images", "compression", "on_error", "unknown_labels")
                    if options.get(k) is not None}


def build_from_cli(options: dict[str, Any], explicit: set[str] | None = None) -> Path:
    """Entry point of ``spar-build`` without a subcommand (its options as click passes them,
    and those given on the command line)."""
    config = config_from_options(options, explicit)
    path = build(config)

    what = "partition" if config.partition else "build"
    click.echo(f"\n{what} written to {path}")
    return path
