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
from spar_bench.outputs import write_bytes
from spar_bench.probes.measured import HARNESS_PROMPT, NOT_MEASURED
from spar_bench.probes.runs.report import with_spread
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

CSS = """body{font:14px/1.4 sans-serif;margin:1em;color:#222}
.scroll{overflow-x:auto;max-width:100%}table{border-collapse:collapse;margin:.5em 0 1.5em}
table.data{width:100%}th,td{border:1px solid #ccc;padding:3px 5px;overflow-wrap:anywhere;vertical-align:top}
th{background:#eef;cursor:pointer;user-select:none}td.num{text-align:right;font-variant-numeric:tabular-nums}
td[title]{text-decoration:underline dotted #999}.banner{background:#fdd;border:1px solid #c00;padding:.5em}
td span{display:block;white-space:normal}.blind,.n{color:#555;font-size:90%}.better{color:#1a7f37}
.worse{color:#b42318}.same{color:#555}.nm{color:#b42318;font-style:italic}tbody.unit{border-top:3px solid #99a}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,560px),1fr));gap:12px}
.plot{border:1px solid #ddd;padding:4px;max-width:100%}svg.plot{width:100%;height:auto;display:block}
#filter{font-size:14px;padding:4px;width:min(24em,90%)}caption{text-align:left;font-weight:bold}
details{margin:.2em 0}small{color:#555}ul.flags li{margin:.1em 0}
#main td:nth-child(-n+3),#main th:nth-child(-n+3){overflow-wrap:normal;min-width:3.5em}
#main td:first-child{min-width:9em}
@media (max-width:700px){table.cards thead{display:none}table.cards,table.cards tbody,table.cards tr,
table.cards td{display:block;width:auto}table.cards tr{border:1px solid #99a;margin:0 0 .6em}
table.cards td{border:0;border-bottom:1px solid #eee;text-align:left}
table.cards td::before{content:attr(data-label);display:block;font-weight:bold;color:#334}
table.cards caption{display:block;width:auto}}"""

#: sorting: within each <tbody> (one unit: a probe), by the clicked column's data-value; the
#: filter: a query naming probes keeps those probes' columns (every row), any other text keeps
#: the rows holding it
JS = """function sortBy(th){const t=th.closest('table'),i=th.cellIndex,up=th.dataset.dir!=='asc';
th.dataset.dir=up?'asc':'desc';const key=r=>{const c=r.cells[i];if(!c)return '';const v=c.dataset.value;
return v===undefined?c.textContent:(v===''?null:parseFloat(v));};
for(const b of t.tBodies){const rows=[...b.rows];rows.sort((a,c)=>{const x=key(a),y=key(c);if(x===y)return 0;
if(x===null)return 1;if(y===null)return -1;return (x<y?-1:1)*(up?1:-1);});rows.forEach(r=>b.appendChild(r));}}
document.querySelectorAll('table.data th').forEach(th=>th.addEventListener('click',()=>sortBy(th)));
function filterBy(q){document.querySelectorAll('table.data').forEach(t=>{
const heads=[...t.tHead.rows[0].cells],probes=heads.filter(h=>h.dataset.probe!==undefined);
const hit=q!==''&&probes.some(h=>h.dataset.probe.toLowerCase().includes(q));
heads.forEach((h,i)=>{const show=!hit||h.dataset.probe===undefined||h.dataset.probe.toLowerCase().includes(q);
h.hidden=!show;for(const b of t.tBodies)for(const r of b.rows)if(r.cells[i])r.cells[i].hidden=!show;});
for(const b of t.tBodies)for(const r of b.rows)r.hidden=!hit&&q!==''&&!r.textContent.toLowerCase().includes(q);});}
document.getElementById('filter').addEventListener('input',e=>filterBy(e.target.value.toLowerCase()));"""


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


def _td(text: str, value: Any = None, title: str = "", numeric: bool = True, label: str = "") -> str:
    attrs = (f' data-value="{_num(value)}"' if numeric else "") + (f' title="{escape(title)}"' if title else "")
    attrs += f' data-label="{escape(label)}"' if label else ""
    return f'<td{" class=num" if numeric else ""}{attrs}>{escape(text)}</td>'


def _html_td(spans: list[str], value: Any, title: str, label: str) -> str:
    """A number cell of several lines (``spans``: escaped HTML), sorted by ``value``."""
    return (f'<td class=num data-value="{_num(value)}" data-label="{escape(label)}"'
            + (f' title="{escape(title)}"' if title else "") + f">{''.join(spans)}</td>")


def cell_provenance(cell: dict) -> str:
    """One cell's provenance in a few lines (the hover text)."""
    runs = cell.get("runs", [])
    return "\n".join([f"runs: {', '.join(r['run'] for r in runs)}", f"seeds: {', '.join(map(str, cell.get('seeds', [])))}",
                      f"build: {distinct(runs, 'build')} ({distinct(runs, 'build_fingerprint')})",
                      f"cache fingerprint: {distinct(runs, 'cache_fingerprint')}",
                      f"weights: {distinct(runs, 'weights')}",
                      f"protocol: {distinct(runs, 'protocol_version')}"])  # fmt: skip


def _unmeasured(s: Any) -> bool:
    return isinstance(s, dict) and bool(s.get("not_measured"))


def mean_text(s: dict | None, pct: bool, std: bool = True) -> str:
    """``mean ± std`` over seeds (the mean alone for one seed: no ``± 0.00``; ``std=False``: the
    mean alone), ``not measured``, ``-``."""
    if _unmeasured(s):
        return NOT_MEASURED
    mean = get_path(s, "mean")
    if mean is None:
        return "-"
    if not std or s.get("std") is None:
        return fmt(mean, pct)
    return with_spread(fmt(mean, pct), fmt(s["std"], pct), s.get("n") or 1, "±")


def _mean_td(cell: dict | None, key: str, pct: bool | None = None, title: str = "", label: str = "") -> str:
    s = (cell or {}).get(key)
    pct = (cell or {}).get("percent", False) if pct is None else pct
    return _td(mean_text(s, pct, std=False), get_path(s, "mean"), title, label=label)


def higher_is_better(cell: dict) -> bool:
    return METRICS[cell["metric"]].higher_is_better if cell.get("metric") in METRICS else True


def gap(cell: dict) -> dict[str, Any] | None:
    """model - blind: ``mean`` (of the seed means), a conservative ``interval`` (the model's
    mean 95 % CI less the blind one's; the blind mean where it has none) and ``mark``:
    ``better`` / ``worse`` than blind in the metric's own direction when the interval excludes
    0, else ``same``. None when either side is missing or not measured."""
    t, b = cell.get("test"), cell.get("blind")
    if _unmeasured(t) or _unmeasured(b) or get_path(t, "mean") is None or get_path(b, "mean") is None:
        return None
    d = t["mean"] - b["mean"]
    lo, hi = t.get("ci_low"), t.get("ci_high")
    blo, bhi = (b.get("ci_low"), b.get("ci_high")) if b.get("ci_low") is not None else (b["mean"], b["mean"])
    interval = None if lo is None or hi is None else (lo - bhi, hi - blo)
    up = higher_is_better(cell)
    mark = "same"
    if interval is not None and (interval[0] > 0 or interval[1] < 0):
        mark = "better" if (interval[0] > 0) == up else "worse"
    return {"mean": d, "interval": interval, "mark": mark}


#: a gap's mark: its arrow (the plots) and the words beside it (the tables)
MARK_ARROW = {"better": "▲", "worse": "▼", "same": "≈"}
MARK_TEXT = {k: f"{MARK_ARROW[k]} {w}" for k, w in
             {"better": "beats blind", "worse": "below blind", "same": "tied with blind"}.items()}


def gap_html(cell: dict) -> str:
    """model - blind as a line: the difference, its interval, the test patients, the mark."""
    g = gap(cell)
    if g is None:
        return ""
    pct = cell["percent"]
    iv = "" if g["interval"] is None else f" [{signed(g['interval'][0], pct)}, {signed(g['interval'][1], pct)}]"
    n = f", {cell['patients']} test patients" if cell.get("patients") is not None else ""
    return (f'<span class="d {g["mark"]}">Δ {escape(signed(g["mean"], pct))}{escape(iv)}{escape(n)} '
            f'{MARK_TEXT[g["mark"]]}</span>')


def main_cell(cell: dict, probe: str) -> str:
    """Model (mean ± std over seeds), blind, model - blind with its interval and mark."""
    pct, t = cell["percent"], cell.get("test")
    spans = [f'<span class="{"nm" if _unmeasured(t) else "m"}">{escape(mean_text(t, pct))}</span>']
    if cell.get("blind") is not None:
        b = cell["blind"]
        spans.append(f'<span class="{"nm" if _unmeasured(b) else "blind"}">blind {escape(mean_text(b, pct))}</span>')
    spans.append(gap_html(cell))
    if cell.get("harness_prompt"):
        spans.append(f'<span class="n">({HARNESS_PROMPT})</span>')
    return _html_td(spans, get_path(t, "mean"), cell_provenance(cell), probe)


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
    return [_td(row_label(row, builds), numeric=False, label="configuration"),
            _td(row["mode"], numeric=False, label="mode"), _td(row["head"], numeric=False, label="head")]


# --------------------------------------------------------------------------- tables
def _table(tid: str, caption: str, head: list[str], bodies: list[list[str]], probes: dict[int, str] | None = None,
           cards: bool = True) -> list[str]:
    """A sortable table; ``bodies``: one <tbody> of rows each (a unit: sorting stays inside it);
    ``probes``: column index -> the probe it shows (the filter keeps those columns)."""
    probes = probes or {}
    named = {i: f' data-probe="{escape(p)}"' for i, p in probes.items()}
    ths = "".join(f"<th{named.get(i, '')}>{escape(h)}</th>" for i, h in enumerate(head))
    tbodies = [f'<tbody class="unit">{"".join(rows)}</tbody>' for rows in bodies if rows]
    cls = "data cards" if cards else "data"
    return [f'<div class="scroll"><table class="{cls}" id="{tid}"><caption>{escape(caption)}</caption>',
            f"<thead><tr>{ths}</tr></thead>", *tbodies, "</table></div>"]  # fmt: skip


def main_table(doc: dict) -> list[str]:
    """Configurations x probes: each cell the model, its blind baseline and model - blind with
    its interval and mark; provenance on hover."""
    probes, rows = doc["probes"], []
    for r in doc["configurations"]:
        cells = [main_cell(r["cells"][p], p) if p in r["cells"] else _td("-", label=p) for p in probes]
        seeds = _td(str(len(r["seeds"])), len(r["seeds"]), label="seeds")
        rows.append(f'<tr>{"".join(_key_tds(r, several_builds(doc)))}{seeds}{"".join(cells)}</tr>')
    head = ["configuration", "mode", "head", "seeds", *(f"{p} {metric_label(p)}" for p in probes)]
    caption = ("Main table: per probe the model (mean ± std over seeds), its blind baseline, and Δ = model - "
               "blind with a conservative 95 % interval (rates in %)")
    return _table("main", caption, head, [rows], {4 + j: p for j, p in enumerate(probes)})


def _controls(doc: dict) -> list[str]:
    cells = [c for r in doc["configurations"] for c in r["cells"].values()]
    return [k for k, (key, _) in CONTROLS.items() if k in ("plain", "blind") or any(c.get(key) for c in cells)]


def _control_row(doc: dict, r: dict, p: str, cols: list[str], parse: bool) -> str:
    c = r["cells"][p]
    title = cell_provenance(c)
    tds = [_mean_td(c, CONTROLS[k][0], True if CONTROLS[k][1] else None, title, k) for k in cols]
    g = gap(c)
    tds.append(_html_td([gap_html(c) or "-"], None if g is None else g["mean"], title, "model - blind"))
    tds += [_mean_td(c, "parse rate", True, title, "parse")] if parse else []
    tds += [_mean_td(c, k, title=title, label=k) for k in ("chance", "prior")]
    return f'<tr>{"".join(_key_tds(r, several_builds(doc)))}{_td(p, numeric=False, label="probe")}{"".join(tds)}</tr>'


def controls_table(doc: dict) -> list[str]:
    """One row per configuration x probe, the controls side by side as columns; one table body
    per probe (its unit), so sorting never mixes pixels and rates."""
    cols = _controls(doc)
    parse = any(c.get("parse rate") for r in doc["configurations"] for c in r["cells"].values())
    bodies = [[_control_row(doc, r, p, cols, parse) for r in doc["configurations"] if p in r["cells"]]
              for p in doc["probes"]]
    head = ["configuration", "mode", "head", "probe", *cols, "model - blind", *(["parse"] if parse else []),
            "chance", "prior"]
    caption = "Controls side by side, one block per probe (circular: CircularEval strict, MLLM only; rates in %)"
    return _table("controls", caption, head, bodies)


def conflict_table(doc: dict) -> list[str]:
    """Accuracy on the conflict items (the answer in the image is not the prior's), the blind
    head's under it: the README's headline comparison."""
    probes = [p for p in doc["probes"] if any(get_path(r["cells"].get(p), "conflict") for r in doc["configurations"])]
    if not probes:
        return []
    rows = []
    for r in doc["configurations"]:
        if not any(get_path(r["cells"].get(p), "conflict") for p in probes):
            continue
        tds = []
        for p in probes:
            c = r["cells"].get(p) or {}
            spans = [f'<span class="m">{escape(mean_text(c.get("conflict"), True))}</span>',
                     f'<span class="blind">blind {escape(mean_text(c.get("conflict_blind"), True))}</span>']
            tds.append(_html_td(spans, get_path(c, "conflict", "mean"), "", p))
        rows.append(f'<tr>{"".join(_key_tds(r, several_builds(doc)))}{"".join(tds)}</tr>')
    caption = ("Conflict items: accuracy where the answer in the image differs from the prior's (the prior "
               "scores 0 % there), the blind head's under it (%)")
    return ["<h2>Conflict items</h2>", *_table("conflict", caption, ["configuration", "mode", "head", *probes],
                                               [rows], {3 + j: p for j, p in enumerate(probes)})]


def flags_list(doc: dict) -> list[str]:
    """report.md's quality flags, per configuration and probe."""
    items = [f"<li><b>{escape(row_label(r, several_builds(doc)))}</b>, {escape(p)}: {escape(f)}</li>"
             for r in doc["configurations"] for p, c in r["cells"].items() for f in c.get("flags", [])]
    return ["<h2>Quality flags</h2>", f'<ul class="flags">{"".join(items)}</ul>' if items else "<p>None.</p>"]


def stage_table(doc: dict) -> list[str]:
    """Per MLLM probed by stage (``doc["stage_view"]``, experiment.md's stage tables): per probe
    the heads' headline at each stage with its blind baseline, then the model's own answer."""
    out = []
    for k, model in enumerate(doc.get("stage_view") or []):
        stages, vqa = model["stages"], model["vqa"]
        head = ["probe", *(s["stage"] for s in stages), *("answer" for _ in vqa)]
        probes = [p for p in doc["probes"] if any(p in s["row"]["cells"] for s in stages)]
        rows = []
        for p in probes:
            cells = [s["row"]["cells"].get(p) for s in stages] + [r["cells"].get(p) for r in vqa]
            tds = [_html_td(["-"] if c is None else [
                f'<span class="m">{escape(mean_text(c.get("test"), c["percent"]))}</span>',
                f'<span class="blind">blind {escape(mean_text(c.get("blind"), c["percent"]))}</span>'],
                get_path(c, "test", "mean"), "", h) for c, h in zip(cells, head[1:], strict=True)]
            rows.append(f'<tr>{_td(p, numeric=False, label="probe")}{"".join(tds)}</tr>')
        out += [f"<h2>By stage: {escape(model['model'])}</h2>",
                *_table(f"stages{k}", "Frozen heads on the model's features at each stage, its own answer last",
                        head, [rows])]
    return out


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
    g = gap(cell)
    if g is not None:
        arrow = MARK_ARROW[g["mark"]]
        out.append(f'<text class="gap {g["mark"]}" x="{left + BAR_W + 6}" y="{y + 14}" font-size="11" '
                   f'data-value="{_num(g["mean"])}">{signed(g["mean"], cell["percent"])}{arrow}</text>')
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
    width = left + BAR_W + 60
    out = [f'<svg class="plot" data-probe="{escape(probe)}" viewBox="0 0 {width} {height}" '
           f'preserveAspectRatio="xMinYMin meet" style="max-width:{width}px" font-family="sans-serif">',
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


def legend(doc: dict) -> list[str]:
    """How to read a main-table cell."""
    return ["<p><small>Each cell: the model (mean ± std over seeds; the mean alone for one seed), its blind "
            "baseline (the same head or question without the image), and Δ = model - blind with a conservative "
            "95 % interval (the model's mean patient-bootstrap CI less the blind one's) over the stated number of "
            f"test patients: {MARK_TEXT['better']} / {MARK_TEXT['worse']} when the interval excludes 0 in the "
            "metric's own direction (Level 1 pixel errors: lower is better), else "
            f"{MARK_TEXT['same']}. <i>{NOT_MEASURED}</i>: the answers were missing (--answers), never 0.</small></p>"]


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(json_safe(v), sort_keys=True)


def render_html(title: str, provenance: dict | None, doc: dict) -> str:
    """The page (a str); the same arguments give the same text."""
    body = [*_header(title, provenance, doc),
            '<p><label>Filter rows: <input id="filter" type="search" placeholder="encoder, mode, head, probe">'
            "</label> <small>(click a column header to sort)</small></p>",
            *legend(doc), *main_table(doc), *plots(doc), "<h2>Controls</h2>", *controls_table(doc),
            *conflict_table(doc), *flags_list(doc), *stage_table(doc), *provenance_details(doc)]
    head = f'<meta charset="utf-8"><title>{escape(title)}</title><style>{CSS}</style>'
    return "\n".join(["<!DOCTYPE html>", f'<html lang="en"><head>{head}</head><body>', *body,
                      f"<script>{JS}</script>", "</body></html>"]) + "\n"  # fmt: skip


def write_html(doc: dict, out: Path, *, title: str, provenance: dict | None, prefixes: list[str]) -> Path:
    """Write ``out/report.html``; a local path in the text (``prefixes``) is a :class:`ConfigError`."""

    text = render_html(title, provenance, doc)
    leaked = local_paths([text], prefixes)
    if leaked:
        raise ConfigError(f"{out / HTML_FILE}: would publish a local path ({leaked[0][:80]}); re-run it with this version")
    Path(out).mkdir(parents=True, exist_ok=True)
    write_bytes(Path(out) / HTML_FILE, text)
    return Path(out) / HTML_FILE


__all__ = ["HTML_FILE", "render_html", "write_html"]
