"""The calibration experiment's tables and plots (:mod:`.calibration`): markdown tables of
seed means +- std [mean of the seeds' 95 % patient-bootstrap intervals] and bar plots, for the
calibration (``calibration.md``/``.png``, ``plots/<probe>.png``) and for the recall-versus-
computation runs (``results.md``/``.png``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

LAYOUTS = ("canonical", "mirrored", "random")
TRAIN_ON = ("canonical", "random")
#: The reference models (the oracle trains on nothing: it reads the masks).
MODELS = ("recall", "computation", "oracle")
#: The blind rows: the question-only optimum (the probe's prior) fitted on each training layout.
BLINDS = {"blind (canonical prior)": "canonical", "blind (random prior)": "random"}
#: The metric of each level's table cell (Level 2's exact permutation is ~0 for every trained
#: model at 8+ tiles, so the table shows its per-tile accuracy; the JSON holds every metric).
TABLE_METRIC = {"level1": "med_px", "level2": "tile_acc"}


def table_metric(probe: str) -> str:
    return TABLE_METRIC.get(probe.split(".", 1)[0], "accuracy")


CAL_COLUMNS = (*(f"test: {lay}" for lay in LAYOUTS), "mirrored counterfactual (canonical test slices)",
               "conflict items: mirrored / random")


def value_scale(probe: str) -> float:
    return 1.0 if table_metric(probe) == "med_px" else 100.0


def mean_interval(cis: list) -> tuple[float, float]:
    """The table's interval of a cell over seeds: the mean of the seeds' 95 % intervals."""
    return float(np.mean([c[0] for c in cis])), float(np.mean([c[1] for c in cis]))


def cal_cell(rows: list[dict], layout: str, what: str = "value") -> str:
    """mean +- std over seeds (one seed: its value) and, for the layouts, the mean 95% CI."""
    k = value_scale(rows[0]["probe"])
    vals = [r["cells"][layout].get(what) for r in rows]
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    txt = f"{k * np.mean(vals):.1f}" + (f" +- {k * np.std(vals, ddof=1):.1f}" if len(vals) > 1 else "")
    cis = [r["cells"][layout].get("ci" if what == "value" else "conflict_ci") for r in rows]
    cis = [c for c in cis if c]
    if cis and what == "value":
        lo, hi = mean_interval(cis)
        txt += f" [{k * lo:.1f}, {k * hi:.1f}]"
    return txt


def calibration_table(rows: list[dict], probe: str) -> str:
    """Markdown: one probe, a row per model (seeds pooled), a column per test layout and control."""
    unit = {"med_px": "MED px, lower is better", "tile_acc": "per-tile accuracy %"}.get(table_metric(probe),
                                                                                        "accuracy %")
    lines = [f"**{probe}** ({unit})", "", "| model | seeds | " + " | ".join(CAL_COLUMNS) + " |",
             "|---" * (len(CAL_COLUMNS) + 2) + "|"]
    for model in (*MODELS, *BLINDS):
        rs = [r for r in rows if r["probe"] == probe and r["model"] == model]
        if not rs:
            continue
        cells = [cal_cell(rs, lay) for lay in LAYOUTS] + [cal_cell(rs, "canonical", "mirror_cf")]
        cells.append(" / ".join(cal_cell(rs, lay, "conflict") for lay in ("mirrored", "random")))
        name = f"**{model}**" if model in MODELS else model
        lines.append(f"| {name} | {len([r for r in rs if r['seed'] is not None]) or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cal_axis(ax, rows: list[dict], probe: str) -> None:
    k, x = value_scale(probe), np.arange(len(LAYOUTS))
    for j, model in enumerate(MODELS):
        rs = [r for r in rows if r["probe"] == probe and r["model"] == model]
        if rs:
            vals = [[k * (r["cells"][lay]["value"] if r["cells"][lay]["value"] is not None else np.nan)
                     for r in rs] for lay in LAYOUTS]
            ax.bar(x + (j - 1) * 0.27, np.nanmean(vals, axis=1), 0.27, label=model,
                   yerr=np.nanstd(vals, axis=1) if len(rs) > 1 else None, capsize=2)
    for name, marker in zip(BLINDS, ("_", "x"), strict=True):
        r = next((r for r in rows if r["probe"] == probe and r["model"] == name), None)
        if r is not None:
            ax.scatter(x, [k * (r["cells"][lay]["value"] or np.nan) for lay in LAYOUTS], marker=marker,
                       s=300 if marker == "_" else 30, color="k", zorder=3, label=name)
    ax.set_xticks(x, [f"test: {lay}" for lay in LAYOUTS], fontsize=7)
    ax.set_title(probe, fontsize=9)
    ax.set_ylabel({"med_px": "MED px (lower better)", "tile_acc": "tile accuracy %"}.get(table_metric(probe),
                                                                                         "accuracy %"), fontsize=8)


def calibration_plots(rows: list[dict], out: Path) -> None:
    """``OUT/plots/<probe>.png`` per probe and ``OUT/calibration.png`` (every probe, 2 x 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = list(dict.fromkeys(r["probe"] for r in rows))
    (out / "plots").mkdir(exist_ok=True)
    for probe in probes:
        fig, ax = plt.subplots(figsize=(4.6, 3.4))
        _cal_axis(ax, rows, probe)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "plots" / f"{probe}.png", dpi=100)
        plt.close(fig)
    ncol = 4
    fig, axes = plt.subplots((len(probes) + ncol - 1) // ncol, ncol, figsize=(4.2 * ncol, 3.2 * ((len(probes) + 3) // 4)),
                             squeeze=False)
    for ax, probe in zip(axes.flat, probes, strict=False):
        _cal_axis(ax, rows, probe)
    for ax in list(axes.flat)[len(probes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "calibration.png", dpi=90)
    plt.close(fig)


def calibration_section(rows: list[dict]) -> list[str]:
    """The calibration tables of docs/RESULTS.md, one per probe, with their legend (markdown lines)."""
    return ["Each cell: mean +- std over training seeds [mean of the seeds' 95% patient-bootstrap intervals]; "
            "conflict items: those the canonical prior (canonical anatomy's answer) gets wrong.", "",
            *(calibration_table(rows, p) for p in dict.fromkeys(r["probe"] for r in rows))]
