"""``spar-probe report``: tables and plots over a folder of runs.

Reads every ``metrics.json`` under RUNS (``<encoder>/<probe>/<head>/seed<k>/``) and
writes to ``--out``:

* ``report.md``   - a loud banner when any run used random-init features; one Markdown
  table per probe: mean +- std over seeds of the headline metric, the 95 % patient-
  bootstrap CI (mean of the per-seed CI bounds), chance, majority, blind baseline,
  atlas (Level 1), the score on mirrored counterfactual samples; a per-organ
  localisation table; transfer results (``eval-*.json``) when present;
* ``report.json`` - the same numbers, machine-readable;
* ``<probe>.png``  - bars per configuration with chance / majority / blind lines;
* ``level1-per-organ.png`` - localisation error per organ and configuration.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import click
import numpy as np
from spar_bench.builder.schema import ORGANS, PROBES

from spar_bench.errors import ConfigError

HEADLINE = {
    "level1": ("med_px", "MED (px)"),
    "level2": ("perm_acc", "perm. acc."),
    "level3": ("accuracy", "accuracy"),
}
SECONDARY = {
    "level1": ("sdr10", "SDR@10"),
    "level2": ("tile_acc", "tile acc."),
    "level3": ("macro_f1", "macro-F1"),
}


def collect(runs: str | Path) -> list[dict[str, Any]]:
    """Every finished run's metrics (plus ``_dir``) under ``runs``."""
    root = Path(runs)
    if not root.is_dir():
        raise ConfigError(
            f"{root}: runs folder not found; make runs with `spar-probe fit` or `sweep`"
        )
    out = []
    for p in sorted(root.rglob("metrics.json")):
        try:
            m = json.loads(p.read_text())
        except ValueError as e:
            raise ConfigError(
                f"{p}: unreadable metrics ({e}); delete the run and re-fit it"
            ) from None
        m["_dir"] = str(p.parent)
        m["_evals"] = [json.loads(e.read_text()) for e in sorted(p.parent.glob("eval-*.json"))]
        out.append(m)
    if not out:
        raise ConfigError(
            f"{root}: no metrics.json found; run `spar-probe fit` or `spar-probe sweep` first"
        )
    return out


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


def aggregate(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per probe, one row per (encoder, head) with statistics over seeds."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for m in runs:
        groups[(m["probe"], m["encoder"], m["head"])].append(m)
    table: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (probe, enc, head), ms in sorted(groups.items()):
        level = probe.split(".")[0]
        key, _ = HEADLINE[level]
        key2, _ = SECONDARY[level]
        row: dict[str, Any] = {
            "encoder": enc,
            "head": head,
            "random_init": any(m.get("random_init") for m in ms),
            "seeds": sorted(m["seed"] for m in ms),
            "metric": key,
        }
        row["mean"], row["std"] = _stat([_get(m, "test", key) for m in ms])
        row["secondary"], _ = _stat([_get(m, "test", key2) for m in ms])
        row["ci_low"], _ = _stat([(_get(m, "test", "ci", key) or [None])[0] for m in ms])
        row["ci_high"], _ = _stat([(_get(m, "test", "ci", key) or [None, None])[1] for m in ms])
        row["chance"], _ = _stat([_get(m, "controls", "chance") for m in ms])
        row["majority"], _ = _stat([_get(m, "controls", "majority") for m in ms])
        row["blind"], _ = _stat([_get(m, "controls", "blind", key) for m in ms])
        row["atlas"], _ = _stat([_get(m, "controls", "atlas", key) for m in ms])
        row["mirror"], _ = _stat([_get(m, "mirror", key) for m in ms])
        row["blind_mirror"], _ = _stat([_get(m, "controls", "blind_mirror", key) for m in ms])
        if level == "level1":
            row["per_organ"] = {
                o: _stat([_get(m, "test", "per_organ", o, "med_px") for m in ms])[0] for o in ORGANS
            }
        evals = defaultdict(list)
        for m in ms:
            for e in m["_evals"]:
                evals[Path(e["features"]).stem].append(_get(e, "test", key))
        row["transfer"] = {name: _stat(v)[0] for name, v in sorted(evals.items())}
        table[probe].append(row)
    return dict(table)


def _f(v, pct: bool) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if pct else f"{v:.2f}"


def render_markdown(table: dict[str, list[dict]], any_random: bool) -> str:
    lines = ["# SPAR-Bench probe report", ""]
    if any_random:
        lines += [
            "> **WARNING: RANDOM-INIT FEATURES.** At least one run below used an encoder with",
            "> randomly initialised weights (marked `random-init`). Its scores say nothing about a",
            "> pretrained model; they only show that the pipeline runs.",
            "",
        ]
    lines += [
        "Scores on original test samples; mean +- std over seeds. CI: 95 % bootstrap over patients",
        "(mean of the per-seed bounds). Blind: the same head trained on the question alone (no image",
        "features). Mirror: the same trained head on left-right mirrored counterfactual test samples",
        "(a model that computes keeps its score; one that recalls canonical anatomy collapses).",
        "Accuracies in %; Level 1 errors in pixels of the 224 frame (lower is better).",
        "",
    ]
    for probe in [p for p in PROBES if p in table] + sorted(set(table) - set(PROBES)):
        rows = table[probe]
        level = probe.split(".")[0]
        pct = level != "level1"
        name, label = HEADLINE[level]
        _, label2 = SECONDARY[level]
        cols = ["encoder", "head", "seeds", label, "95% CI", label2, "chance", "majority", "blind"]
        cols += ["atlas"] if level == "level1" else []
        cols += ["mirror", "blind (mirror)"]
        transfer = sorted({k for r in rows for k in r["transfer"]})
        cols += [f"transfer: {t}" for t in transfer]
        lines += [f"## {probe}", "", f"![{probe}]({probe}.png)", ""]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            enc = r["encoder"] + (
                " **(random-init)**"
                if r["random_init"] and "random-init" not in r["encoder"]
                else ""
            )
            score = "-" if r["mean"] is None else f"{_f(r['mean'], pct)} +- {_f(r['std'], pct)}"
            ci = (
                "-" if r["ci_low"] is None else f"[{_f(r['ci_low'], pct)}, {_f(r['ci_high'], pct)}]"
            )
            cells = [
                enc,
                r["head"],
                str(len(r["seeds"])),
                score,
                ci,
                _f(r["secondary"], level != "level1" or True),
            ]
            if level == "level1":
                cells[-1] = _f(r["secondary"], True)
            cells += [_f(r["chance"], pct), _f(r["majority"], pct), _f(r["blind"], pct)]
            cells += [_f(r["atlas"], pct)] if level == "level1" else []
            cells += [_f(r["mirror"], pct), _f(r["blind_mirror"], pct)]
            cells += [_f(r["transfer"].get(t), pct) for t in transfer]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if level == "level1":
            lines += [
                "### Localisation error per organ (MED, px)",
                "",
                "![per organ](level1-per-organ.png)",
                "",
            ]
            lines += [
                "| organ | " + " | ".join(f"{r['encoder']} / {r['head']}" for r in rows) + " |"
            ]
            lines += ["|" + "---|" * (len(rows) + 1)]
            for o in ORGANS:
                lines.append(
                    f"| {o} | " + " | ".join(_f(r["per_organ"].get(o), False) for r in rows) + " |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, list[dict]], out: Path) -> list[Path]:
    """Bar charts per probe and the per-organ localisation chart (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for probe, rows in table.items():
        level = probe.split(".")[0]
        fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows) + 2), 3.5))
        labels = [f"{r['encoder']}\n{r['head']}" for r in rows]
        x = np.arange(len(rows))
        means = [r["mean"] if r["mean"] is not None else np.nan for r in rows]
        stds = [r["std"] or 0.0 for r in rows]
        ax.bar(x - 0.2, means, 0.4, yerr=stds, label="original", color="tab:blue")
        ax.bar(x + 0.2, [r["mirror"] if r["mirror"] is not None else np.nan for r in rows], 0.4,
               label="mirror", color="tab:orange")  # fmt: skip
        ax.scatter(x, [r["blind"] if r["blind"] is not None else np.nan for r in rows], marker="_", s=600,
                   color="k", zorder=3, label="blind")  # fmt: skip
        for name, style in (("chance", ":"), ("majority", "--"), ("atlas", "-.")):
            vals = [r[name] for r in rows if r.get(name) is not None]
            if vals:
                ax.axhline(float(np.mean(vals)), ls=style, color="gray", label=name)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(HEADLINE[level][1])
        ax.set_title(probe)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"{probe}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    if "level1.localisation" in table:
        rows = table["level1.localisation"]
        fig, ax = plt.subplots(figsize=(10, 3.5))
        w = 0.8 / max(len(rows), 1)
        for i, r in enumerate(rows):
            v = [
                r["per_organ"].get(o) if r["per_organ"].get(o) is not None else np.nan
                for o in ORGANS
            ]
            ax.bar(np.arange(len(ORGANS)) + i * w, v, w, label=f"{r['encoder']} / {r['head']}")
        ax.set_xticks(
            np.arange(len(ORGANS)) + 0.4 - w / 2, ORGANS, rotation=60, ha="right", fontsize=7
        )
        ax.set_ylabel("MED (px)")
        ax.set_title("Level 1 localisation error per organ")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / "level1-per-organ.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    return written


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
    from spar_bench.outputs import check_target, claim, remove

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
    (out / "report.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out / "report.md"


@click.command("report")
@click.argument("runs", type=click.Path(file_okay=False))
@click.option("--out", default="report", show_default=True, type=click.Path(file_okay=False))
def report_command(runs, out):
    """Tables (report.md, report.json) and plots over a folder of runs."""
    path = write_report(runs, out)
    click.echo(f"report: {path}")
