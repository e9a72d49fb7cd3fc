"""``spar-probe report``: tables and plots over a folder of runs.

Reads every ``metrics.json`` under RUNS (``<encoder>/<probe>/<head>/seed<k>/``) and
writes to ``--out``:

* ``report.md``   - a loud banner when any run used random-init features; per probe (what
  is shown comes from its spec, :mod:`spar_bench.probes.tasks`): a table of mean +- std
  over seeds of the headline metric, the 95 % patient-bootstrap CI (mean of the per-seed
  CI bounds), the other declared metrics, chance, majority, the prior (input-free
  optimum), the blind baseline, the mirrored counterfactual, and transfer results
  (``eval-*.json``: mean +- std [CI]); a table of every declared metric on every
  evaluation (test, mirror, each transfer); the per-organ metric when the spec has one;
  for multimodal LLM runs (``spar-probe vqa``, heads ``vqa-*``) also the parse rate and
  CircularEval;
  for an encoder x probe x head run over a ``sweep --grid``, a row ``[selected on
  validation]``: per seed the grid point with the lowest ``train.best_val_loss`` (runs
  pruned by ``--grid-prune`` excluded), aggregated over seeds, and a table of the chosen
  points; runs pruned by ``--grid-prune`` are left out of the per-option rows;
  for relative position a per-axis table (left/right, anterior/posterior, and Level 4's
  superior/inferior: the mirror control is read on left/right, the flip on superior/inferior);
  Level 4 (volumes) rows also show the superior-inferior flipped counterfactual (``flipped``,
  and the prior and blind baseline on it) beside the mirrored one, in every table and plot
  (columns that Levels 1-3, which have no flipped items, never get); for Levels 3-4 a table of
  the conflict items (items whose answer differs
  from the prior's: accuracy there and how often the answer is the prior's, beside blind and
  mirrored); for Level 2 exact permutation accuracy by number k of present tiles, beside 1/k!;
* ``report.json`` - the same numbers, machine-readable (a selected row's ``selection``
  lists each seed's chosen point);
* ``<probe>.png``  - bars per configuration with chance / majority / prior / blind lines;
* ``<probe>-per-organ.png`` - the per-organ metric (Level 1 MED, Level 2 tile accuracy).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

from spar_bench.builder.schema import ORGANS
from spar_bench.errors import ConfigError
from spar_bench.outputs import check_target, claim, remove
from spar_bench.provenance import json_safe

from ..measured import HARNESS_PROMPT, shown, unmeasured_of
from ..tasks import METRICS, get_probe, probe_names

#: Columns added to a probe's table when a row is an MLLM run (``spar-probe vqa``):
#: row key -> (column label, path in metrics.json: the MLLM's own controls).
VQA_COLUMNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "parse_rate": ("parse", ("controls", "parse_rate")),
    "circular": ("circular (all rot.)", ("controls", "circular", "strict")),
    "circular_mean": ("circular (mean)", ("controls", "circular", "mean")),
}
#: An MLLM's own controls, which runs written before they joined the shared evaluation kept
#: at the top level of metrics.json (:func:`collect` reads them where they are now).
MLLM_CONTROLS = ("parse_rate", "unparsed", "circular")

def collect(runs: str | Path) -> list[dict[str, Any]]:
    """Every finished run's metrics (plus ``_dir``) under ``runs``."""
    root = Path(runs)
    if not root.is_dir():
        raise ConfigError(
            f"{root}: runs folder not found; make runs with `spar-probe fit` or `sweep`"
        )
    out = []
    for p in sorted(root.rglob("metrics.json")):
        m = _read_json(p, "metrics")
        if not _is_run(m, p):
            continue
        _lift_mllm_controls(m)
        m["_dir"] = str(p.parent)
        m["_evals"] = [_read_json(e, "evaluation") for e in sorted(p.parent.glob("eval-*.json"))]
        out.append(m)
    if not out:
        raise ConfigError(
            f"{root}: no metrics.json found; run `spar-probe fit` or `spar-probe sweep` first"
        )
    return out


#: What the metrics.json of every kind of run holds (fit, sweep, finetune, vqa).
RUN_KEYS = ("probe", "head", "seed", "encoder", "test")


def _read_json(p: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: unreadable {what} ({e}); delete the run and re-fit it") from None


def _is_run(m: Any, p: Path) -> bool:
    """Whether ``m`` (read from ``p``) is a run's metrics. A foreign ``metrics.json`` (another
    tool's, in a folder that is no run) is skipped with a warning line; one in a run's folder
    (its ``config.json`` is a run's) that lacks what a run's holds is a damaged run: an error."""
    from .store import owned_run

    missing = [k for k in RUN_KEYS if k not in m] if isinstance(m, dict) else list(RUN_KEYS)
    if not missing:
        return True
    if owned_run(p.parent) is not None:
        raise ConfigError(f"{p}: a run's metrics.json without {', '.join(missing)} (damaged?); "
                          "delete the run and re-fit it")  # fmt: skip
    click.echo(f"{p}: not a SPAR-Bench run's metrics.json (no {', '.join(missing)}); skipped", err=True)
    return False


def _lift_mllm_controls(m: dict) -> None:
    """An older MLLM run's own controls (top-level ``parse_rate``, ``unparsed``, ``circular``)
    moved into ``controls``, where runs record them now."""
    if m.get("track") != "vqa" or not isinstance(m.get("controls"), dict):
        return
    for k in MLLM_CONTROLS:
        if k in m and k not in m["controls"]:
            m["controls"][k] = m.pop(k)


def _get(d: dict | None, *path):
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def _stat(values: list) -> tuple[float | None, float | None]:
    v = np.array([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return None, None
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _summary(ms: list[dict], *path) -> dict[str, float | None]:
    """Mean, std over seeds and the mean per-seed CI bounds of the metric at ``path``."""
    *where, key = path
    mean, std = _stat([_get(m, *where, key) for m in ms])
    lo, _ = _stat([(_get(m, *where, "ci", key) or [None])[0] for m in ms])
    hi, _ = _stat([(_get(m, *where, "ci", key) or [None, None])[1] for m in ms])
    return {"mean": mean, "std": std, "ci_low": lo, "ci_high": hi}


def _evaluations(ms: list[dict]) -> dict[str, list[dict]]:
    """Per evaluation (``test``, ``mirror``, ``transfer: <cache>``) the per-seed metric dicts."""
    evals: dict[str, list[dict]] = {"test": [], "mirror": []}
    for m in ms:
        evals["test"].append({"x": m.get("test")})
        evals["mirror"].append({"x": m.get("mirror")})
        if "flipped" in m:  # Level 4
            evals.setdefault("flipped", []).append({"x": m.get("flipped")})
        for e in m["_evals"]:
            name = f"transfer: {Path(e['features']).stem}"
            evals.setdefault(name, []).append({"x": e.get("test")})
            evals.setdefault(f"{name} (mirror)", []).append({"x": e.get("mirror")})
            if "flipped" in e:
                evals.setdefault(f"{name} (flipped)", []).append({"x": e.get("flipped")})
    return {k: v for k, v in evals.items() if any(d["x"] for d in v)}


def has_flips(ms: list[dict]) -> bool:
    """Whether runs score flipped counterfactuals (Level 4: their metrics have a ``flipped`` block)."""
    return any("flipped" in m for m in ms)


def _row(spec, enc: str, head: str, ms: list[dict]) -> dict[str, Any]:
    key = spec.headline
    row: dict[str, Any] = {
        "encoder": enc,
        "head": head,
        "random_init": any(m.get("random_init") for m in ms),
        # an encoder trained by `spar-probe finetune` (end to end, or its export probed frozen)
        "training": next((_get(m, "training", "label") for m in ms if _get(m, "training", "label")), None),
        "seeds": sorted(m["seed"] for m in ms),
        "protocol": sorted({run_protocol(m) for m in ms}),
        "unanswerable": next((m["build_unanswerable"] for m in ms if m.get("build_unanswerable")), None),
        "metric": key,
        **_summary(ms, "test", key),
    }
    for name in ("chance", "majority"):
        row[name], _ = _stat([_get(m, "controls", name) for m in ms])
    for name in ("prior", "blind", "prior_mirror", "blind_mirror"):
        row[name], _ = _stat([_get(m, "controls", name, key) for m in ms])
    row["mirror"], _ = _stat([_get(m, "mirror", key) for m in ms])
    if has_flips(ms):  # Level 4: the superior-inferior flipped copies, beside the mirrored ones
        row["flipped"], _ = _stat([_get(m, "flipped", key) for m in ms])
        for name in FLIPPED_CONTROLS:
            row[name], _ = _stat([_get(m, "controls", name, key) for m in ms])
    row["track"] = ms[0].get("track", "probe")  # "vqa": a multimodal LLM asked directly
    row["not_measured"] = sorted(unmeasured_of(ms))  # MLLM variants whose answers an --answers file lacked
    row["harness_prompt"] = any(m.get("prompt") == "harness" for m in ms)
    # the splits scored as "test" (an MLLM run may ask other splits: never in the headline table)
    row["splits"] = sorted({str(s) for m in ms for s in (m.get("splits") or ["test"])})
    for name, path in VQA_COLUMNS.items():
        row[name], _ = _stat([_get(m, *path[1]) for m in ms])
    row["unparsed"] = _unparsed(ms)
    # seeds whose training the epoch cap ended while the validation loss still improved
    row["capped"] = sum(_get(m, "train", "stopped_by") == "max_epochs" for m in ms)
    # a trained blind head below the prior (which sees what it sees) is under-trained
    row["blind_below_prior"] = (row["track"] == "probe" and spec.prior_bounds_blind
                                and spec.worse(row["blind"], row["prior"]))  # fmt: skip
    row["metrics"] = {
        ev: {k: _summary(runs, "x", k) for k in spec.metrics}
        for ev, runs in _evaluations(ms).items()
    }
    row["transfer"] = {
        ev.split(": ", 1)[1]: row["metrics"][ev][key]
        for ev in row["metrics"] if ev.startswith("transfer: ") and not ev.endswith(("(mirror)", "(flipped)"))
    }  # fmt: skip
    if spec.per_organ:
        row["per_organ"] = {
            o: _stat([_get(m, "test", "per_organ", o, spec.per_organ) for m in ms])[0] for o in ORGANS
        }
    row.update(_breakdowns(spec, ms))
    return row


#: Where each evaluation's score dict lies in metrics.json (breakdowns read all of them).
SCORED = {"test": ("test",), "mirror": ("mirror",), "prior": ("controls", "prior"),
          "blind": ("controls", "blind"), "prior_mirror": ("controls", "prior_mirror"),
          "blind_mirror": ("controls", "blind_mirror")}  # fmt: skip
#: Level 4's flipped evaluations (runs whose metrics have a ``flipped`` block), after :data:`SCORED`'s
FLIPPED = {"flipped": ("flipped",), "prior_flipped": ("controls", "prior_flipped"),
           "blind_flipped": ("controls", "blind_flipped")}  # fmt: skip
FLIPPED_CONTROLS = ("prior_flipped", "blind_flipped")
CONFLICT_KEYS = ("accuracy", "prior_agreement", "n", "share")


def scored(ms: list[dict]) -> dict[str, tuple[str, ...]]:
    """The evaluations of :data:`SCORED`, and :data:`FLIPPED` when the runs have flipped items."""
    return {**SCORED, **FLIPPED} if has_flips(ms) else SCORED


def _means(ms: list[dict], *path) -> float | None:
    return _stat([_get(m, *path) for m in ms])[0]


def _breakdowns(spec, ms: list[dict]) -> dict[str, Any]:
    """Means over seeds of ``by_k`` (Level 2: per number of present tiles), ``per_axis``
    (relative position) and ``conflict`` (Level 3: items whose answer differs from the prior's),
    for every evaluation in :data:`SCORED` that has them."""
    key, out, evs = spec.headline, {}, scored(ms)
    ks = sorted({k for m in ms for k in (_get(m, "test", "by_k") or {})}, key=int)
    if ks:
        out["by_k"] = {k: {f: _means(ms, "test", "by_k", k, f) for f in ("n", "perm_acc", "chance")}
                       for k in ks}  # fmt: skip
    if spec.axes and any(_get(m, "test", "per_axis") for m in ms):  # runs before protocol 1.2: none
        out["per_axis"] = {a: {ev: _means(ms, *path, "per_axis", a, key) for ev, path in evs.items()}
                           for a in spec.axes}  # fmt: skip
    if any(_get(m, "test", "conflict") for m in ms):
        out["conflict"] = {ev: {f: _means(ms, *path, "conflict", f) for f in CONFLICT_KEYS}
                           for ev, path in evs.items()}  # fmt: skip
        if spec.axes:
            out["conflict_per_axis"] = {
                a: {ev: {f: _means(ms, *path, "conflict", "per_axis", a, f) for f in CONFLICT_KEYS}
                    for ev, path in evs.items()} for a in spec.axes}  # fmt: skip
    return out


SELECTED = "selected on validation"


def _pruned(m: dict) -> bool:
    """A run stopped early by ``sweep --grid-prune`` (its metrics are not those of a full run)."""
    return _get(m, "train", "pruned_at") is not None


def select_on_validation(ms: list[dict]) -> list[dict]:
    """Per seed, the run (grid point) with the lowest ``train.best_val_loss`` among ``ms``
    (one encoder x probe x head, several variants), pruned runs excluded; ties: the first
    variant in sorted order. Seeds whose runs have no validation loss choose nothing."""
    by_seed: dict[int, list[dict]] = defaultdict(list)
    for m in ms:
        if not _pruned(m) and _get(m, "train", "best_val_loss") is not None:
            by_seed[m["seed"]].append(m)
    return [min(c, key=lambda m: (m["train"]["best_val_loss"], m.get("variant") or ""))
            for _, c in sorted(by_seed.items())]  # fmt: skip


def _selected_row(spec, enc: str, head: str, ms: list[dict]) -> dict[str, Any] | None:
    """The "selected on validation" row of one encoder x probe x head run over a grid (None
    without a grid): each seed's chosen point, its test metrics aggregated over seeds."""
    if len({m.get("variant") or "" for m in ms}) < 2:
        return None
    chosen = select_on_validation(ms)
    if not chosen:
        return None
    row = _row(spec, enc, f"{head} [{SELECTED}]", chosen)
    row["selection"] = [{"seed": m["seed"], "variant": m.get("variant") or "",
                         "best_val_loss": m["train"]["best_val_loss"], "test": _get(m, "test", spec.headline),
                         "candidates": sum(1 for o in ms if o["seed"] == m["seed"] and not _pruned(o)),
                         "pruned": sum(1 for o in ms if o["seed"] == m["seed"] and _pruned(o))}
                        for m in chosen]  # fmt: skip
    return row


def aggregate(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per probe, one row per (encoder, head [options]) with statistics over seeds, and per
    (encoder, head) run over a grid one row selected on validation (:func:`select_on_validation`).
    Runs pruned by ``sweep --grid-prune`` are left out of the per-option rows."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    grids: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for m in runs:
        head = m["head"] + (f" [{m['variant']}]" if m.get("variant") else "")
        if not _pruned(m):
            groups[(m["probe"], m["encoder"], head)].append(m)
        grids[(m["probe"], m["encoder"], m["head"])].append(m)
    table: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (probe, enc, head), ms in sorted(groups.items()):
        table[probe].append(_row(get_probe(probe), enc, head, ms))
    for (probe, enc, head), ms in sorted(grids.items()):
        row = _selected_row(get_probe(probe), enc, head, ms)
        if row is not None:
            table[probe].append(row)
    mark_protocols(table)
    return dict(table)


def _f(v, pct: bool) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if pct else f"{v:.2f}"


def with_spread(mean: str, std: str | None, n: int, sign: str = "+-") -> str:
    """``mean +- std`` over ``n`` seeds; the mean alone for one seed (one seed has no spread:
    never ``+- 0.00``) or without a std. Every report's cells (report.md, experiment.md,
    report.html) show a spread by this rule."""
    return mean if n <= 1 or std is None else f"{mean} {sign} {std}"


def _fs(s: dict, pct: bool, ci: bool = True, n: int = 2) -> str:
    """``mean +- std [low, high]`` of a summary over ``n`` seeds (paper style; one seed: no spread)."""
    if s.get("mean") is None:
        return "-"
    text = with_spread(_f(s["mean"], pct), _f(s["std"], pct), n)
    if ci and s.get("ci_low") is not None:
        text += f" [{_f(s['ci_low'], pct)}, {_f(s['ci_high'], pct)}]"
    return text


def _unparsed(ms: list[dict]) -> dict[str, int] | None:
    """Unparseable headline answers of an MLLM row by reason, summed over seeds (None: no
    run of the row records them)."""
    got = [_get(m, "controls", "unparsed", "test") for m in ms]
    if all(g is None for g in got):
        return None
    out: dict[str, int] = {}
    for g in got:
        for why, k in (g or {}).items():
            out[why] = out.get(why, 0) + int(k)
    return dict(sorted(out.items()))


def _unparsed_cell(u: dict[str, int] | None) -> str:
    if u is None:
        return "-"
    return ", ".join(f"{why} {k}" for why, k in u.items()) or "0"


def run_protocol(m: dict) -> str:
    """The protocol version a run used (docs/PROTOCOL.md), ``<1.2`` for runs that predate its record."""
    return str(m.get("protocol_version") or "<1.2")


def mark_protocols(table: dict[str, list[dict]]) -> None:
    """Rows of a report that mixes protocol versions get ``protocol_note`` `` [protocol X]``
    where their runs used another version than the newest (or several)."""
    have = {v for rows in table.values() for r in rows for v in r.get("protocol") or []}
    if len(have) < 2:
        return
    newest = max(have, key=lambda v: (v != "<1.2", [int(p) for p in v.split(".") if p.isdigit()]))
    for rows in table.values():
        for r in rows:
            if (r.get("protocol") or [newest]) != [newest]:
                r["protocol_note"] = f" [protocol {', '.join(r['protocol'])}]"


def _label(r: dict) -> str:
    trained = f" ({r['training']})" if r.get("training") else ""
    return r["encoder"] + trained + (
        " **(random-init)**" if r["random_init"] and "random-init" not in r["encoder"] else ""
    ) + (f" ({HARNESS_PROMPT})" if r.get("harness_prompt") else "") + r.get("protocol_note", "")


def _main_table(spec, rows: list[dict]) -> list[str]:
    key = spec.headline
    pct = METRICS[key].percent
    others = [k for k in spec.metrics if k != key]
    transfer = sorted({k for r in rows for k in r["transfer"]})
    cols = ["encoder", "head", "seeds", METRICS[key].label, "95% CI"]
    cols += [METRICS[k].label for k in others]
    cols += ["chance", "majority", "prior", "blind", "mirror", "prior (mirror)", "blind (mirror)"]
    flips = any("flipped" in r for r in rows)  # Level 4
    cols += ["flipped", "prior (flipped)", "blind (flipped)"] if flips else []
    cols += [f"transfer: {t}" for t in transfer]
    vqa = [c for c in VQA_COLUMNS if any(r.get(c) is not None for r in rows)]
    cols += [VQA_COLUMNS[c][0] for c in vqa]
    why = any(r.get("unparsed") is not None for r in rows)
    cols += ["unparsed (why)"] if why else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        score = "-" if r["mean"] is None else with_spread(_f(r["mean"], pct), _f(r["std"], pct), len(r["seeds"]))
        ci = "-" if r["mean"] is None else "n/a" if r["ci_low"] is None else \
            f"[{_f(r['ci_low'], pct)}, {_f(r['ci_high'], pct)}]"
        seeds = f"{len(r['seeds'])} (cap: {r['capped']})" if r.get("capped") else str(len(r["seeds"]))
        nm = r.get("not_measured") or set()
        cells = [_label(r), r["head"], seeds, shown(score, "test", nm), shown(ci, "test", nm)]
        cells += [shown(_f(r["metrics"]["test"][k]["mean"], METRICS[k].percent), "test", nm) for k in others]
        cells += [shown(_f(r[c], pct), c, nm) for c in ("chance", "majority", "prior", "blind", "mirror",
                                                        "prior_mirror", "blind_mirror")]  # fmt: skip
        if r["blind_below_prior"]:
            cells[-4] += " (!)"
        cells += [shown(_f(r.get(c), pct), c, nm) for c in ("flipped", *FLIPPED_CONTROLS)] if flips else []
        cells += [_fs(r["transfer"][t], pct, n=len(r["seeds"])) if t in r["transfer"] else "-" for t in transfer]
        cells += [shown(_f(r.get(c), True), c, nm) for c in vqa]
        cells += [_unparsed_cell(r.get("unparsed"))] if why else []
        lines.append("| " + " | ".join(cells) + " |")
    if any(r["blind_below_prior"] for r in rows):
        lines += ["", "(!) The blind head scores below the prior, the best input-free prediction: it "
                  "is under-trained, and every image-based score above it is flattered."]  # fmt: skip
    if any(r.get("capped") for r in rows):
        lines += ["", "(cap: k) k seeds ended at the epoch cap with the validation loss still improving "
                  "(`train.stopped_by` = max_epochs): the score understates what the head can reach; "
                  "rerun with a higher --max-epochs."]  # fmt: skip
    return lines


def _metrics_table(spec, rows: list[dict]) -> list[str]:
    """Every declared metric on every evaluation: mean +- std over seeds [mean 95% CI]."""
    cols = ["encoder", "head", "evaluation", *(METRICS[k].label for k in spec.metrics)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        for ev, ms in r["metrics"].items():
            cells = [_label(r), r["head"], _evaluation_label(r, ev)]
            cells += [_fs(ms[k], METRICS[k].percent, n=len(r["seeds"])) for k in spec.metrics]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _on_test(r: dict) -> bool:
    """Whether a row scores the test split (the headline); MLLM runs may ask other splits."""
    return r.get("splits", ["test"]) == ["test"]


def _evaluation_label(r: dict, ev: str) -> str:
    """``test``/``mirror`` named by the splits a row scored (``val``, ``val mirror``)."""
    if _on_test(r) or ev not in ("test", "mirror", "flipped"):
        return ev
    return "+".join(r["splits"]) + ("" if ev == "test" else f" {ev}")


def _by_k_table(rows: list[dict]) -> list[str]:
    """Level 2 per number k of present tiles: items, exact-permutation chance 1/k!, score."""
    lines = ["### Exact permutation accuracy by number of present tiles (k)", "",
             "The chance column of the table above is the mean of 1/k! over the items scored;",
             "a mosaic needs `l12_min_organs` present organs (docs/PROTOCOL.md 4), so no item is free.",
             "", "| encoder | head | k | items | chance 1/k! | perm. acc. |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for k, v in (r.get("by_k") or {}).items():
            n = "-" if v["n"] is None else f"{v['n']:.0f}"
            lines.append(f"| {_label(r)} | {r['head']} | {k} | {n} | {v['chance']:.2g} | {_f(v['perm_acc'], True)} |")
    return lines + [""]


def _per_axis_table(spec, rows: list[dict]) -> list[str]:
    """Relative position per axis: mirroring changes the left/right answers only, so the
    mirror control is read on the left/right rows (Level 4's flip: on superior/inferior)."""
    pct = METRICS[spec.headline].percent
    flips = any("flipped" in r for r in rows)
    evs = {**SCORED, **FLIPPED} if flips else SCORED
    cols = ["encoder", "head", "axis", "accuracy", "mirror", "prior", "blind", "prior (mirror)",
            "blind (mirror)", *(["flipped", "prior (flipped)", "blind (flipped)"] if flips else []),
            "conflict acc.", "conflict acc. (mirror)", *(["conflict acc. (flipped)"] if flips else [])]
    lines = ["### Per axis", "",
             "Mirroring flips left/right answers and leaves anterior/posterior ones: the mirror",
             "control is read on the `left_right` rows (pooled numbers above)."]  # fmt: skip
    if flips:
        lines += ["The superior-inferior flip (Level 4) flips superior/inferior answers only: read it on",
                  "the `superior_inferior` rows."]  # fmt: skip
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        for axis, v in (r.get("per_axis") or {}).items():
            conf = (r.get("conflict_per_axis") or {}).get(axis, {})
            cells = [_label(r), r["head"], axis, *(_f(v.get(ev), pct) for ev in evs)]
            cells += [_f(_get(conf, ev, "accuracy"), True) for ev in ("test", "mirror", *(["flipped"] if flips else []))]
            lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _conflict_table(rows: list[dict]) -> list[str]:
    """Conflict items: accuracy there and how often the model gives the prior's answer."""
    flips = any("flipped" in r for r in rows)  # Level 4
    cols = ["encoder", "head", "accuracy (all)", "conflict items", "conflict acc.", "gives prior's",
            "blind: conflict acc.", "blind: gives prior's", "mirror: conflict items",
            "mirror: conflict acc.", "mirror: gives prior's", "blind (mirror): conflict acc."]
    cols += ["flipped: conflict items", "flipped: conflict acc.", "flipped: gives prior's",
             "blind (flipped): conflict acc."] if flips else []
    lines = ["### Conflict items", "",
             "Items whose answer in the image differs from the prior's answer (canonical anatomy:",
             "the majority training answer of the question type). The prior scores 0 there and agrees",
             "100 %; a model that recalls canonical anatomy scores at or below its blind baseline",
             "there and gives the prior's answer; one that reads the image keeps its accuracy.",
             "Items: count (share of all items).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip

    def items(c: dict) -> str:
        return "-" if c.get("n") is None else f"{c['n']:.0f} ({_f(c['share'], True)})"

    for r in rows:
        c = r.get("conflict") or {}
        if not c:
            continue
        t, b, m, bm = (c.get(ev) or {} for ev in ("test", "blind", "mirror", "blind_mirror"))
        cells = [_label(r), r["head"], _f(r["mean"], True), items(t), _f(t.get("accuracy"), True),
                 _f(t.get("prior_agreement"), True), _f(b.get("accuracy"), True),
                 _f(b.get("prior_agreement"), True), items(m), _f(m.get("accuracy"), True),
                 _f(m.get("prior_agreement"), True), _f(bm.get("accuracy"), True)]  # fmt: skip
        if flips:
            f, bf = (c.get(ev) or {} for ev in ("flipped", "blind_flipped"))
            cells += [items(f), _f(f.get("accuracy"), True), _f(f.get("prior_agreement"), True),
                      _f(bf.get("accuracy"), True)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _per_organ_table(spec, probe: str, rows: list[dict]) -> list[str]:
    m = METRICS[spec.per_organ]
    lines = [f"### {m.label} per organ", "", f"![per organ]({probe}-per-organ.png)", ""]
    lines += ["| organ | " + " | ".join(f"{r['encoder']} / {r['head']}" for r in rows) + " |"]
    lines += ["|" + "---|" * (len(rows) + 1)]
    for o in ORGANS:
        lines.append(
            f"| {o} | " + " | ".join(_f(r["per_organ"].get(o), m.percent) for r in rows) + " |"
        )
    return lines + [""]


def _selection_table(spec, rows: list[dict]) -> list[str]:
    """Which grid point each seed chose in the rows selected on validation."""
    m = METRICS[spec.headline]
    lines = ["### Grid point selected on validation, per seed", "",
             f"Rows `[{SELECTED}]`: for each seed, the grid point with the lowest best validation loss",
             "(ties: the first in sorted order), among the runs not pruned by `sweep --grid-prune`",
             "(pruned runs are left out of the rows and of this choice); its test metrics are then",
             "aggregated over seeds like any row.", "",
             f"| encoder | head | seed | chosen point | best val loss | {m.label} (test) | candidates | pruned |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for c in r.get("selection") or []:
            lines.append(f"| {_label(r)} | {r['head']} | {c['seed']} | {c['variant'] or '(defaults)'} | "
                         f"{c['best_val_loss']:.4f} | {_f(c['test'], m.percent)} | {c['candidates']} | "
                         f"{c['pruned']} |")  # fmt: skip
    return lines


def _protocol_line(table: dict[str, list[dict]]) -> str:
    """Which protocol versions (docs/PROTOCOL.md) the report's runs used."""
    have = sorted({v for rows in table.values() for r in rows for v in r.get("protocol") or []})
    if not have:
        return ""
    old = " (<1.2: runs made before the version was recorded)" if "<1.2" in have else ""
    return (f"Protocol (docs/PROTOCOL.md) of these runs: {', '.join(have)}{old}."
            + (" Rows whose runs used another than the newest are marked [protocol X]." if len(have) > 1 else ""))


def _unanswerable_line(rows: list[dict]) -> list[str]:
    """What the builds of a probe's rows dropped as not answerable from the image's pixels."""
    seen = {(u["dropped"], u["asked"]) for r in rows if (u := r.get("unanswerable"))}
    if not seen:
        return []
    shares = "; ".join(f"{d / n:.2%} ({d} of {n})" if n else "0" for d, n in sorted(seen))
    return [f"Dropped at build time as not answerable from the image's pixels (the pixel reader of the "
            f"stored 224 masks does not give the label; docs/PROTOCOL.md 5): {shares} of the questions "
            "asked, every split and source.", ""]


RANDOM_BANNER = [
    "> **WARNING: RANDOM-INIT FEATURES.** Every encoder below has randomly initialised weights",
    "> (marked `random-init`). Their scores say nothing about a pretrained model; they only show",
    "> that the pipeline runs.", "",
]


def random_init_banner(random_encoders: Sequence[str], encoders: Sequence[str]) -> list[str]:
    """The warning over a report whose ``random_encoders`` (of all its ``encoders``) have
    random-init features: over every row when all have, else naming those rows only (a control
    beside pretrained weights)."""
    rand = sorted(set(random_encoders))
    if not rand:
        return []
    if set(encoders) <= set(rand):
        return list(RANDOM_BANNER)
    return [f"> **WARNING: RANDOM-INIT FEATURES in the rows marked `random-init`** ({', '.join(rand)}):",
            "> those encoders have randomly initialised weights (a control). Their scores say nothing",
            "> about a pretrained model. The other rows' weights are listed under provenance.", ""]


def render_markdown(table: dict[str, list[dict]], any_random: bool) -> str:
    lines = ["# SPAR-Bench probe report", ""]
    if any_random:
        rows = [r for rs in table.values() for r in rs]
        lines += random_init_banner([r["encoder"] for r in rows if r["random_init"]], [r["encoder"] for r in rows])
    lines += [
        "Scores on original test samples; mean +- std over seeds. CI: 95 % bootstrap over patients",
        "(mean of the per-seed bounds; n/a over fewer than 2 patients). Prior: the best input-free",
        "prediction, fitted in closed form on the training split (a trained blind head below it is",
        "under-trained). Blind: the same head",
        "trained on the question alone (no image features). Mirror: the same trained head on",
        "left-right mirrored counterfactual test samples (a model that computes keeps its score; one",
        "that recalls canonical anatomy collapses). Transfer: mean +- std [95% CI] on another cache.",
        "Rates in %; Level 1 errors in pixels of the 224 frame (lower is better).",
        "",
        _protocol_line(table),
        "",
    ]
    if any("flipped" in r for rows in table.values() for r in rows):
        lines += [
            "Level 4 (volumes): Flipped is the same predictor on superior-inferior flipped test volumes",
            "(every label recomputed: a model that computes keeps its score), beside Mirror (left-right);",
            "Level 4 localisation errors are in voxels of the S^3 volume (SDR within 10 voxels) and mm.",
            "",
        ]
    if any(r.get("track") == "vqa" for rows in table.values() for r in rows):
        lines += [
            "Heads named `vqa-*` are multimodal LLMs asked the questions directly (`spar-probe vqa`):",
            "their blind control is the same question without the image; parse: answers that named",
            "exactly one option (the rest count wrong); unparsed (why): those that did not, by the",
            "parser's reason, summed over seeds (docs/PROTOCOL.md 11); circular: right under every",
            "rotation of the options (CircularEval), and the mean accuracy over rotations.",
            "",
        ]
    known = probe_names()
    for probe in [p for p in known if p in table] + sorted(set(table) - set(known)):
        spec, rows = get_probe(probe), table[probe]
        lines += [f"## {probe}", "", f"Prior: {spec.prior_rule}.", ""] + _unanswerable_line(rows)
        lines += [f"![{probe}]({probe}.png)", ""]
        if any(_on_test(r) for r in rows):
            lines += _main_table(spec, [r for r in rows if _on_test(r)]) + [""]
        if not all(_on_test(r) for r in rows):
            lines += ["### Runs on other splits (not the test split: not in the table above)", "",
                      "Each row is labelled by the splits it asked (`splits=...`).", ""]
            lines += _main_table(spec, [r for r in rows if not _on_test(r)]) + [""]
        if any(r.get("per_axis") for r in rows):
            lines += _per_axis_table(spec, rows)
        if any(r.get("conflict") for r in rows):
            lines += _conflict_table(rows)
        if any(r.get("by_k") for r in rows):
            lines += _by_k_table(rows)
        lines += ["### Every metric, every evaluation", ""] + _metrics_table(spec, rows) + [""]
        if any(r.get("selection") for r in rows):
            lines += _selection_table(spec, rows) + [""]
        if spec.per_organ:
            lines += _per_organ_table(spec, probe, rows)
    return "\n".join(lines) + "\n"


def plot(table: dict[str, list[dict]], out: Path) -> list[Path]:
    """Bar charts per probe and its per-organ chart when it has one (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for probe, rows in table.items():
        spec = get_probe(probe)
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows) + 2), 3.5))
        labels = [f"{r['encoder']}\n{r['head']}".replace(" [", "\n[").replace(",", ",\n") for r in rows]
        x = np.arange(len(rows))
        means = [r["mean"] if r["mean"] is not None else np.nan for r in rows]
        stds = [r["std"] or 0.0 for r in rows]
        if any("flipped" in r for r in rows):  # Level 4: a third bar
            bars = (("original", means, "tab:blue"), ("mirror", [r["mirror"] for r in rows], "tab:orange"),
                    ("flipped", [r.get("flipped") for r in rows], "tab:green"))  # fmt: skip
            for i, (name, vals, color) in enumerate(bars):
                ax.bar(x + (i - 1) * 0.27, [v if v is not None else np.nan for v in vals], 0.27,
                       yerr=stds if name == "original" else None, label=name, color=color)  # fmt: skip
        else:
            ax.bar(x - 0.2, means, 0.4, yerr=stds, label="original", color="tab:blue")
            ax.bar(x + 0.2, [r["mirror"] if r["mirror"] is not None else np.nan for r in rows], 0.4,
                   label="mirror", color="tab:orange")  # fmt: skip
        ax.scatter(x, [r["blind"] if r["blind"] is not None else np.nan for r in rows], marker="_", s=600,
                   color="k", zorder=3, label="blind")  # fmt: skip
        for name, style in (("chance", ":"), ("majority", "--"), ("prior", "-.")):
            vals = [r[name] for r in rows if r.get(name) is not None]
            if vals:
                ax.axhline(float(np.mean(vals)), ls=style, color="gray", label=name)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(METRICS[spec.headline].label)
        ax.set_title(probe)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never on them
        fig.tight_layout()
        separate_labels(fig, ax)
        p = out / f"{probe}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
        if spec.per_organ:
            written.append(_plot_per_organ(plt, spec, probe, rows, out))
    return written


def overlapping(boxes: list) -> bool:
    """Whether any two of ``boxes`` (matplotlib window extents, in order along x) overlap."""
    return any(a.x1 > b.x0 + 0.5 for a, b in zip(boxes, boxes[1:], strict=False))


def separate_labels(fig, ax) -> None:
    """Turn the x tick labels upright (90 degrees) where they overlap side by side, and lay the
    figure out again (in place)."""
    fig.canvas.draw()
    if overlapping([t.get_window_extent() for t in ax.get_xticklabels()]):
        for t in ax.get_xticklabels():
            t.set_rotation(90)
        fig.tight_layout()


def _plot_per_organ(plt, spec, probe: str, rows: list[dict], out: Path) -> Path:
    """The per-organ metric of ``probe`` per configuration."""
    fig, ax = plt.subplots(figsize=(10, 3.5))
    w = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        v = [r["per_organ"].get(o) if r["per_organ"].get(o) is not None else np.nan for o in ORGANS]
        ax.bar(np.arange(len(ORGANS)) + i * w, v, w, label=f"{r['encoder']} / {r['head']}")
    ax.set_xticks(np.arange(len(ORGANS)) + 0.4 - w / 2, ORGANS, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(METRICS[spec.per_organ].label)
    ax.set_title(f"{probe}: {METRICS[spec.per_organ].label} per organ")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / f"{probe}-per-organ.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p


REPORT_GENERATOR = "spar-bench report"


def owned_report(out: Path) -> set[str] | None:
    """The files of an earlier report in ``out``, or None if ``out`` holds no such report."""
    try:
        meta = json.loads((Path(out) / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("generator") != REPORT_GENERATOR:
        return None
    return {str(f) for f in meta.get("files", [])} | {"report.json"}


def write_report(runs: str | Path, out: str | Path) -> Path:
    """Write report.md, report.json and PNGs for the runs under ``runs``; return report.md.

    ``out`` must be absent, empty, or an earlier report (replaced whole); anything else
    is refused and left untouched.
    """

    out = Path(out)
    check_target(out)
    replace = claim(out, overwrite=True, owned=owned_report, what="report folder")
    ms = collect(runs)
    table = aggregate(ms)
    if replace:
        remove(out)
    out.mkdir(parents=True, exist_ok=True)
    any_random = any(m.get("random_init") for m in ms)
    (out / "report.md").write_text(render_markdown(table, any_random))
    plots = plot(table, out)
    meta = {"generator": REPORT_GENERATOR, "random_init_used": any_random, "n_runs": len(ms),
            "files": sorted(["report.md"] + [p.name for p in plots]), "probes": table}
    (out / "report.json").write_text(json.dumps(json_safe(meta), indent=2) + "\n")  # NaN -> null
    return out / "report.md"
