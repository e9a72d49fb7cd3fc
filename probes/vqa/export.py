"""``spar-build export``: a build's questions, with every control, as another harness reads them.

The rows are the item plan of ``spar-probe vqa`` (:func:`.ask.plan`): every original question
in each CircularEval rotation, its blind copy (no image) and the mirrored (Level 4: flipped)
counterfactual copies, each with the prompt text, option order and image (:func:`.ask.shown_requests`)
the ``vqa`` command sends. So a score from the other harness, read back with ``spar-probe vqa
--answers`` (:mod:`.answers`), goes through the one pipeline of every control.

* ``vlmevalkit``: ``DIR/<probe>.tsv`` in VLMEvalKit's ``CustomMCQDataset`` format (``index``,
  ``image`` (base64 PNG), ``question``, ``A``.., ``answer``, ``category`` = the variant,
  ``l2-category`` = the probe) plus the ``spar_*`` columns that name each row's question; the
  rows without an image (blind, mirror-blind, flipped-blind) go to ``DIR/<probe>.blind.tsv``,
  the same columns but no ``image`` column. VLMEvalKit drops a row whose ``image`` is empty:
  ``ImageBaseDataset.__init__`` (``vlmeval/dataset/image_base.py``) keeps
  ``data[~pd.isna(data['image'])]`` under its default ``skip_noimg=True``, and pandas reads an
  empty TSV field as NaN. A TSV with options but neither ``image`` nor ``image_path`` is built
  by ``build_dataset`` (``vlmeval/dataset/__init__.py``) as a ``CustomTextMCQDataset``
  (``vlmeval/dataset/text_mcq.py``), which keeps every row and asks the text alone;
* ``lmms-eval``: ``DIR/<probe>/`` -- a task per variant (``spar_<level>_<probe>_<variant>``),
  a group over them (``spar_<level>_<probe>``), ``docs.jsonl``, ``images/`` and a ``utils.py``
  whose ``process_results`` reads the answer with SPAR-Bench's own parser (``lmms-eval
  --include_path DIR``, from any working folder: :mod:`.lmms_template`). The folder is not named
  like the group: lmms-eval reads a ``--tasks`` name that is a folder of the working directory
  as that folder's YAML files, which loads every task twice and as a plain-model task.

Beside each probe's files ``<name>.json`` records the protocol version, the build's
fingerprint, the template version, the asking options, the rows per variant and the files'
sha256 (no local path). The export is written into ``DIR.tmp`` and renamed to ``DIR`` when
whole; ``DIR`` must be new or empty.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import shutil
import string
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spar_bench import __version__
from spar_bench.errors import ConfigError
from spar_bench.outputs import check_target
from spar_bench.provenance import PROTOCOL_VERSION, protocol_versions

from ..tasks import get_probe
from .ask import AskConfig, Item, plan, shown_requests
from .base import Request
from .options import check_build, resolve_image_size, resolve_volume_as
from .questions import Questions, load_questions

FORMATS = ("vlmevalkit", "lmms-eval")
#: columns naming a row's question (``spar-probe vqa --answers`` matches on the first three)
SPAR_COLUMNS = ("spar_key", "spar_variant", "spar_prompt_sha256", "spar_rotation", "spar_order",
                "spar_probe", "spar_config", "spar_build", "spar_protocol")
CHUNK = 64


@dataclass(frozen=True)
class ExportRow:
    """One exported request: its item, category (variant label), request and spar fields."""

    index: int
    category: str
    answer: str
    request: Request
    spar: dict[str, Any]


def category(qs: Questions, it: Item) -> str:
    """The variant a row stands for: ``plain``, ``circular-<r>``, ``blind``, ``mirror``,
    ``mirror-blind``, ``flipped``, ``flipped-blind``."""
    copy = "mirror" if qs.is_mirror[it.q] else "flipped" if qs.is_flipped[it.q] else None
    if copy:
        return copy + ("-blind" if it.variant == "blind" else "")
    if it.variant == "blind":
        return "blind"
    return "plain" if it.rotation == 0 else f"circular-{it.rotation}"


def config_text(cfg: AskConfig) -> str:
    """The asking options a row was made with (compact JSON): ``--answers`` rebuilds the plan from it."""
    d = {"splits": list(cfg.splits), "convention_hint": cfg.hint, "circular": cfg.circular,
         "blind": cfg.blind, "image_size": cfg.image_size, "volume_as": cfg.volume_as}
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def config_of(text: str) -> AskConfig:
    """The :class:`AskConfig` of a row's ``spar_config``."""
    d = json.loads(text)
    return AskConfig(tuple(d["splits"]), bool(d["convention_hint"]), bool(d["circular"]), bool(d["blind"]),
                     int(d["image_size"]), volume_as=str(d["volume_as"]))


def prompt_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def export_rows(build, qs: Questions, cfg: AskConfig) -> Iterator[ExportRow]:
    """Every item of ``vqa``'s plan for ``qs`` as a row, in plan order (index 0, 1, ...)."""

    items = plan(qs, cfg)
    names = qs.spec.class_names
    kept: dict = {}
    conf = config_text(cfg)
    for lo in range(0, len(items), CHUNK):
        part = items[lo:lo + CHUNK]
        for k, (it, req) in enumerate(zip(part, shown_requests(build, qs, part, cfg, kept), strict=True)):
            truth = int(qs.answer[it.q])
            spar = {"spar_key": str(qs.key[it.q]), "spar_variant": it.variant,
                    "spar_prompt_sha256": prompt_sha256(it.prompt.text), "spar_rotation": it.rotation,
                    "spar_order": ",".join(map(str, it.prompt.order)), "spar_probe": qs.spec.name,
                    "spar_config": conf, "spar_build": build.fingerprint, "spar_protocol": PROTOCOL_VERSION}
            yield ExportRow(lo + k, category(qs, it), it.prompt.letters[it.prompt.order.index(truth)], req,
                            {**spar, "spar_truth": names[truth]})


def png_bytes(img) -> bytes:
    """PNG bytes of a PIL image (deterministic)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- VLMEvalKit
def vlmevalkit_header(n_options: int) -> list[str]:
    letters = list(string.ascii_uppercase[:n_options])
    return ["index", "image", "question", *letters, "answer", "category", "l2-category", *SPAR_COLUMNS]


def blind_tsv(path: Path) -> Path:
    """``<probe>.blind.tsv`` beside ``<probe>.tsv``: the rows asked without an image."""
    return path.with_name(path.stem + ".blind.tsv")


def write_vlmevalkit(rows: Iterator[ExportRow], path: Path, n_options: int, probe: str) -> Counter:
    """``path``: VLMEvalKit's MCQ TSV of the rows with an image; :func:`blind_tsv`: the rows
    without one, with no ``image`` column (VLMEvalKit's text MCQ dataset, which keeps them: see
    the module doc); the rows per category. The blind file is written only when it has rows."""
    counts: Counter = Counter()
    head = vlmevalkit_header(n_options)
    blind = blind_tsv(path)
    with path.open("w", encoding="utf-8", newline="") as f, blind.open("w", encoding="utf-8", newline="") as fb:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        wb = csv.writer(fb, delimiter="\t", lineterminator="\n")
        w.writerow(head)
        wb.writerow([c for c in head if c != "image"])
        for row in rows:
            r = row.request
            if r.frames is not None:  # export_build refuses video before anything is written
                raise ConfigError("a VLMEvalKit TSV holds one image per question, not video frames")
            tail = [r.text, *r.options, row.answer, row.category, probe, *(row.spar[c] for c in SPAR_COLUMNS)]
            if r.image is None:
                wb.writerow([row.index, *tail])
            else:
                w.writerow([row.index, base64.b64encode(png_bytes(r.image)).decode("ascii"), *tail])
            counts[row.category] += 1
    if not any(c.endswith("blind") for c in counts):
        blind.unlink()
    return counts


# --------------------------------------------------------------------------- lmms-eval
def task_name(probe: str) -> str:
    """``spar_level3_size`` of ``level3.size``."""
    return "spar_" + probe.replace(".", "_")


def write_lmms_docs(rows: Iterator[ExportRow], folder: Path) -> Counter:
    """``folder/docs.jsonl`` (one document per row) and ``folder/images/`` (PNG files)."""
    counts: Counter = Counter()
    (folder / "images").mkdir(parents=True, exist_ok=True)
    with (folder / "docs.jsonl").open("w", encoding="utf-8") as f:
        for row in rows:
            r = row.request
            shown = [r.image] if r.image is not None else list(r.frames or ())
            files = []
            for img in shown:  # each distinct image stored once, named by its content
                data = png_bytes(img)
                name = f"images/{hashlib.sha256(data).hexdigest()[:20]}.png"
                if not (folder / name).is_file():
                    (folder / name).write_bytes(data)
                files.append(name)
            doc = {"index": row.index, "question": r.text, "letters": list(r.letters), "options": list(r.options),
                   "answer": row.answer, "category": row.category, "images": files, **row.spar}
            f.write(json.dumps(doc, sort_keys=True) + "\n")
            counts[row.category] += 1
    return counts


def write_lmms_tasks(folder: Path, base: str, counts: Counter, max_new_tokens: int = 64) -> list[str]:
    """One task YAML per variant (``<base>_<variant>``) and the group YAML (``base``); returns
    the task names."""
    from .lmms_template import group_yaml, task_yaml, utils_py

    tasks = []
    for cat in sorted(counts):
        name = f"{base}_{cat.replace('-', '_')}"
        (folder / f"{name}.yaml").write_text(task_yaml(name, cat, max_new_tokens), encoding="utf-8")
        tasks.append(name)
    (folder / f"{base}.yaml").write_text(group_yaml(base, tasks), encoding="utf-8")
    (folder / "utils.py").write_text(utils_py(sorted(counts)), encoding="utf-8")
    return tasks


# --------------------------------------------------------------------------- one export
def provenance(build, qs: Questions, cfg: AskConfig, fmt: str, counts: Counter, files: dict[str, str]) -> dict:
    return {"format": fmt, "probe": qs.spec.name, "spar_bench": __version__,
            "protocol": protocol_versions(build.manifest), "build": Path(build.root).resolve().name,
            "build_fingerprint": build.fingerprint, "template_version": plan(qs, cfg)[0].prompt.version,
            "config": json.loads(config_text(cfg)), "rows": sum(counts.values()), "variants": dict(sorted(counts.items())),
            "files": files}  # fmt: skip


def export_probe(build, probe: str, cfg: AskConfig, fmt: str, out: Path) -> Path | None:
    """Export ``probe``'s questions of ``build`` as ``fmt`` into ``out``; returns the provenance
    JSON written (None: no questions on the splits)."""

    qs = load_questions(build, get_probe(probe), list(cfg.splits))
    if not qs.original.any():
        return None
    rows = export_rows(build, qs, cfg)
    if fmt == "vlmevalkit":
        tsv = out / f"{probe}.tsv"
        counts = write_vlmevalkit(rows, tsv, qs.spec.n_classes, probe)
        files = {p.name: sha256_file(p) for p in (tsv, blind_tsv(tsv)) if p.is_file()}
        meta = out / f"{probe}.json"
    else:
        folder = out / probe
        counts = write_lmms_docs(rows, folder)
        write_lmms_tasks(folder, task_name(probe), counts)
        files = {p.relative_to(out).as_posix(): sha256_file(p) for p in sorted(folder.glob("*")) if p.is_file()}
        meta = folder / "export.json"
    meta.write_text(json.dumps(provenance(build, qs, cfg, fmt, counts, files), indent=2, sort_keys=True) + "\n",
                    encoding="utf-8")
    return meta


def export_build(data: str, out: str | Path, fmt: str, opts) -> list[tuple[str, Path | None]]:
    """``spar-build export``: every question probe of build ``data`` that ``opts`` (a
    :class:`~.options.VqaOptions`) names, as ``fmt``, into ``out``; ``(probe, provenance JSON or None)``."""

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    build, probes, splits = check_build(data, opts)
    if fmt == "vlmevalkit" and opts.volume_as == "video":
        raise ConfigError("--volume-as video: a VLMEvalKit TSV holds one image per question; export Level 4 "
                          "volumes as montage or views (--volume-as montage), or as lmms-eval tasks")
    cfg = AskConfig(splits, opts.convention_hint, opts.circular, opts.blind,
                    resolve_image_size(str(opts.image_size), None), 0, opts.n_boot,
                    resolve_volume_as(opts.volume_as, None))  # fmt: skip
    out = Path(out)
    check_target(out, inputs=[data])
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists and is not empty; export into a new folder")
    work = out.with_name(out.name + ".tmp")  # written whole, then renamed: no half export is left
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    done = [(p, export_probe(build, p, cfg, fmt, work)) for p in probes]
    if out.exists():
        out.rmdir()
    work.rename(out)
    return [(p, None if m is None else out / m.relative_to(work)) for p, m in done]
