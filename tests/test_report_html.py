"""``report.html`` (issue 36, item 4): one self-contained page, checked in a real headless Chromium.

A tiny report ``doc`` is built directly (the shape of :func:`experiments.report.aggregate`:
a frozen and a scratch head, an MLLM; a pixel probe, a rate probe and a probe with no score) and
fed through :func:`write_experiment_report`, so ``report.html`` is written beside
``experiment.json`` and ``leaderboard.json`` from the same numbers. The Chromium tests skip when
``chromium`` is absent, except under ``CI`` (``.ci/run`` installs it), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from spar_bench.errors import ConfigError
from spar_bench.experiments import report as rep
from spar_bench.experiments.html import (
    HTML_FILE,
    render_html,
    row_label,
    several_builds,
    write_html,
)

PROBES = ["level1.localisation", "level2.arrangement", "level3.relative_position"]
PROVENANCE = {"experiment": "tiny", "file_sha256": "ab" * 32, "versions": {"spar-bench": "test"}}


def _s(mean: float, std: float = 0.01, ci: tuple | None = None, n: int = 2) -> dict:
    lo, hi = ci or (mean - 0.05, mean + 0.05)
    return {"mean": mean, "std": std, "ci_low": lo, "ci_high": hi, "n": n}


def _runs(folder: str, probe: str, seeds: list[int]) -> list[dict]:
    return [{"run": f"{folder}/{probe}/seed{s}", "seed": s, "build": "demo", "build_fingerprint": "f00dcafe1234",
             "cache": "vit.h5", "cache_fingerprint": "c0ffee123456", "weights": "random-init", "trained_on": None,
             "protocol_version": "2.0", "build_protocol_version": "2.0", "evals": []} for s in seeds]  # fmt: skip


def _cell(probe: str, folder: str, test: float | None, blind: float, pct: bool, **extra) -> dict:
    seeds = [0, 1]
    return {"metric": "accuracy" if pct else "med_px", "percent": pct, "seeds": seeds,
            "test": None if test is None else _s(test), "blind": _s(blind, ci=(None, None)), "mirror": None,
            "chance": {"mean": 0.5 if pct else 30.0, "std": 0.0, "ci_low": None, "ci_high": None, "n": 2},
            "majority": None, "prior": _s(0.55 if pct else 25.0), "transfer": {}, "runs": _runs(folder, probe, seeds),
            "paper": [], **extra}  # fmt: skip


def _row(encoder: str, mode: str, head: str, cells: dict) -> dict:
    return {"encoder": encoder, "head": head, "mode": mode, "options": "", "build": "demo (f00dcafe1234)",
            "random_init": mode == "frozen", "tag": "", "seeds": [0, 1], "cells": cells}  # fmt: skip


def tiny_doc() -> dict:
    l1, l2, l3 = PROBES
    frozen = _row("vit-tiny", "frozen", "mlp", {
        l1: _cell(l1, "frozen-vit", 12.345678, 20.5, False, mirror=_s(13.0)),
        l2: _cell(l2, "frozen-vit", None, 0.1, True),
        l3: _cell(l3, "frozen-vit", 0.8123456789, 0.61, True, mirror=_s(0.42))})  # fmt: skip
    scratch = _row("vit-tiny", "scratch", "mlp", {l3: _cell(l3, "scratch-vit", 0.7, 0.74, True)})
    mllm = _row("dummy", "MLLM", "vqa-loglik", {
        l3: _cell(l3, "mllm-dummy", 0.5, 0.45, True, **{"circular (strict)": _s(0.25), "parse rate": _s(1.0)})})
    return {"probes": PROBES, "transfer_targets": {}, "configurations": [frozen, scratch, mllm],
            "random_init_used": True, "n_runs": 10}  # fmt: skip


@pytest.fixture
def report(tmp_path, monkeypatch) -> Path:
    """write_experiment_report over the tiny doc (its reading of runs replaced)."""
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(rep, "load_runs", lambda runs: [])
    monkeypatch.setattr(rep, "aggregate", lambda runs: tiny_doc())
    out = tmp_path / "report"
    rep.write_experiment_report(tmp_path / "runs", out, title="Tiny <experiment>", provenance=PROVENANCE)
    return out


# --------------------------------------------------------------------------- the DOM
class Cells(HTMLParser):
    """Per table id: rows of (text, data-value) cells; the SVG plots' probe names and texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self.heads: dict[str, list[str]] = {}
        self.hidden: dict[str, list[bool]] = {}
        self.svgs: list[str] = []
        self.marks: dict[str, int] = {}
        self._table: str | None = None
        self._cell: list | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id") if "data" in str(a.get("class", "")).split() else None
            if self._table is None:
                return
            self.tables[self._table], self.heads[self._table], self.hidden[self._table] = [], [], []
        elif tag == "tr" and self._table and self.heads[self._table]:
            self.tables[self._table].append([])
            self.hidden[self._table].append("hidden" in a)
        elif tag in ("td", "th") and self._table:
            self._cell = [tag, "", a.get("data-value")]
        elif tag == "svg":
            self.svgs.append(a.get("data-probe"))
        elif tag == "line" and str(a.get("class", "")).startswith("mark-"):
            self.marks[a["class"]] = self.marks.get(a["class"], 0) + 1

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table:
            kind, text, value = self._cell
            if kind == "th" and not self.tables[self._table]:
                self.heads[self._table].append(text)
            else:
                self.tables[self._table][-1].append((text, value))
            self._cell = None
        elif tag == "table":
            self._table = None


def parse(text: str) -> Cells:
    p = Cells()
    p.feed(text)
    return p


def _value(cell: tuple[str, str | None]) -> float | None:
    return None if not cell[1] else float(cell[1])


def check_json_values(dom: Cells, out: Path) -> None:
    """Any report: the main table equals experiment.json; the controls equal leaderboard.json."""
    doc = json.loads((out / "experiment.json").read_text(encoding="utf-8"))
    board = json.loads((out / "leaderboard.json").read_text(encoding="utf-8"))
    main = dom.tables["main"]
    assert [r[0][0] for r in main] == [row_label(c, several_builds(doc)) for c in doc["configurations"]]
    for row, cfg in zip(main, doc["configurations"], strict=True):
        for j, p in enumerate(doc["probes"]):
            assert _value(row[4 + j]) == ((cfg["cells"].get(p) or {}).get("test") or {}).get("mean")
    head = dom.heads["controls"]
    by = {(r[0][0], r[3][0]): dict(zip(head, r, strict=True)) for r in dom.tables["controls"]}
    assert len(by) == sum(len(c["cells"]) for c in doc["configurations"])
    cols = {"plain": "mean", "blind": "blind", "model - blind": "blind_gap", "mirror": "mirror",
            "flipped": "flipped", "chance": "chance", "prior": "prior"}  # fmt: skip
    for cfg, lb in zip(doc["configurations"], board["rows"], strict=True):
        for p, e in lb["probes"].items():
            got = by[(row_label(cfg, several_builds(doc)), p)]
            assert {c: _value(got[c]) for c in cols if c in got} == {c: e[k] for c, k in cols.items() if c in got}
            circular = (cfg["cells"][p].get("circular (strict)") or {}).get("mean")
            assert "circular" not in got or _value(got["circular"]) == circular


def check_values(dom: Cells, out: Path) -> None:
    """The tiny doc's report: its rows, columns and the MLLM's CircularEval in %."""
    check_json_values(dom, out)
    assert [r[0][0] for r in dom.tables["main"]] == ["vit-tiny (random-init) frozen mlp", "vit-tiny scratch mlp",
                                                     "dummy MLLM vqa-loglik"]  # fmt: skip
    assert dom.heads["controls"][4:] == ["plain", "circular", "mirror", "blind", "model - blind", "parse", "chance",
                                         "prior"]
    mllm = [r for r in dom.tables["controls"] if r[0][0] == "dummy MLLM vqa-loglik"]
    assert mllm[0][5] == ("25.0", "0.25")  # circular (strict), in %


# --------------------------------------------------------------------------- no browser
def test_report_html_is_written_beside_experiment_json_and_self_contained(report) -> None:
    text = (report / HTML_FILE).read_text(encoding="utf-8")
    assert sorted(p.name for p in report.iterdir()) == sorted(
        ["experiment.md", "experiment.json", "experiment.png", "leaderboard.csv", "leaderboard.json", HTML_FILE])
    for external in ("http:", "https:", "<link", " src=", "url(", "@import"):
        assert external not in text, external
    assert "<script>" in text and "<style>" in text and "Tiny &lt;experiment&gt;" in text
    check_values(parse(text), report)


def test_plots_name_configurations_and_draw_reference_marks(report) -> None:
    text = (report / HTML_FILE).read_text(encoding="utf-8")
    dom = parse(text)
    assert dom.svgs == ["level1.localisation", "level3.relative_position"]  # level2: no score, no empty axis
    assert "level2.arrangement: no finished run with a score" in text
    rel = text.split('<svg class="plot" data-probe="level3.relative_position"', 1)[1].split("</svg>", 1)[0]
    for name in ("vit-tiny (random-init) frozen mlp", "vit-tiny scratch mlp", "dummy MLLM vqa-loglik"):
        assert f">{name}</text>" in rel  # configurations named on the axis
    assert rel.count('class="mark-blind"') == rel.count('class="mark-chance"') == rel.count('class="mark-prior"') == 3
    assert rel.count('text-anchor="middle">100</text>') == 1  # a round axis end for rates
    # model - blind per row (81.2 - 61.0; 70.0 - 74.0), marked by whether its interval excludes 0
    assert '>+20.2▲</text>' in rel and '>-4.0≈</text>' in rel


def test_same_doc_same_bytes_and_provenance_on_hover(tmp_path) -> None:
    a = write_html(tiny_doc(), tmp_path / "a", title="t", provenance=PROVENANCE, prefixes=[str(tmp_path)])
    b = write_html(tiny_doc(), tmp_path / "b", title="t", provenance=PROVENANCE, prefixes=[str(tmp_path)])
    assert a.read_bytes() == b.read_bytes()
    text = a.read_text(encoding="utf-8")
    assert 'title="runs: frozen-vit/level3.relative_position/seed0, frozen-vit/level3.relative_position/seed1&#10;seeds: 0, 1' in text.replace(
        "\n", "&#10;")
    assert "<details><summary>dummy MLLM vqa-loglik</summary>" in text


def test_a_local_path_in_the_page_is_refused(tmp_path) -> None:
    doc = tiny_doc()
    doc["configurations"][0]["cells"][PROBES[0]]["runs"][0]["weights"] = f"{tmp_path}/weights.pt"
    with pytest.raises(ConfigError, match=r"report\.html: would publish a local path"):
        write_html(doc, tmp_path / "out", title="t", provenance=None, prefixes=[str(tmp_path)])
    assert not (tmp_path / "out" / HTML_FILE).exists()
    assert "weights.pt" in render_html("t", None, doc)  # rendering alone checks nothing


# --------------------------------------------------------------------------- headless Chromium
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed, and CI is set: .ci/run installs it (apt-get install chromium)")
    pytest.skip("chromium is not installed (apt-get install chromium); CI fails here instead")


def run_chromium(page: Path, tmp: Path, *args: str) -> str:
    argv = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}", *args, page.as_uri()]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, encoding="utf-8", errors="replace", timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def with_script(page: Path, script: str, name: str) -> Path:
    """A copy of the page that acts as a user once the page's own script has run."""
    text = page.read_text(encoding="utf-8").replace("</body>", f"<script>{script}</script></body>")
    (page.parent / name).write_text(text, encoding="utf-8")
    return page.parent / name


def test_chromium_dom_equals_the_json(report, tmp_path) -> None:
    dom = parse(run_chromium(report / HTML_FILE, tmp_path, "--dump-dom"))
    check_values(dom, report)
    assert dom.svgs == ["level1.localisation", "level3.relative_position"]


def test_chromium_sorts_and_filters(report, tmp_path) -> None:
    col = 4 + PROBES.index("level3.relative_position") + 1  # nth-child is 1-based
    sort = with_script(report / HTML_FILE, f"document.querySelector('#main th:nth-child({col})').click();", "s.html")
    rows = parse(run_chromium(sort, tmp_path, "--dump-dom")).tables["main"]
    assert [r[col - 1][1] for r in rows] == ["0.5", "0.7", "0.8123456789"]  # ascending on the first click
    filt = with_script(report / HTML_FILE, "const f=document.getElementById('filter');f.value='SCRATCH';"
                       "f.dispatchEvent(new Event('input'));", "f.html")  # fmt: skip
    dom = parse(run_chromium(filt, tmp_path, "--dump-dom"))
    shown = [r[0][0] for r, h in zip(dom.tables["main"], dom.hidden["main"], strict=True) if not h]
    assert shown == ["vit-tiny scratch mlp"]


def test_chromium_screenshot_is_not_blank(report, tmp_path) -> None:
    from PIL import Image

    shot = tmp_path / "shot.png"
    run_chromium(report / HTML_FILE, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000")
    img = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
    assert img.shape == (2000, 1280)
    ink = float((img < 200).mean())
    assert 0.01 < ink < 0.6 and img.std() > 20, (ink, img.std())  # text, tables and bars, not a blank page
    if os.environ.get("SPAR_KEEP_SCREENSHOT"):  # to look at it: SPAR_KEEP_SCREENSHOT=path
        shutil.copy(shot, os.environ["SPAR_KEEP_SCREENSHOT"])


def test_chromium_on_a_real_run(pipeline, tmp_path) -> None:
    """A real ``spar-probe vqa`` run (the dummy MLLM: blind, mirror, CircularEval) through the
    experiment report: Chromium's DOM equals experiment.json and leaderboard.json (a few seconds
    past the session's ``pipeline``, which 30 test files share)."""
    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    runs = tmp_path / "runs"
    assert run_cmd(cli, ["vqa", "--model", "dummy", "--data", pipeline["shards"], "--out", runs / "vqa",
                         "--probe", "relative_position,symmetry", "--bootstrap", 20]) == 0  # fmt: skip
    rep.write_experiment_report(runs, tmp_path / "report", title="vqa", provenance=PROVENANCE)
    dom = parse(run_chromium(tmp_path / "report" / HTML_FILE, tmp_path, "--dump-dom"))
    check_json_values(dom, tmp_path / "report")
    assert "circular" in dom.heads["controls"] and "mirror" in dom.heads["controls"]
    assert dom.svgs == ["level3.relative_position", "level3.symmetry"]


def test_rows_of_two_builds_name_their_build() -> None:
    doc = tiny_doc()
    doc["configurations"][1]["build"] = "other (0123456789ab)"
    dom = parse(render_html("t", None, doc))
    assert [r[0][0] for r in dom.tables["main"]][:2] == ["vit-tiny (random-init) frozen mlp on demo (f00dcafe1234)",
                                                         "vit-tiny scratch mlp on other (0123456789ab)"]  # fmt: skip


# --------------------------------------------------------------------------- issue 46: the page at a glance
def test_cells_hold_model_blind_and_a_directed_gap(tmp_path) -> None:
    """Level 1 (pixels, lower is better): 12.3 px against blind 20.5 px beats blind; a rate
    probe's interval across 0 is not apart; one seed shows no ``± 0.00``; missing answers read
    "not measured", never 0."""
    doc = tiny_doc()
    l1, _, l3 = PROBES
    worse = doc["configurations"][1]["cells"][l3]
    worse.update(test=_s(0.5, n=1, std=0.0), blind=_s(0.74, ci=(0.7, 0.78), n=1, std=0.0), patients=2)
    doc["configurations"][2]["cells"][l3]["blind"] = {"not_measured": True}
    dom = parse(render_html("t", None, doc))
    main = {r[0][0]: r for r in dom.tables["main"]}
    px = main["vit-tiny (random-init) frozen mlp"][4][0]
    assert px.startswith("12.35 ± 0.01blind 20.50 ± 0.01Δ -8.15 [-8.20, -8.10]") and "beats blind" in px
    rate = main["vit-tiny scratch mlp"][6][0]
    assert rate == "50.0blind 74.0Δ -24.0 [-33.0, -15.0], 2 test patients ▼ below blind"  # no "± 0.0"
    assert "±" not in rate
    mllm = main["dummy MLLM vqa-loglik"][6][0]
    assert "blind not measured" in mllm and "Δ" not in mllm and "0.0" not in mllm.split("blind")[1]


def test_the_page_shows_conflicts_flags_parse_rate_and_stages() -> None:
    doc = tiny_doc()
    l3 = PROBES[2]
    cell = doc["configurations"][0]["cells"][l3]
    cell.update(conflict=_s(0.56), conflict_blind=_s(0.29), flags=["intervals over 2 test patients only"])
    doc["stage_view"] = [{"model": "llava@12345678", "stages": [{"stage": "vision", "row": doc["configurations"][0]}],
                          "vqa": [doc["configurations"][2]]}]
    text = render_html("t", None, doc)
    dom = parse(text)
    assert dom.tables["conflict"][0][3][0] == "56.0 ± 1.0blind 29.0 ± 1.0"
    assert "intervals over 2 test patients only" in text and "<h2>Quality flags</h2>" in text
    assert "parse" in dom.heads["controls"] and dom.heads["stages0"] == ["probe", "vision", "answer"]
    assert [r[0][0] for r in dom.tables["stages0"]] == PROBES


WIDTHS = (1920, 390)
#: what overflows the viewport, measured in the page
MEASURE = """(() => {const w=window.innerWidth,r=e=>e.getBoundingClientRect();return {w,
page:document.documentElement.scrollWidth,main:r(document.getElementById('main')).right,
plots:[...document.querySelectorAll('svg.plot')].map(s=>r(s).right),
bars:[...document.querySelectorAll('svg.plot rect.bar')].map(b=>[r(b).left,r(b).right])};})()"""


class DevTools:
    """Headless Chromium driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``:
    no port is opened), for what flags cannot do: a 390 px viewport (headless windows are at
    least 500 px wide), evaluating a script and a screenshot of that viewport."""

    def __init__(self, tmp: Path):
        read_here, write_there = os.pipe()
        read_there, write_here = os.pipe()
        argv = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--remote-debugging-pipe",
                "--hide-scrollbars", "--no-first-run", f"--user-data-dir={tmp / 'cdp-profile'}", "about:blank"]

        def fds() -> None:  # Chromium reads commands on fd 3 and writes replies on fd 4
            os.dup2(read_there, 3)
            os.dup2(write_there, 4)

        self.proc = subprocess.Popen(argv, pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(read_there)
        os.close(write_there)
        self.out, self.inp = os.fdopen(write_here, "wb", buffering=0), os.fdopen(read_here, "rb", buffering=0)
        self.buf, self.n = b"", 0

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        self.out.write(json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self.buf:
                chunk = self.inp.read(1 << 16)
                assert chunk, "chromium closed the DevTools pipe"
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.n:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    def page(self, url: str, width: int, height: int, expression: str, shot: Path):
        """Open ``url`` in a ``width`` x ``height`` viewport: the value of ``expression`` once it has
        loaded; its screenshot into ``shot``."""
        import base64
        import time

        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        s = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, s)
        self.call("Page.navigate", {"url": url}, s)
        for _ in range(400):
            got = self.call("Runtime.evaluate", {"expression": "document.readyState", "returnByValue": True}, s)
            if got["result"]["value"] == "complete":
                break
            time.sleep(0.05)
        value = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, s)["result"]["value"]
        shot.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, s)["data"]))
        return value

    def close(self) -> None:
        self.out.write(json.dumps({"id": self.n + 1, "method": "Browser.close"}).encode() + b"\0")
        self.proc.wait(timeout=60)


def wide_doc() -> dict:
    """16 probes x 9 configurations (the tiny doc's Level 3 cells copied): a full paper table."""
    import copy

    from spar_bench.probes.tasks import probe_names

    doc = tiny_doc()
    probes = probe_names()[:16]
    for r in doc["configurations"]:
        base = r["cells"][PROBES[2]]
        r["cells"] = {p: copy.deepcopy(base) for p in probes}
    doc["probes"], doc["configurations"] = probes, copy.deepcopy(doc["configurations"] * 3)
    return doc


@pytest.mark.slow
def test_chromium_nothing_overflows_at_1920_and_390_px(report, tmp_path) -> None:
    """At both widths, for the tiny report and a 16-probe one: the main table within the
    viewport (no horizontal scroll), every plot and every bar inside it; each screenshot is the
    viewport's width and not blank."""
    from PIL import Image

    chromium()
    wide = write_html(wide_doc(), tmp_path / "wide", title="wide", provenance=None, prefixes=[])
    browser = DevTools(tmp_path)
    try:
        for (name, page), width in ((pg, w) for pg in (("report", report / HTML_FILE), ("wide", wide))
                                    for w in WIDTHS):
            shot = tmp_path / f"{name}-{width}px.png"
            got = browser.page(page.as_uri(), width, 3000, MEASURE, shot)
            assert got["w"] == width
            assert got["page"] <= width and got["main"] <= width + 0.5, (width, got)
            assert got["plots"] and all(right <= width + 0.5 for right in got["plots"]), (width, got)
            assert got["bars"] and all(0 <= lo and hi <= width + 0.5 for lo, hi in got["bars"]), (width, got)
            img = np.asarray(Image.open(shot).convert("L"), dtype=np.float64)
            assert img.shape == (3000, width) and 0.005 < float((img < 200).mean()) < 0.6, width
            if os.environ.get("SPAR_KEEP_SCREENSHOT"):  # a folder: the screenshots are kept there
                shutil.copy(shot, Path(os.environ["SPAR_KEEP_SCREENSHOT"]) / shot.name)
    finally:
        browser.close()


def test_chromium_filters_on_a_probe_name_and_sorts_within_a_unit(report, tmp_path) -> None:
    filt = with_script(report / HTML_FILE, "const f=document.getElementById('filter');f.value='relative_pos';"
                       "f.dispatchEvent(new Event('input'));", "p.html")  # fmt: skip
    text = run_chromium(filt, tmp_path, "--dump-dom")
    dom = parse(text)
    assert not any(dom.hidden["main"])  # every configuration stays
    head = text.split('id="main"', 1)[1].split("</thead>", 1)[0]
    shown = [a for a in re.findall(r"<th(?=[ >])([^>]*)>", head) if "hidden" not in a]
    assert len(shown) == 4 + 1 and "level3.relative_position" in shown[-1]  # the keys and that probe
    col = 4 + 6  # controls: configuration, mode, head, probe, plain, circular, mirror, blind, Δ -> 9th (1-based 9)
    assert dom.heads["controls"][col - 2] == "model - blind"
    sort = with_script(report / HTML_FILE, f"document.querySelector('#controls th:nth-child({col - 1})').click();",
                       "c.html")
    text = run_chromium(sort, tmp_path, "--dump-dom")
    blocks = text.split('id="controls"', 1)[1].split("</table>", 1)[0].split('<tbody class="unit">')[1:]
    for block in blocks:  # each probe's rows sorted on their own: pixels never among rates
        values = [float(v) for v in re_values(block, col - 2)]
        assert values == sorted(values)
    assert len(blocks) == len(PROBES)  # one block per probe


def re_values(block: str, index: int) -> list[str]:
    """The data-value of cell ``index`` of each row of a <tbody>'s HTML (rows with one)."""
    out = []
    for row in block.split("<tr>")[1:]:
        cells = row.split("<td")[1:]
        v = cells[index].split('data-value="', 1)[1].split('"', 1)[0] if 'data-value="' in cells[index] else ""
        if v:
            out.append(v)
    return out
