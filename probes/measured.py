"""Which of an MLLM run's scores were measured: answers missing from an ``--answers`` file.

Another harness may leave out whole variants: VLMEvalKit's image datasets drop every row with
an empty ``image`` (``ImageBaseDataset.__init__`` in ``vlmeval/dataset/image_base.py``,
``skip_noimg=True`` by default), so a prediction file can hold no blind answer at all. Scored as
unanswered, such a variant would read 0 % as if measured. Here each variant's missing answers
are counted and a variant with more than :data:`MAX_MISSING_SHARE` of them missing is **not
measured**: its score in ``metrics.json`` is replaced by ``{"not_measured": <why>}`` (and named
in ``metrics.json``'s ``not_measured``), which every report prints as "not measured", never as a
number. A variant with every answer missing is refused (``spar-probe vqa --answers`` exits 2)
unless ``--accept-missing`` accepts it.
"""

from __future__ import annotations

from typing import Any

from spar_bench.errors import ConfigError

#: the share of a variant's answers that may be missing before its score is not measured
MAX_MISSING_SHARE = 0.05
#: the reason of a request that a file of answers has no answer for
MISSING = "missing"
NOT_MEASURED = "not measured"
#: how the reports mark answers another harness asked with its own prompt (:mod:`.answers`)
HARNESS_PROMPT = "harness prompt"
#: variant -> where its score sits in metrics.json
PLACES: dict[str, tuple[str, ...]] = {
    "plain": ("test",), "circular": ("controls", "circular"), "blind": ("controls", "blind"),
    "mirror": ("mirror",), "blind_mirror": ("controls", "blind_mirror"),
    "flipped": ("flipped",), "blind_flipped": ("controls", "blind_flipped")}  # fmt: skip


def variant_of_record(r: dict) -> str:
    """The variant an answer record (``answers.jsonl``) stands for (a key of :data:`PLACES`)."""
    copy = "mirror" if r.get("mirror") else "flipped" if r.get("flipped") else None
    if r["variant"] == "blind":
        return f"blind_{copy}" if copy else "blind"
    if copy:
        return copy
    return "plain" if int(r.get("rotation", 0)) == 0 else "circular"


def missing_by_variant(records: list[dict]) -> dict[str, tuple[int, int]]:
    """Variant -> (missing answers, answers) over the records that have any missing."""
    counts: dict[str, list[int]] = {}
    for r in records:
        c = counts.setdefault(variant_of_record(r), [0, 0])
        c[0] += r.get("reason") == MISSING
        c[1] += 1
    return {v: (m, n) for v, (m, n) in counts.items() if m}


def unmeasured(records: list[dict], source: str, accept: bool) -> dict[str, str]:
    """Variant -> why it is not measured (more than :data:`MAX_MISSING_SHARE` missing); a
    variant with every answer missing is refused in one line unless ``accept``."""
    out = {}
    for v, (m, n) in sorted(missing_by_variant(records).items()):
        if m == n and not accept:
            raise ConfigError(f"{source}: every {v.replace('_', ' ')} answer is missing ({m} of {n}): the file "
                              "has no answers for that variant (VLMEvalKit drops image-less rows: answer the "
                              "export's .blind.tsv too and pass both with --answers), or --accept-missing to "
                              "report it as not measured")
        if m > MAX_MISSING_SHARE * n:
            out[v] = f"{m} of {n} answers missing"
    return out


def mark_unmeasured(metrics: dict[str, Any], why: dict[str, str]) -> None:
    """Replace each unmeasured variant's score in ``metrics`` by ``{"not_measured": why}`` and
    list them in ``metrics["not_measured"]`` (in place; nothing when all are measured)."""
    for v, reason in why.items():
        *up, last = PLACES[v]
        d = metrics
        for k in up:
            d = d.setdefault(k, {})
        d[last] = {"not_measured": reason}
    if why:
        metrics["not_measured"] = dict(why)


def is_unmeasured(score: Any) -> bool:
    """Whether a metrics.json score is a not-measured marker (:func:`mark_unmeasured`)."""
    return isinstance(score, dict) and "not_measured" in score


#: report column (a row key of the reports) -> the variant whose answers it scores
COLUMNS = {"test": "plain", "mean": "plain", "circular": "circular", "circular_mean": "circular",
           "blind": "blind", "mirror": "mirror", "blind_mirror": "blind_mirror", "flipped": "flipped",
           "blind_flipped": "blind_flipped"}  # fmt: skip


def unmeasured_of(ms: list[dict]) -> set[str]:
    """The variants some run of ``ms`` (metrics.json dicts, one per seed) did not measure."""
    return {v for m in ms for v in (m.get("not_measured") or {})}


def shown(text: str, column: str, unmeasured) -> str:
    """``text``, or "not measured" when ``column`` scores a variant in ``unmeasured``."""
    return NOT_MEASURED if COLUMNS.get(column) in unmeasured else text


def is_harness_prompt(identity: dict | None) -> bool:
    """Whether a run's model identity records answers asked with another harness's prompt."""
    return isinstance(identity, dict) and str(identity.get("prompt", "")).startswith("harness")
