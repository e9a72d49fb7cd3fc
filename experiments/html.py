"""``report.html``: the experiment report as one self-contained page (issue 36, item 4).

:func:`write_html` writes ``report.html`` beside ``experiment.md`` from the same ``doc`` as
``experiment.json`` (:func:`.report.aggregate`). One file, no network, no external asset:
inline CSS, a few lines of inline JS and inline SVG plots drawn here.

* the **main table**: configurations x probes, the headline (mean +- std over seeds); click a
  header to sort, type in the filter box to keep matching rows (of every table);
* the **controls** side by side, one row per configuration x probe: plain, circular (MLLM
  CircularEval, strict), mirror, flipped (Level 4, when present), blind, model - blind, chance,
  the prior;
* one **plot per probe**: a horizontal bar per configuration, named on the axis, the mean 95 % CI
  as a whisker, and reference marks per row: chance, the prior and the row's blind baseline;
  the row's model - blind is printed at its end;
* **provenance per cell** on hover (``title``: run folders, seeds, build and cache fingerprints,
  weights, protocol) and in a ``<details>`` list per configuration.

Every number cell carries ``data-value``: the exact float of experiment.json (``repr``), so a
browser test can compare the DOM with the JSON. Same doc -> same bytes (no time stamp, no
absolute path: the text is checked with :func:`~spar_bench.provenance.local_paths`).
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.probes.tasks import METRICS, PROBE_SPECS, get_probe
from spar_bench.provenance import json_safe, local_paths

# report.py calls write_html, so nothing here imports it (no import cycle); the cell formatting
# below (get_path, fmt, metric_label, distinct) is the one both pages use: report.py imports it.

HTML_FILE = "report.html"
#: the controls' columns: label -> (cell key, always a rate in %)
CONTROLS: dict[str, tuple[str, bool]] = {"plain": ("test", False), "circular": ("circular (strict)", True),
                                         "mirror": ("mirror", False), "flipped": ("flipped", False),
                                         "blind": ("blind", False)}  # fmt: skip
#: reference marks of the plots: cell key -> (label, colour)
MARKS = {"chance": ("chance", "#1f78b4"), "prior": ("prior", "#d95f02"), "blind": ("blind", "#000000")}
MODE_COLOURS = {"frozen": "#1b9e77", "finetuned": "#7570b3", "scratch": "#e7298a", "MLLM": "#66a61e"}

CSS = """body{font:14px/1.4 sans-serif;margin:1.5em;color:#222;max-width:1250px}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 6px}
th{background:#eef;cursor:pointer;user-select:none}td.num{text-align:right;font-variant-numeric:tabular-nums}
td[title]{text-decoration:underline dotted #999}.banner{background:#fdd;border:1px solid #c00;padding:.5em}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plot{border:1px solid #ddd;padding:4px}
#filter{font-size:14px;padding:4px;width:24em}caption{text-align:left;font-weight:bold}
details{margin:.2em 0}small{color:#555}.scroll{overflow-x:auto}"""

JS = """function sortBy(th){const t=th.closest('table'),b=t.tBodies[0],i=th.cellIndex,
up=th.dataset.dir!=='asc';th.dataset.dir=up?'asc':'desc';const key=r=>{const c=r.cells[i];
if(!c)return '';const v=c.dataset.value;return v===undefined?c.textContent:(v===''?null:parseFloat(v));};
const rows=[...b.rows];rows.sort((a,c)=>{const x=key(a),y=key(c);if(x===y)return 0;if(x===null)return 1;
if(y===null)return -1;return (x<y?-1:1)*(up?1:-1);});rows.forEach(r=>b.appendChild(r));}
document.querySelectorAll('table.data th').forEach(th=>th.addEventListener('click',()=>sortBy(th)));
document.getElementById('filter').addEventListener('input',e=>{const q=e.target.value.toLowerCase();
document.querySelectorAll('table.data tbody tr').forEach(r=>{
r.hidden=q!==''&&!r.textContent.toLowerCase().includes(q);});});"""


# --------------------------------------------------------------------------- cells
def get_path(d: Any, *path: str) -> Any:
    """``d[path[0]][path[1]]...``, None where a step is missing or None."""
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def fmt(v: float | None, pct: bool) -> str:
    """As experiment.md: a rate in % with one decimal, any other metric with two."""
    return "-" if v is None else (f"{100 * v:.1f}" if pct else f"{v:.2f}")


def signed(v: float | None, pct: bool) -> str:
    """A difference (model - blind) with its sign."""
    return "-" if v is None else ("+" if v >= 0 else "") + fmt(v, pct)


def metric_label(probe: str) -> str:
    key = get_probe(probe).headline if probe in PROBE_SPECS else ""
    if key not in METRICS:
        return "(headline)"
    return METRICS[key].label + ("" if METRICS[key].higher_is_better else " (lower is better)")


def distinct(runs: list[dict], key: str) -> str:
    return ", ".join(sorted({str(r[key]) for r in runs if r.get(key) is not None})) or "-"


def _num(v: Any) -> str:
    """A float as experiment.json writes it (``repr``), "" for none."""
    return "" if v is None else json.dumps(float(v))


def _td(text: str, value: Any = None, title: str = "", numeric: bool = True) -> str:
    attrs = (f' data-value="{_num(value)}"' if numeric else "") + (f' title="{escape(title)}"' if title else "")
    return f'<td{" class=num" if numeric else ""}{attrs}>{escape(text)}</td>'


def cell_provenance(cell: dict) -> str:
    """One cell's provenance in a few lines (the hover text)."""
    runs = cell.get("runs", [])
    return "\n".join([f"runs: {', '.join(r['run'] for r in runs)}", f"seeds: {', '.join(map(str, cell.get('seeds', [])))}",
                      f"build: {distinct(runs, 'build')} ({distinct(runs, 'build_fingerprint')})",
                      f"cache fingerprint: {distinct(runs, 'cache_fingerprint')}",
                      f"weights: {distinct(runs, 'weights')}",
                      f"protocol: {distinct(runs, 'protocol_version')}"])  # fmt: skip


def _mean_td(cell: dict | None, key: str, pct: bool | None = None, title: str = "", std: bool = False) -> str:
    s = (cell or {}).get(key)
    mean = get_path(s, "mean")
    if mean is None:
        return _td("-", None, title)
    pct = cell["percent"] if pct is None else pct
    text = fmt(mean, pct) + (f" ± {fmt(s['std'], pct)}" if std and s.get("std") is not None else "")
    return _td(text, mean, title)


def row_label(row: dict, builds: bool = False) -> str:
    """A configuration in one line: encoder [tag] mode head (options) [on build: ``builds``]."""
    enc = row["encoder"] + (f" [{row['tag']}]" if row.get("tag") else "")
    enc += " (random-init)" if row.get("random_init") and row["mode"] == "frozen" else ""
    text = " ".join([enc, row["mode"], row["head"]]) + (f" ({row['options']})" if row.get("options") else "")
    return text + (f" on {row['build']}" if builds and row.get("build") else "")


def several_builds(doc: dict) -> bool:
    """Whether the rows were trained on more than one build (then each label names its build)."""
    return len({r.get("build") for r in doc["configurations"]}) > 1


def _key_tds(row: dict, builds: bool) -> list[str]:
    return [_td(row_label(row, builds), numeric=False), _td(row["mode"], numeric=False), _td(row["head"], numeric=False)]


# --------------------------------------------------------------------------- tables
def _table(tid: str, caption: str, head: list[str], rows: list[str]) -> list[str]:
    ths = "".join(f"<th>{escape(h)}</th>" for h in head)
    return [f'<div class="scroll"><table class="data" id="{tid}"><caption>{escape(caption)}</caption>',
            f"<thead><tr>{ths}</tr></thead><tbody>", *rows, "</tbody></table></div>"]  # fmt: skip


def main_table(doc: dict) -> list[str]:
    """Configurations x probes: the headline, mean +- std over seeds; provenance on hover."""
    probes, rows = doc["probes"], []
    for r in doc["configurations"]:
        cells = [_mean_td(r["cells"].get(p), "test", title=cell_provenance(r["cells"][p]), std=True)
                 if p in r["cells"] else _td("-") for p in probes]  # fmt: skip
        rows.append(f'<tr>{"".join(_key_tds(r, several_builds(doc)))}{_td(str(len(r["seeds"])), len(r["seeds"]))}{"".join(cells)}</tr>')
    head = ["configuration", "mode", "head", "seeds", *(f"{p} {metric_label(p)}" for p in probes)]
    return _table("main", "Main table: headline per probe, mean ± std over seeds (rates in %)", head, rows)


def _controls(doc: dict) -> list[str]:
    cells = [c for r in doc["configurations"] for c in r["cells"].values()]
    return [k for k, (key, _) in CONTROLS.items() if k in ("plain", "blind") or any(c.get(key) for c in cells)]


def controls_table(doc: dict) -> list[str]:
    """One row per configuration x probe, the controls side by side as columns."""
    cols, rows = _controls(doc), []
    for r in doc["configurations"]:
        for p, c in r["cells"].items():
            title = cell_provenance(c)
            tds = [_mean_td(c, CONTROLS[k][0], True if CONTROLS[k][1] else None, title) for k in cols]
            gap = None if None in (get_path(c, "test", "mean"), get_path(c, "blind", "mean")) else (
                c["test"]["mean"] - c["blind"]["mean"])
            tds.append(_td(signed(gap, c["percent"]), gap, title))
            tds += [_mean_td(c, k, title=title) for k in ("chance", "prior")]
            rows.append(f'<tr>{"".join(_key_tds(r, several_builds(doc)))}{_td(p, numeric=False)}{"".join(tds)}</tr>')
    head = ["configuration", "mode", "head", "probe", *cols, "model - blind", "chance", "prior"]
    caption = "Controls side by side (circular: CircularEval strict, MLLM only; rates in %)"
    return _table("controls", caption, head, rows)


def provenance_details(doc: dict) -> list[str]:
    """Per configuration a <details> with every cell's provenance."""
    out = ["<h2>Provenance</h2>"]
    for r in doc["configurations"]:
        items = "".join(f"<li><b>{escape(p)}</b><pre>{escape(cell_provenance(c))}</pre></li>"
                        for p, c in r["cells"].items())  # fmt: skip
        out.append(f"<details><summary>{escape(row_label(r, several_builds(doc)))}</summary><ul>{items}</ul></details>")
    return out


# --------------------------------------------------------------------------- plots
BAR_W, ROW_H, TOP, CHAR_W = 320, 22, 34, 6.5  # CHAR_W: a generous width of an 11 px character


def _nice(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k at or above ``v`` (> 0): a round axis end."""
    e = 10.0 ** math.floor(math.log10(v))
    return next(m * e for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * e >= v * (1 - 1e-12))


def _scale(vals: list[float]) -> tuple[float, float]:
    lo, hi = min([0.0, *vals]), max([0.0, *vals])
    return (-_nice(-lo) if lo < 0 else 0.0), _nice(hi) if hi > 0 else 1.0


def _plot_values(rows: list[dict], probe: str, scale: float) -> list[float]:
    keys = [("test", "ci_high"), ("test", "mean"), *((k, "mean") for k in MARKS)]
    return [scale * v for r in rows for k in keys if (v := get_path(r["cells"].get(probe), *k)) is not None]


def _mark(x: float, y: float, key: str) -> str:
    label, colour = MARKS[key]
    style = {"blind": 'stroke-width="3"', "chance": 'stroke-width="2" stroke-dasharray="4,2"'}.get(key, 'stroke-width="2"')
    return (f'<line class="mark-{key}" x1="{x:.1f}" x2="{x:.1f}" y1="{y - 2:.1f}" y2="{y + ROW_H - 4:.1f}" '
            f'stroke="{colour}" {style}><title>{label}</title></line>')


def _plot_row(i: int, row: dict, cell: dict, x, left: int, label: str) -> list[str]:
    """One configuration's bar, CI whisker, reference marks and model - blind."""
    y, scale = TOP + i * ROW_H, 100.0 if cell["percent"] else 1.0
    out = [f'<text x="{left - 6}" y="{y + 14}" text-anchor="end" font-size="11">{escape(label)}</text>']
    mean = get_path(cell, "test", "mean")
    if mean is not None:
        colour = MODE_COLOURS.get(row["mode"].split(" ")[0], "#999999")
        out.append(f'<rect class="bar" x="{x(0):.1f}" y="{y + 3}" width="{max(x(scale * mean) - x(0), 0):.1f}" '
                   f'height="{ROW_H - 8}" fill="{colour}" data-value="{_num(mean)}"/>')  # fmt: skip
        lo, hi = get_path(cell, "test", "ci_low"), get_path(cell, "test", "ci_high")
        if lo is not None and hi is not None:
            out.append(f'<line x1="{x(scale * lo):.1f}" x2="{x(scale * hi):.1f}" y1="{y + 9}" y2="{y + 9}" '
                       'stroke="#333"/>')
    out += [_mark(x(scale * v), y, k) for k in MARKS if (v := get_path(cell, k, "mean")) is not None]
    blind = get_path(cell, "blind", "mean")
    if mean is not None and blind is not None:
        gap = mean - blind
        out.append(f'<text class="gap" x="{left + BAR_W + 6}" y="{y + 14}" font-size="11" data-value="{_num(gap)}">'
                   f'{signed(gap, cell["percent"])}</text>')
    return out


def plot_svg(doc: dict, probe: str) -> str:
    """One probe: a bar per configuration named on the axis, CI whiskers, chance, prior and
    blind as reference marks per row, model - blind at the right; a note where nothing ran."""
    rows = [r for r in doc["configurations"] if probe in r["cells"]]
    pct = rows[0]["cells"][probe]["percent"]
    lo, hi = _scale(_plot_values(rows, probe, 100.0 if pct else 1.0))

    labels = [row_label(r, several_builds(doc)) for r in rows]
    left = int(max(120, CHAR_W * max(map(len, labels)) + 12))

    def x(v: float) -> float:
        return left + BAR_W * (v - lo) / (hi - lo)

    height = TOP + ROW_H * len(rows) + 24
    unit = metric_label(probe) + (" (%)" if pct else "")
    out = [f'<svg class="plot" data-probe="{escape(probe)}" width="{left + BAR_W + 60}" '
           f'height="{height}" font-family="sans-serif">',
           f'<text x="4" y="14" font-size="13" font-weight="bold">{escape(probe)}: {escape(unit)}</text>',
           f'<text x="4" y="28" font-size="10">bar: model (95% CI) | marks: <tspan fill="{MARKS["chance"][1]}">'
           f'chance (dashed)</tspan>, <tspan fill="{MARKS["prior"][1]}">prior</tspan>, blind (black) | right: '
           'model - blind</text>']  # fmt: skip
    for i, r in enumerate(rows):
        out += _plot_row(i, r, r["cells"][probe], x, left, labels[i])
    base = TOP + ROW_H * len(rows)
    out += [f'<line x1="{left}" x2="{left + BAR_W}" y1="{base}" y2="{base}" stroke="#333"/>',
            f'<line x1="{x(0):.1f}" x2="{x(0):.1f}" y1="{TOP}" y2="{base}" stroke="#333"/>']
    out += [f'<text x="{x(v):.1f}" y="{base + 14}" font-size="10" text-anchor="middle">{v:.3g}</text>'
            for v in (lo, (lo + hi) / 2, hi)]  # fmt: skip
    return "\n".join([*out, "</svg>"])


def plots(doc: dict) -> list[str]:
    out = ["<h2>Per probe</h2>", '<div class="plots">']
    for p in doc["probes"]:
        if any(get_path(r["cells"].get(p), "test", "mean") is not None for r in doc["configurations"]):
            out.append(plot_svg(doc, p))
        else:
            out.append(f'<p class="plot">{escape(p)}: no finished run with a score</p>')
    return out + ["</div>"]


# --------------------------------------------------------------------------- the page
def _header(title: str, provenance: dict | None, doc: dict) -> list[str]:
    out = [f"<h1>{escape(title)}</h1>"]
    if provenance:
        rows = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(_value(provenance[k]))}</td></tr>"
                       for k in sorted(provenance))  # fmt: skip
        out.append(f'<table id="experiment">{rows}</table>')
    if doc.get("random_init_used"):
        out.append('<p class="banner"><b>WARNING: RANDOM-INIT FEATURES.</b> At least one run used an encoder '
                   "with randomly initialised weights: its scores only show that the pipeline runs.</p>")
    out.append(f"<p>{doc['n_runs']} runs, {len(doc['configurations'])} configurations, {len(doc['probes'])} "
               "probes. Rates in %; Level 1 errors in pixels (lower is better). Hover a cell for its provenance."
               "</p>")  # fmt: skip
    return out


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(json_safe(v), sort_keys=True)


def render_html(title: str, provenance: dict | None, doc: dict) -> str:
    """The page (a str); the same arguments give the same text."""
    body = [*_header(title, provenance, doc),
            '<p><label>Filter rows: <input id="filter" type="search" placeholder="encoder, mode, head, probe">'
            "</label> <small>(click a column header to sort)</small></p>",
            *main_table(doc), *plots(doc), "<h2>Controls</h2>", *controls_table(doc), *provenance_details(doc)]
    head = f'<meta charset="utf-8"><title>{escape(title)}</title><style>{CSS}</style>'
    return "\n".join(["<!DOCTYPE html>", f'<html lang="en"><head>{head}</head><body>', *body,
                      f"<script>{JS}</script>", "</body></html>"]) + "\n"  # fmt: skip


def write_html(doc: dict, out: Path, *, title: str, provenance: dict | None, prefixes: list[str]) -> Path:
    """Write ``out/report.html``; a local path in the text (``prefixes``) is a :class:`ConfigError`."""
    from spar_bench.outputs import write_bytes

    text = render_html(title, provenance, doc)
    leaked = local_paths([text], prefixes)
    if leaked:
        raise ConfigError(f"{out / HTML_FILE}: would publish a local path ({leaked[0][:80]}); re-run it with this version")
    Path(out).mkdir(parents=True, exist_ok=True)
    write_bytes(Path(out) / HTML_FILE, text)
    return Path(out) / HTML_FILE


__all__ = ["HTML_FILE", "render_html", "write_html"]
