"""One report for a whole experiment (``spar-bench run``): the paper's tables as the paper lays
them out.

:func:`write_experiment_report` reads every run under RUNS (any depth; each run folder holds
``metrics.json``, ``config.json`` and perhaps ``eval-<target>.json``) through
:func:`spar_bench.probes.runs.report.collect` and writes to ``out``:

* ``experiment.md``: the runner's provenance (experiment, file hash, plan hash, versions); a
  banner when any run used random-init features; the **main table** (one row per
  configuration = encoder x mode x head [options], one column per probe in
  :func:`~spar_bench.probes.tasks.probe_names` order; each cell the headline as
  ``mean +- std [mean 95% CI]`` over seeds, rates in %), each configuration followed by its
  ``blind`` sub-row (the same head without the image: recall vs computation), frozen,
  finetuned and from-scratch rows of one encoder and head side by side; the controls
  (chance, majority, prior) per probe; the mirrored counterfactual laid out like the main
  table, and for Level 4 (volumes, whose probes are columns after Level 3's) the
  superior-inferior flipped counterfactual likewise; one **zero-shot transfer** table per transfer target (``eval-*.json``); the
  **MLLM** table (``spar-probe vqa`` runs: the question probes, Levels 3 and 4, blind,
  CircularEval, parse rate); per MLLM probed by stage (``mllm:DIR@STAGE`` caches), a **stage
  table**: per probe the heads and their blind baseline at each stage beside the model's own
  VQA answer and blind VQA (also ``stages`` in experiment.json, and plotted in ``stages.png``);
  and the **provenance** of every cell (run folders relative to RUNS, build and cache
  fingerprints, weights digest, protocol version);
* ``experiment.json``: the same numbers and every run's provenance, machine-readable;
* ``experiment.png``: the headline per probe per configuration with CI error bars.

Modes: ``frozen`` (a head on cached features), ``finetuned`` / ``scratch`` (``spar-probe
finetune``: encoder and head trained end to end), ``finetuned (frozen head)`` /
``scratch (frozen head)`` (a head fitted on a cache of such a trained encoder's export) and
``MLLM`` (``track`` = ``vqa``). Runs pruned by ``sweep --grid-prune`` are left out. The same
runs give byte-identical files (everything sorted, no time stamp, no absolute path).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError
from spar_bench.outputs import write_bytes
from spar_bench.probes.measured import (
    HARNESS_PROMPT,
    MAX_MISSING_SHARE,
    NOT_MEASURED,
    unmeasured_of,
)
from spar_bench.probes.runs.record import RunRecord
from spar_bench.probes.runs.report import collect, random_init_banner, run_protocol, with_spread
from spar_bench.probes.tasks import METRICS, PROBE_SPECS, get_probe, probe_names
from spar_bench.provenance import json_safe, local_paths, local_prefixes, portable_path

from .html import HTML_FILE, fmt, metric_label, write_html
from .html import distinct as _distinct
from .html import get_path as _get
from .leaderboard import CSV_FILE as LEADERBOARD_CSV
from .leaderboard import JSON_FILE as LEADERBOARD_JSON
from .leaderboard import paper_refs, ref_text, write_leaderboard

GENERATOR = "spar-bench run (experiment report)"
MD_FILE, JSON_FILE, PNG_FILE = "experiment.md", "experiment.json", "experiment.png"
#: the stage plot, written when an MLLM was probed by stage
STAGES_PNG = "stages.png"
#: modes in the order rows of one encoder and head are shown (MLLM rows come last)
MODES = ("frozen", "finetuned", "scratch", "finetuned (frozen head)", "scratch (frozen head)", "MLLM")
#: Level 3 extras of an MLLM row: label -> path in metrics.json (a rate)
VQA_ROWS: dict[str, tuple[str, ...]] = {"circular (strict)": ("controls", "circular", "strict"),
                                        "parse rate": ("controls", "parse_rate")}  # fmt: skip


@dataclass(frozen=True, order=True)
class Configuration:
    """One row of the paper's tables: an encoder (or MLLM) in a mode with a head."""

    encoder: str
    head: str
    mode: str
    options: str = ""  # the run folder's variant (non-default options), "" for defaults
    build: str = ""  # the build it was trained on (shown when an experiment has several)
    random_init: bool = False
    #: which features of the encoder (:func:`encoder_tag`: weights hash, per-tile, reduced tokens ...)
    tag: str = ""

    def sort_key(self) -> tuple:
        return (self.mode == "MLLM", self.encoder, self.head, MODES.index(self.mode)
                if self.mode in MODES else len(MODES), self.mode, self.tag, self.options, self.build)  # fmt: skip

    def label(self) -> str:
        return self.encoder + (f" [{self.tag}]" if self.tag else "") + (
            " **(random-init)**" if self.random_init and self.mode == "frozen" else "")


@dataclass
class Run:
    """One finished run: its metrics, record (config.json) and folder relative to RUNS."""

    metrics: dict[str, Any]
    record: RunRecord
    rel: str
    evals: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- reading
def load_runs(runs: Path) -> list[Run]:
    """Every finished, unpruned run under ``runs`` with its config.json and eval files."""
    out = []
    for m in collect(runs):
        if _get(m, "train", "pruned_at") is not None:
            continue
        rd = Path(m.pop("_dir"))
        rel = portable_path(rd, runs) or rd.name
        config = RunRecord.read(rd) if (rd / "config.json").is_file() else RunRecord.from_dict(
            {k: m.get(k) for k in ("probe", "head", "seed", "track")}, rd / "metrics.json")
        names = [p.stem.removeprefix("eval-") for p in sorted(rd.glob("eval-*.json"))]
        evals = [{**e, "_file": f"eval-{n}.json", "_name": n} for n, e in zip(names, m.pop("_evals"), strict=True)]
        out.append(Run(m, config, rel, evals))
    if not out:
        raise ConfigError(f"{runs}: only runs pruned by `sweep --grid-prune`; nothing to report")
    return sorted(out, key=lambda r: r.rel)


def mode_of(m: dict, rec: RunRecord) -> str:
    """The run's kind as the report names it (see the module doc): frozen, ``<mode> (frozen head)``
    (a head on a trained encoder's export), finetuned or scratch, MLLM, or the kind itself
    (``prior``, ``oracle``, a plug-in's)."""
    trained = _get(m, "training", "mode")
    if rec.kind == "mllm":
        return "MLLM"
    if rec.kind == "finetune":
        return str(trained or "finetuned")
    if rec.kind != "head":
        return rec.kind
    return f"{trained} (frozen head)" if trained else "frozen"


def configuration(r: Run) -> Configuration:
    m, c = r.metrics, r.record
    mode = mode_of(m, c)
    encoder = c.model
    options = [str(m["variant"])] if m.get("variant") else []
    splits = [str(x) for x in m.get("splits") or ["test"]]
    if splits != ["test"]:  # an MLLM asked other splits: never pooled with test scores
        options.append("splits=" + "+".join(splits))
    build = str(c.build or "")
    if c.build_fingerprint:  # two builds may share a folder name
        build += f" ({str(c.build_fingerprint)[:12]})"
    encoder = str(encoder or m["encoder"])
    return Configuration(encoder=encoder, head=str(m["head"]), mode=mode, options="; ".join(options),
                         build=build, random_init=bool(m.get("random_init")) and mode != "MLLM",
                         tag="" if mode == "MLLM" else encoder_tag(encoder, m, c))  # fmt: skip


def encoder_tag(encoder: str, m: dict, c: RunRecord) -> str:
    """What tells apart two runs of one encoder name: for a head on cached features, the run
    folder's encoder slug past the name (``1a2b3c4d``: a weights file's hash; ``per-tile``;
    reduced tokens; ``<mode>-<build>-frozen``: a trained encoder's export; ``-random-init``
    dropped: the row says so); for a finetune run, the hash of its initial weights file."""
    hashed = "@" in encoder  # a local model's name already carries its hash
    if c.kind == "finetune":
        w = c.get("weights") if isinstance(c.get("weights"), dict) else {}
        sha = w.get("sha256") if w.get("kind") in ("file", "dir") else None
        return str(sha)[:8] if sha and not hashed else ""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", encoder).strip("-")
    slug = str(m.get("encoder") or "").removesuffix("-random-init")
    training = m.get("training") if isinstance(m.get("training"), dict) else {}
    if training:  # the mode's column says how the export was trained
        trained = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{training.get('mode')}-{training.get('build')}")
        slug = slug.replace(f"-{trained}-frozen", "")
    return (slug[len(base):] if slug.startswith(base) else slug).strip("-")


def grid(runs: list[Run]) -> dict[Configuration, dict[str, list[Run]]]:
    """Configuration -> probe -> its runs (one per seed); two runs of one seed are an error."""
    out: dict[Configuration, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        cell = out[configuration(r)][r.metrics["probe"]]
        twin = next((o for o in cell if o.metrics["seed"] == r.metrics["seed"]), None)
        if twin is not None:
            raise ConfigError(f"runs {twin.rel} and {r.rel}: the same configuration, probe and seed "
                              f"{r.metrics['seed']} twice; remove one of them")  # fmt: skip
        cell.append(r)
    return {k: {p: sorted(v, key=lambda r: r.metrics["seed"]) for p, v in out[k].items()}
            for k in sorted(out, key=Configuration.sort_key)}  # fmt: skip


def is_volume(probe: str) -> bool:
    """Whether ``probe`` is asked of whole volumes (Level 4)."""
    return probe in PROBE_SPECS and LEVEL_SPECS[get_probe(probe).level].volume


def ordered_probes(names: set[str]) -> list[str]:
    known = probe_names()
    return [p for p in known if p in names] + sorted(names - set(known))


# --------------------------------------------------------------------------- statistics
def headline_of(probe: str, ms: list[dict]) -> tuple[str, bool]:
    """The probe's headline metric and whether it is shown in %."""
    key = get_probe(probe).headline if probe in PROBE_SPECS else str(ms[0].get("headline"))
    return key, bool(METRICS[key].percent) if key in METRICS else False


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and bool(np.isfinite(x))


def summary(scores: list[dict | None], key: str) -> dict[str, Any] | None:
    """Mean, std (ddof 1; 0 for one seed) of ``key`` over ``scores`` (one per seed) and the mean
    of their 95 % CI bounds; None when no score holds it."""
    kept = [s for s in scores if isinstance(s, dict) and _finite(s.get(key))]
    if not kept:
        return None
    v = np.array([s[key] for s in kept], dtype=np.float64)
    cis = [_get(s, "ci", key) for s in kept]
    cis = [c for c in cis if isinstance(c, list | tuple) and len(c) == 2 and all(_finite(x) for x in c)]
    lo_hi = np.array(cis, dtype=np.float64).mean(axis=0).tolist() if cis else [None, None]
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
            "ci_low": lo_hi[0], "ci_high": lo_hi[1], "n": int(v.size)}  # fmt: skip


def rate(values: list[Any]) -> dict[str, Any] | None:
    """Mean and std over seeds of plain numbers (chance, parse rate ...)."""
    return summary([{"x": v} for v in values], "x")


def cell_stats(probe: str, rs: list[Run], targets: dict[str, str]) -> dict[str, Any]:
    """Everything the tables show of one configuration x probe."""
    ms = [r.metrics for r in rs]
    key, pct = headline_of(probe, ms)
    out: dict[str, Any] = {"metric": key, "percent": pct, "seeds": [m["seed"] for m in ms],
                           "test": summary([m.get("test") for m in ms], key),
                           "blind": summary([_get(m, "controls", "blind") for m in ms], key),
                           "mirror": summary([m.get("mirror") for m in ms], key),
                           "chance": rate([_get(m, "controls", "chance") for m in ms]),
                           "majority": rate([_get(m, "controls", "majority") for m in ms]),
                           "prior": summary([_get(m, "controls", "prior") for m in ms], key)}  # fmt: skip
    if any("flipped" in m for m in ms):  # Level 4: the superior-inferior flipped copies
        out["flipped"] = summary([m.get("flipped") for m in ms], key)
    conflict = summary([_get(m, "test", "conflict") for m in ms], "accuracy")
    if conflict:  # question probes: the items whose answer in the image is not the prior's
        out["conflict"] = conflict
        out["conflict_blind"] = summary([_get(m, "controls", "blind", "conflict") for m in ms], "accuracy")
    if any(m.get("track") == "vqa" for m in ms):
        out.update({label: rate([_get(m, *path) for m in ms]) for label, path in VQA_ROWS.items()})
    transfer: dict[str, Any] = {}
    for tid in targets:
        evs = [e for r in rs for e in r.evals if target_id(e) == tid]
        if evs:
            transfer[tid] = {"test": summary([e.get("test") for e in evs], key),
                             "chance": rate([_get(e, "controls", "chance") for e in evs]),
                             "prior": summary([_get(e, "controls", "prior") for e in evs], key)}  # fmt: skip
    out["transfer"] = transfer
    patients = [_get(m, "n_patients", "test") for m in ms]
    if all(isinstance(n, int) for n in patients) and patients:
        out["patients"] = min(patients)  # the test patients each interval is bootstrapped over
    out["flags"] = quality_flags(probe, ms, out)
    mark_cells(out, ms)
    out["runs"] = [run_provenance(r) for r in rs]
    out["paper"] = paper_refs(rs[0].rel.split("/")[0], str(ms[0]["head"]), probe, "test")
    return out


def quality_flags(probe: str, ms: list[dict], cell: dict[str, Any]) -> list[str]:
    """What makes a cell's numbers weaker than they look (report.md's marks, per cell): a
    trained blind head below the prior, seeds stopped by the epoch cap, random-init features,
    answers missing or asked with another harness's prompt, few test patients."""
    flags = []
    spec = get_probe(probe) if probe in PROBE_SPECS else None
    blind, prior = (_get(cell, k, "mean") for k in ("blind", "prior"))
    if spec is not None and spec.prior_bounds_blind and ms[0].get("track", "probe") == "probe" \
            and spec.worse(blind, prior):
        flags.append("blind head below the prior: under-trained, image scores flattered")
    capped = sum(_get(m, "train", "stopped_by") == "max_epochs" for m in ms)
    if capped:
        flags.append(f"{capped} of {len(ms)} seeds stopped by the epoch cap while still improving")
    if any(m.get("random_init") for m in ms):
        flags.append("random-init features: shows only that the pipeline runs")
    gone = unmeasured_of(ms)
    if gone:
        flags.append(f"{NOT_MEASURED}: {', '.join(sorted(gone))} (answers missing)")
    if any(m.get("prompt") == "harness" for m in ms):
        flags.append(f"{HARNESS_PROMPT}: asked with another harness's prompt, not vqa's")
    n = [_get(m, "n_patients", "test") for m in ms]
    if n and all(isinstance(x, int) for x in n) and min(n) < 10:
        flags.append(f"intervals over {min(n)} test patients only")
    return flags


#: cell key -> the MLLM variant whose answers it scores (:mod:`spar_bench.probes.measured`)
CELL_VARIANTS = {"test": "plain", "conflict": "plain", "blind": "blind", "conflict_blind": "blind",
                 "mirror": "mirror", "flipped": "flipped", "circular (strict)": "circular"}  # fmt: skip


def mark_cells(out: dict[str, Any], ms: list[dict]) -> None:
    """Each cell of a variant some seed did not measure (answers missing from an ``--answers``
    file) becomes ``{"not_measured": True}``, printed "not measured", never a number; a cell of
    answers asked with another harness's prompt gets ``harness_prompt``."""
    gone = unmeasured_of(ms)
    for key, variant in CELL_VARIANTS.items():
        if variant in gone and key in out:
            out[key] = {"not_measured": True}
    if gone:
        out["not_measured"] = sorted(gone)
    if any(m.get("prompt") == "harness" for m in ms):
        out["harness_prompt"] = True


def target_id(e: dict) -> str:
    """A transfer target is its build: by fingerprint when the eval records one, else by name."""
    fp = e.get("dataset_fingerprint") or e.get("cache_fingerprint")
    return str(fp)[:12] if fp else f"name:{e['_name']}"


def transfer_targets(runs: list[Run]) -> dict[str, str]:
    """Target id -> its label: the build's folder name where an eval records it (``data``: a
    finetune run re-encoding the build), else the stems of the caches of it (``features``)."""
    builds: dict[str, set[str]] = defaultdict(set)
    caches: dict[str, set[str]] = defaultdict(set)
    for r in runs:
        for e in r.evals:
            if e.get("data"):
                builds[target_id(e)].add(str(e["data"]))
            else:
                caches[target_id(e)].add(Path(str(e.get("features") or e["_name"])).stem)
    labels = {t: " / ".join(sorted(builds.get(t) or caches[t])) for t in {*builds, *caches}}
    return dict(sorted(labels.items(), key=lambda kv: (kv[1], kv[0])))


# --------------------------------------------------------------------------- provenance
def describe_weights(w: dict) -> str:
    """A weights record in a few words: file/dir name + sha256 (12 hex), hub repo @ revision,
    random-init, or a kind with its plain fields (an MLLM's identity)."""
    kind = str(w.get("kind") or "?")
    if w.get("sha256"):
        return f"{w.get('name') or kind} sha256:{str(w['sha256'])[:12]}"
    if kind == "hub":
        return f"{w.get('repo')}@{w.get('revision') or 'unpinned'}"
    extra = ",".join(f"{k}={w[k]}" for k in sorted(w) if k not in ("kind", "note") and w[k] is not None
                     and not isinstance(w[k], dict | list))  # fmt: skip
    return kind + (f" ({extra})" if extra else "")


def weights_digest(c: RunRecord, m: dict) -> str:
    """The weights behind a run (config ``c``, metrics ``m``): those recorded in its config
    (a finetune run's initial weights: ``init ...``; its trained encoder is its own export), an
    MLLM's identity, for a head on a trained encoder's export how that encoder was trained,
    else ``random-init`` or ``not recorded``."""
    w = c.get("weights") or _get(c.extra, "encoder_config", "weights")
    if isinstance(w, dict):
        return ("init " if c.kind == "finetune" else "") + describe_weights(w)
    if isinstance(c.get("model_identity"), dict):
        return describe_weights(c.get("model_identity"))
    training = m.get("training")
    if isinstance(training, dict):
        init = training.get("init_weights")
        return f"{training.get('label') or training.get('mode')}" + (
            f", init {describe_weights(init)}" if isinstance(init, dict) else "")
    if m.get("random_init"):
        return "random-init"
    # fit's config.json holds no weights record; a local file's or folder's hash is in the names
    found = re.search(r"@([0-9a-f]{8})$", str(c.model or "")) or re.search(
        r"-([0-9a-f]{8})(?:-|$)", str(m.get("encoder") or ""))
    return f"sha256:{found.group(1)} (8 hex, from the encoder name)" if found else "not recorded"


def _fp(v: Any) -> str | None:
    return str(v)[:12] if v else None


def run_provenance(r: Run) -> dict[str, Any]:
    """One run's provenance: folder (relative to RUNS), fingerprints, weights, protocol, evals."""
    c, m = r.record, r.metrics
    return {"run": r.rel, "seed": m["seed"], "build": c.build,
            "build_fingerprint": _fp(c.build_fingerprint),
            "cache": c.get("features"), "cache_fingerprint": _fp(c.get("cache_fingerprint")),
            "weights": weights_digest(c, m), "trained_on": _get(m, "training", "build"),
            "protocol_version": run_protocol(m), "build_protocol_version": m.get("build_protocol_version"),
            "evals": [{"file": f"{r.rel}/{e['_file']}", "target": target_id(e),
                       "fingerprint": _fp(e.get("dataset_fingerprint") or e.get("cache_fingerprint"))}
                      for e in r.evals]}  # fmt: skip


# --------------------------------------------------------------------------- formatting
def fmt_summary(s: dict | None, pct: bool, *, ci: bool = True, n_row: int | None = None) -> str:
    """``mean +- std [low, high]`` (paper style; one seed: its value, no spread); `` (n=k)`` when
    fewer seeds than the row."""
    if not s:
        return "-"
    if s.get("not_measured"):
        return NOT_MEASURED
    text = with_spread(fmt(s["mean"], pct), fmt(s["std"], pct), s.get("n") or 1)
    if ci and s.get("ci_low") is not None:
        text += f" [{fmt(s['ci_low'], pct)}, {fmt(s['ci_high'], pct)}]"
    return text + (f" (n={s['n']})" if n_row is not None and s.get("n", n_row) < n_row else "")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|")


# --------------------------------------------------------------------------- the tables
def aggregate(runs: list[Run]) -> dict[str, Any]:
    """The report's numbers: probes, transfer targets, and per configuration its cells."""
    table = grid(runs)
    probes = ordered_probes({r.metrics["probe"] for r in runs})
    targets = transfer_targets(runs)
    rows = []
    for cfg, cells in table.items():
        stats = {p: cell_stats(p, cells[p], targets) for p in probes if p in cells}
        rows.append({**asdict(cfg), "seeds": sorted({s for c in stats.values() for s in c["seeds"]}),
                     "cells": stats})  # fmt: skip
    return {"probes": probes, "transfer_targets": targets, "configurations": rows,
            "random_init_used": any(r.metrics.get("random_init") for r in runs), "n_runs": len(runs)}


def _n_seeds(row: dict) -> str:
    ns = sorted({len(c["seeds"]) for c in row["cells"].values()})
    return str(ns[0]) if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"


def _max_seeds(row: dict) -> int:
    return max(len(c["seeds"]) for c in row["cells"].values())


def _key_cells(row: dict, builds: bool) -> list[str]:
    cfg = Configuration(**{k: row[k] for k in ("encoder", "head", "mode", "options", "build", "random_init", "tag")})
    return [cfg.label(), row["mode"], row["head"], row["options"] or "-", *([row["build"]] if builds else [])]


def _key_head(builds: bool) -> list[str]:
    return ["encoder", "mode", "head", "options", *(["trained on build"] if builds else [])]


def _grid_table(doc: dict, rows: list[dict], probes: list[str], value, subrows=()) -> list[str]:
    """Configuration rows x probe columns; ``value(cell, n_row)`` gives a cell's text; each
    ``(label, fn)`` of ``subrows`` adds a row under every configuration."""
    builds = len({r["build"] for r in doc["configurations"]}) > 1
    head = [*_key_head(builds), "seeds", *probes]
    lines = []
    for r in rows:
        n = _max_seeds(r)
        lines.append([*_key_cells(r, builds), _n_seeds(r),
                      *(value(r["cells"][p], n) if p in r["cells"] else "-" for p in probes)])  # fmt: skip
        for label, fn in subrows:
            blank = ["", "", label, "", *([""] if builds else []), ""]
            lines.append([*blank, *(fn(r["cells"][p]) if p in r["cells"] else "-" for p in probes)])
    return _table(head, [[_cell_text(c) for c in line] for line in lines])


def _headline(key: str):
    return lambda c, n=None: fmt_summary(c.get(key), c["percent"], n_row=n)


def main_table(doc: dict) -> list[str]:
    probes, rows = doc["probes"], doc["configurations"]
    lines = ["## Main table", "",
             "One row per configuration (encoder x mode x head [options]), one column per probe: the",
             "headline metric on the original test samples, mean +- std over seeds [mean of the per-seed",
             "95 % patient-bootstrap CIs]; `(n=k)`: a cell with fewer seeds than its row. Under each row,",
             "`blind`: the same head trained on the question alone (no image features; for an MLLM, the",
             "question without the image): what canonical anatomy alone explains. Frozen, finetuned and",
             "from-scratch rows of one encoder and head stand side by side.", ""]  # fmt: skip
    subrows = [("blind", lambda c: fmt_summary(c.get("blind"), c["percent"], ci=False))]
    if any(c.get("paper") for r in rows for c in r["cells"].values()):
        lines[-1:-1] = ["`paper`: the number the paper states for this configuration (experiments/paper_numbers.json,",
                        "where it states it and what is guessed; `>= x`: a bound it gives for every configuration)."]
        subrows.append(("paper", lambda c: ref_text(c.get("paper", []), c["percent"]) or "-"))
    lines += _grid_table(doc, rows, probes, _headline("test"), subrows)
    return lines + [""]


def controls_table(doc: dict) -> list[str]:
    """Chance, majority and the prior (best input-free prediction) per probe, per training build."""
    probes = doc["probes"]
    rows = [r for r in doc["configurations"] if r["mode"] != "MLLM"]
    builds = sorted({r["build"] for r in rows})
    lines = []
    for b in builds:
        for name in ("chance", "majority", "prior"):
            vals = [_get(r["cells"].get(p), name, "mean") for p in probes for r in rows]
            if all(v is None for v in vals):
                continue
            cells = []
            for p in probes:
                got = [r["cells"][p] for r in rows if r["build"] == b and p in r["cells"]]
                v = [c[name]["mean"] for c in got if c.get(name)]
                cells.append(fmt(float(np.mean(v)), got[0]["percent"]) if v else "-")
            lines.append([name + (f" ({b})" if len(builds) > 1 else ""), *cells])
    if not lines:
        return []
    return ["## Controls", "", "Input-free baselines on the test split of the training build (mean over",
            "the runs of each probe): chance, the majority training answer, and the prior (the best",
            "input-free prediction, fitted in closed form on the training split).", "",
            *_table(["control", *probes], lines), ""]  # fmt: skip


def mirror_table(doc: dict) -> list[str]:
    rows = [r for r in doc["configurations"] if any(c.get("mirror") for c in r["cells"].values())]
    if not rows:
        return []
    return ["## Mirror counterfactual", "",
            "The same trained heads on left-right mirrored test samples (labels recomputed from the",
            "mirrored masks): a model that computes keeps its score, one that recalls canonical",
            "anatomy collapses. Same layout as the main table.", "",
            *_grid_table(doc, rows, doc["probes"], _headline("mirror")), ""]  # fmt: skip


def _holding(doc: dict, key: str) -> tuple[list[str], list[dict]]:
    """The probes with a cell holding ``key``, and the configurations with such a cell."""
    probes = [p for p in doc["probes"] if any(r["cells"].get(p, {}).get(key) for r in doc["configurations"])]
    return probes, [r for r in doc["configurations"] if any(r["cells"].get(p, {}).get(key) for p in probes)]


def conflict_table(doc: dict) -> list[str]:
    """Accuracy on the conflict items (docs/PROTOCOL.md 9), laid out like the main table."""
    probes, rows = _holding(doc, "conflict")
    if not rows:
        return []
    subrows = [("blind", lambda c: fmt_summary(c.get("conflict_blind"), c["percent"], ci=False))]
    return ["## Conflict items", "",
            "Accuracy on the test items whose answer in the image differs from the prior's (the answer",
            "canonical anatomy gives; the prior scores 0 % there), with the blind head's under each row:",
            "a model that recalls stays at or under blind, one that reads the image keeps its score.", "",
            *_grid_table(doc, rows, probes, _headline("conflict"), subrows), ""]  # fmt: skip


def flip_table(doc: dict) -> list[str]:
    """Level 4's superior-inferior flip, laid out like the mirror table (its probes only)."""
    probes, rows = _holding(doc, "flipped")
    if not rows:
        return []
    return ["## Flip counterfactual (Level 4)", "",
            "The same trained heads on superior-inferior flipped test volumes (labels recomputed from",
            "the flipped masks), a stronger control than the mirror: a model that computes keeps its",
            "score, one that recalls canonical anatomy collapses. Same layout as the main table.", "",
            *_grid_table(doc, rows, probes, _headline("flipped")), ""]  # fmt: skip


def transfer_tables(doc: dict) -> list[str]:
    """One "zero-shot transfer" table per target build (eval files), laid out like the main one."""
    lines = []
    for tid, name in doc["transfer_targets"].items():
        rows = [r for r in doc["configurations"] if any(tid in c["transfer"] for c in r["cells"].values())]

        def on(c: dict, n: int | None = None, tid: str = tid, what: str = "test", ci: bool = True) -> str:
            return fmt_summary(_get(c, "transfer", tid, what), c["percent"], ci=ci, n_row=n)

        fp = "" if tid.startswith("name:") else f" (build fingerprint {tid})"
        lines += [f"## Zero-shot transfer: {name}", "",
                  f"Trained heads scored on `{name}`{fp} without retraining: mean +- std over seeds",
                  "[mean 95% CI]. `prior`: the run's prior (fitted on its training split) on the target.", ""]  # fmt: skip
        lines += _grid_table(doc, rows, doc["probes"], on, [("prior", lambda c, on=on: on(c, what="prior", ci=False))])
        lines += [""]
    return lines


def mllm_table(doc: dict) -> list[str]:
    rows = [r for r in doc["configurations"] if r["mode"] == "MLLM"]
    if not rows:
        return []
    probes = [p for p in doc["probes"] if p in PROBE_SPECS and get_probe(p).asks
              and any(p in r["cells"] for r in rows)]  # fmt: skip
    subrows = [("blind (no image)", lambda c: fmt_summary(c.get("blind"), c["percent"], ci=False))]
    subrows += [(label, lambda c, label=label: fmt_summary(c.get(label), True, ci=False)) for label in VQA_ROWS]
    levels = "Levels 3-4" if any(is_volume(p) for p in probes) else "Level 3"

    def value(c: dict, n: int | None = None) -> str:
        return _headline("test")(c, n) + (f" ({HARNESS_PROMPT})" if c.get("harness_prompt") else "")

    return [f"## Multimodal LLMs ({levels})", "",
            f"Models asked the {levels} questions directly (`spar-probe vqa`): accuracy, mean +- std over",
            "seeds [mean 95% CI]; blind: the same question without the image; circular (strict): right",
            "under every rotation of the options (CircularEval); parse rate: answers naming exactly one",
            f"option. `{NOT_MEASURED}`: more than {100 * MAX_MISSING_SHARE:.0f} % of those answers were missing from",
            f"the `--answers` files. `({HARNESS_PROMPT})`: answers another harness asked with its own prompt",
            "(VLMEvalKit's), not `vqa`'s.", "", *_grid_table(doc, rows, probes, value, subrows), ""]  # fmt: skip


#: a stage encoder's name (``mllm:<folder>@<sha8>@<stage>``) and an ``hf:`` MLLM's run name
#: (``hf-<folder>-<sha8>``): one local model, by its folder's name and content hash
_STAGE_NAME = re.compile(r"mllm:(?P<model>.+@[0-9a-f]{8})@(?P<stage>vision|projector|llm:-?\d+(?:\+q)?)")
_HF_MODEL = re.compile(r"hf-(?P<base>.+)-(?P<sha>[0-9a-f]{8})")


def _stage_order(stage: str) -> tuple[int, int, int]:
    """vision, projector, then the LM's layers in depth order (``llm:-1``, the last, after the
    others), each layer's question stage (``llm:N+q``) right after its neutral one."""
    if not stage.startswith("llm:"):
        return (0 if stage == "vision" else 1, 0, 0)
    n = int(stage[4:].removesuffix("+q"))
    return (2, n if n >= 0 else 10_000 + n, int(stage.endswith("+q")))


def stage_summary(doc: dict) -> list[dict[str, Any]]:
    """Per local MLLM probed by stage: its stage rows (frozen heads on ``mllm:DIR@STAGE`` caches)
    in pipeline order and its own VQA rows (``hf:DIR``, matched by folder name and content hash)."""
    models: dict[str, dict[str, Any]] = {}
    for r in doc["configurations"]:
        m = _STAGE_NAME.fullmatch(r["encoder"]) if r["mode"] == "frozen" else None
        if m:
            models.setdefault(m["model"], {"model": m["model"], "stages": [], "vqa": []})["stages"].append(
                {"stage": m["stage"], "row": r})
    for r in doc["configurations"]:
        m = _HF_MODEL.fullmatch(r["encoder"]) if r["mode"] == "MLLM" else None
        if m and f"{m['base']}@{m['sha']}" in models:
            models[f"{m['base']}@{m['sha']}"]["vqa"].append(r)
    for v in models.values():
        v["stages"].sort(key=lambda s: (_stage_order(s["stage"]), s["row"]["head"], s["row"]["options"], s["row"]["tag"]))
    return [models[k] for k in sorted(models)]


def stage_tables(doc: dict) -> list[str]:
    """One table per MLLM probed by stage: a row per probe; per stage the heads' headline and, in
    parentheses, their blind baseline; then the model's own VQA answer and its blind VQA."""
    out: list[str] = []
    for model in stage_summary(doc):
        stages, vqa = model["stages"], model["vqa"]
        heads = len({(s["row"]["head"], s["row"]["options"], s["row"]["tag"]) for s in stages}) > 1
        cols = [s["stage"] + (f" [{s['row']['head']}]" if heads else "") for s in stages]
        cols += [f"answer{' [' + r['options'] + ']' if r['options'] else ''}" for r in vqa]
        probes = [p for p in doc["probes"] if any(p in s["row"]["cells"] for s in stages)]
        lines = []
        for p in probes:
            cells = [s["row"]["cells"].get(p) for s in stages] + [r["cells"].get(p) for r in vqa]
            lines.append([p, *("-" if c is None else f"{fmt_summary(c.get('test'), c['percent'], ci=False)} "
                                                    f"({fmt_summary(c.get('blind'), c['percent'], ci=False)})"
                               for c in cells)])  # fmt: skip
        out += [f"## Where the MLLM loses it: {model['model']} by stage", "",
                "Frozen heads on the model's own features at each stage (`mllm:DIR@STAGE`: vision tower,",
                "projector, language-model layer N at the image tokens with a neutral prompt; `llm:N+q`: with",
                "the probe's question before the image), then the model's own answer",
                "(`spar-probe vqa`). Each cell: the headline (mean over seeds) and, in parentheses, its blind",
                "baseline (the head without image features; the question without the image).", "",
                *_table(["probe", *cols], [[_cell_text(c) for c in line] for line in lines]), "",
                f"![stages]({STAGES_PNG})", ""]
    return out


def _folders(runs: list[dict]) -> str:
    """The run folders of a cell, compact: ``parent/{seed0, seed1}`` when they share a parent."""
    rels = [r["run"] for r in runs]
    parents = {rel.rpartition("/")[0] for rel in rels}
    if len(parents) == 1 and len(rels) > 1:
        return f"{parents.pop()}/{{{', '.join(rel.rpartition('/')[2] for rel in rels)}}}"
    return ", ".join(rels)


def provenance_table(doc: dict) -> list[str]:
    head = ["encoder", "mode", "head", "options", "probe", "run folders (relative to RUNS)", "build",
            "build fingerprint", "cache fingerprint", "weights", "protocol", "transfer evals"]
    lines = []
    for r in doc["configurations"]:
        for p, c in r["cells"].items():
            runs = c["runs"]
            evals = sorted({e["file"].rpartition("/")[2] for x in runs for e in x["evals"]})
            lines.append([r["encoder"], r["mode"], r["head"], r["options"] or "-", p, _folders(runs),
                          _distinct(runs, "build"), _distinct(runs, "build_fingerprint"),
                          _distinct(runs, "cache_fingerprint"), _distinct(runs, "weights"),
                          _distinct(runs, "protocol_version"), ", ".join(evals) or "-"])  # fmt: skip
    return ["## Provenance of every cell", "",
            "Run folders relative to RUNS; fingerprints: first 12 hex digits; weights: the encoder's",
            "weights (file name + sha256, hub repo @ revision, random-init; a finetuned run's initial",
            "weights, its trained encoder is the run folder's export). experiment.json lists every run.", "",
            *_table(head, [[_cell_text(x) for x in line] for line in lines]), ""]  # fmt: skip


# --------------------------------------------------------------------------- the report
def _provenance_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(json_safe(v), sort_keys=True)


def header(title: str, provenance: dict | None, doc: dict) -> list[str]:
    lines = [f"# {title}", ""]
    if provenance:
        rows = [[_cell_text(str(k)), _cell_text(_provenance_value(provenance[k]))] for k in sorted(provenance)]
        lines += _table(["experiment", "value"], rows) + [""]
    if doc["random_init_used"]:
        rows = [r for r in doc["configurations"] if r["mode"] != "MLLM"]
        lines += random_init_banner([r["encoder"] for r in rows if r["random_init"]], [r["encoder"] for r in rows])
    protocols = sorted({x["protocol_version"] for r in doc["configurations"] for c in r["cells"].values()
                        for x in c["runs"]})  # fmt: skip
    lines += [f"{doc['n_runs']} runs, {len(doc['configurations'])} configurations, {len(doc['probes'])} probes; "
              f"protocol (docs/PROTOCOL.md) {', '.join(protocols)}. Rates in %; Level 1 errors in pixels of",
              "the 224 frame (lower is better).", "", "Headline metrics: " + "; ".join(
                  f"{p} {metric_label(p)}" for p in doc["probes"]) + ".", ""]  # fmt: skip
    if any(is_volume(p) for p in doc["probes"]):
        lines += ["Level 4 (volumes): its probes are the columns after Level 3's; localisation errors in",
                  "voxels of the S^3 volume (SDR within 10 voxels) and mm.", ""]  # fmt: skip
    return lines


def render_markdown(title: str, provenance: dict | None, doc: dict) -> str:
    lines = header(title, provenance, doc) + [f"![headline per probe]({PNG_FILE})", ""]
    for part in (main_table, controls_table, mirror_table, conflict_table, flip_table, transfer_tables, mllm_table, stage_tables,
                 provenance_table):
        lines += part(doc)
    return "\n".join(lines).rstrip("\n") + "\n"


def _bars(ax, probe: str, rows: list[dict], colors: dict[str, str]) -> None:
    """One panel: the headline of ``probe`` per configuration (rates in %), mean CI as error bars."""
    cells = [r["cells"].get(probe) for r in rows]
    some = next((c for c in cells if c), None)
    scale = 100.0 if some and some["percent"] else 1.0
    ys, lo, hi = [], [], []
    for c in cells:
        s = (c or {}).get("test") or {}
        m = s.get("mean")
        ys.append(np.nan if m is None else scale * m)
        lo.append(0.0 if m is None or s.get("ci_low") is None else scale * max(m - s["ci_low"], 0.0))
        hi.append(0.0 if m is None or s.get("ci_high") is None else scale * max(s["ci_high"] - m, 0.0))
    ax.bar(np.arange(len(rows)), ys, yerr=[lo, hi], color=[colors.get(r["mode"], "gray") for r in rows], capsize=2)
    blind = [_mean(c, "blind") for c in cells]  # each configuration's blind baseline, a black mark on its bar
    ax.scatter(np.arange(len(rows)), blind, marker="_", s=300, color="k", zorder=3, label="blind")
    ax.set_xticks(np.arange(len(rows)), [str(i + 1) for i in range(len(rows))], fontsize=7)
    ax.set_title(probe, fontsize=8)
    if some and some["metric"] in METRICS:
        ax.set_ylabel(METRICS[some["metric"]].label + (" (%)" if scale == 100.0 else ""), fontsize=7)


def plot(doc: dict, path: Path) -> None:
    """The headline per probe (one panel each) per configuration, with mean CI error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes, rows = doc["probes"], doc["configurations"]
    ncol = min(4, len(probes))
    nrow = -(-len(probes) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol, 2.8 * nrow + 1.0), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(MODES)}
    for ax, probe in zip(axes.flat, probes, strict=False):
        _bars(ax, probe, rows, colors)
    for ax in list(axes.flat)[len(probes):]:
        ax.axis("off")
    legend = "; ".join(f"{i + 1}: {r['encoder']} {r['mode']} {r['head']}" for i, r in enumerate(rows))
    fig.text(0.01, 0.01, legend + " | black mark: blind baseline", fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def _mean(cell: dict | None, key: str) -> float:
    s = (cell or {}).get(key) or {}
    m = s.get("mean")
    return np.nan if m is None else (100.0 if cell["percent"] else 1.0) * m


def plot_stages(doc: dict, path: Path) -> None:
    """One panel per MLLM probed by stage: per probe, the heads' headline along the stages
    (solid) and their blind baseline (dashed), the model's own answer and blind VQA as the
    last point (the first head and VQA run of each stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = stage_summary(doc)
    fig, axes = plt.subplots(1, len(models), figsize=(5.0 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=True):
        seen: dict[str, dict] = {}
        for st in model["stages"]:
            seen.setdefault(st["stage"], st["row"])
        rows = list(seen.values()) + model["vqa"][:1]
        labels = list(seen) + (["answer"] if model["vqa"] else [])
        probes = [p for p in doc["probes"] if any(p in r["cells"] for r in rows)]
        for i, p in enumerate(probes):
            xs = np.arange(len(rows))
            ax.plot(xs, [_mean(r["cells"].get(p), "test") for r in rows], "-o", color=f"C{i}", label=p, ms=3)
            ax.plot(xs, [_mean(r["cells"].get(p), "blind") for r in rows], "--", color=f"C{i}", lw=0.8)
        ax.set_xticks(np.arange(len(rows)), labels, fontsize=7)
        ax.set_title(model["model"], fontsize=8)
        ax.set_ylabel("headline (dashed: blind)", fontsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


#: an absolute POSIX path (``/home/me/x``) or a Windows drive path in a string; not a URL's ``//``
ABSOLUTE = re.compile(r"(?:^|[\s\"'=(,\[])(?:/(?!/)[\w.-]+/[\w.-]|[A-Za-z]:[\\/][\w.-])")


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (str(k), *_strings(v))]
    if isinstance(obj, list | tuple):
        return [s for v in obj for s in _strings(v)]
    return [obj] if isinstance(obj, str) else []


def _row_key(row: dict) -> dict[str, str]:
    """The keys of a configuration row in experiment.json (its cells are there already)."""
    return {k: row[k] for k in ("encoder", "head", "mode", "options", "build", "tag")}


def _check_provenance(provenance: dict | None, prefixes: list[str]) -> None:
    if provenance is None:
        return
    if not isinstance(provenance, dict):
        raise ConfigError(f"experiment report: provenance must be a mapping, got {type(provenance).__name__}")
    found = local_paths(provenance, prefixes) or [v for v in _strings(provenance) if ABSOLUTE.search(v)]
    if found:
        raise ConfigError(f"experiment report: provenance holds a local path ({found[0]}); give paths "
                          "relative to the experiment file")  # fmt: skip


def write_experiment_report(runs: Path, out: Path, *, title: str, provenance: dict | None = None,
                            sections: tuple[str, ...] = ()) -> Path:
    """Write ``out/experiment.md``, ``experiment.json`` and ``experiment.png`` for the runs under
    ``runs`` (any depth); return the path of experiment.md. ``provenance``: what the runner
    records of the experiment (name, file sha256, plan hash, versions), shown at the top;
    ``sections``: markdown sections of other steps appended to experiment.md (the calibration's).
    No runs under ``runs`` is a :class:`ConfigError`; the same runs give the same bytes."""

    runs, out = Path(runs), Path(out)
    prefixes = local_prefixes(runs, out)
    _check_provenance(provenance, prefixes)
    doc = aggregate(load_runs(runs))
    stages = [{"model": m["model"], "stages": [s["stage"] for s in m["stages"]],
               "rows": [_row_key(s["row"]) for s in m["stages"]], "vqa": [_row_key(r) for r in m["vqa"]]}
              for m in stage_summary(doc)]  # fmt: skip
    meta = json_safe({"generator": GENERATOR, "title": title, "provenance": provenance or {},
                      "files": sorted([MD_FILE, JSON_FILE, PNG_FILE, HTML_FILE, LEADERBOARD_JSON, LEADERBOARD_CSV,
                                       *([STAGES_PNG] if stages else [])]), **doc,
                      **({"stages": stages} if stages else {})})  # fmt: skip
    text = render_markdown(title, provenance, doc)
    for section in sections:
        text = text.rstrip("\n") + "\n\n" + section
    leaked = local_paths([meta, text], prefixes)
    if leaked:  # a run's record held a local path: never publish it
        raise ConfigError(f"{runs}: a run records a local path ({leaked[0][:80]}); re-run it with this version")
    out.mkdir(parents=True, exist_ok=True)

    write_html({**doc, "stage_view": stage_summary(doc)}, out, title=title, provenance=provenance, prefixes=prefixes)
    plot(doc, out / PNG_FILE)
    write_leaderboard(doc, out, provenance)
    if stages:
        plot_stages(doc, out / STAGES_PNG)
    write_bytes(out / JSON_FILE, json.dumps(meta, indent=2) + "\n")
    write_bytes(out / MD_FILE, text)
    return out / MD_FILE


__all__ = ["Configuration", "aggregate", "encoder_tag", "load_runs", "mode_of", "weights_digest", "write_experiment_report"]
