"""The experiment's leaderboard: one row per configuration, the paper's numbers beside it.

``leaderboard.json`` and ``leaderboard.csv`` are written beside ``experiment.md``
(:func:`write_leaderboard`): per configuration its run folder, mode, head, seeds, protocol and
build fingerprint, and per probe the headline (mean, std over seeds, mean 95 % interval), the
blind baseline and the gap to it, the mirrored and flipped controls, chance, the prior, each
transfer target, and the numbers the paper states for that configuration
(``paper_numbers.json``, package data: :func:`paper_numbers`). A dry run writes the planned rows
with the paper's numbers alone (:func:`write_reference_leaderboard`). :func:`compare` sets two
leaderboards side by side (``spar-bench compare A B``).
"""

from __future__ import annotations

import csv
import io
import json
from fnmatch import fnmatchcase
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.outputs import write_bytes
from spar_bench.probes.tasks import probe_names

JSON_FILE = "leaderboard.json"
CSV_FILE = "leaderboard.csv"
PAPER_FILE = "paper_numbers.json"
FORMAT = "spar-bench-leaderboard/1"


@cache
def paper_numbers() -> dict[str, Any]:
    """The numbers the paper states, with where it states them (package data)."""
    return json.loads(resources.files("spar_bench.experiments").joinpath(PAPER_FILE).read_text(encoding="utf-8"))


def paper_refs(folder: str, head: str, probe: str, on: str) -> list[dict[str, Any]]:
    """The paper's numbers for run folder ``folder`` (``frozen-rad-dino``), ``head``, ``probe``,
    on ``on`` (``test`` or ``transfer:<build>``)."""
    doc, out = paper_numbers(), []
    if folder not in doc["configurations"] and folder not in doc["mllms"]:
        return out  # not one of the paper preset's rows
    for n in doc["numbers"]:
        if n["probe"] != probe or n["on"] != on or not fnmatchcase(head, n["head"]):
            continue
        if folder in doc["configurations"] if n["folder"] == "*" else fnmatchcase(folder, n["folder"]):
            out.append({k: n[k] for k in ("value", "std", "range", "where", "guess") if k in n})
    return out


def ref_text(refs: list[dict[str, Any]], percent: bool) -> str:
    """``82.0`` or ``25.6-36.4`` (``>= 98.0``) in the table's unit; "" for none."""
    scale = 100.0 if percent else 1.0

    def num(x: float) -> str:
        return f"{x * scale:.{2 if 'std' in r else 1}f}" if percent else f"{x:.2f}"

    texts = []
    for r in refs:
        if "value" in r:
            texts.append(num(r["value"]) + (f" +- {num(r['std'])}" if "std" in r else ""))
        else:
            lo, hi = r["range"]
            texts.append(f">= {num(lo)}" if hi is None else f"{num(lo)}-{num(hi)}")
    return "; ".join(texts)


# --------------------------------------------------------------------------- rows
def _mean(s: dict | None) -> float | None:
    return None if not isinstance(s, dict) else s.get("mean")


def _folders(row: dict) -> str:
    names = sorted({run["run"].split("/")[0] for c in row["cells"].values() for run in c["runs"]})
    return "+".join(names)


def probe_entry(cell: dict[str, Any], folder: str, head: str, probe: str, targets: dict[str, str]) -> dict[str, Any]:
    """One configuration x probe of the leaderboard."""
    test, blind = cell.get("test") or {}, _mean(cell.get("blind"))
    mean = test.get("mean")
    entry = {"metric": cell["metric"], "percent": cell["percent"], "mean": mean, "std": test.get("std"),
             "ci": [test.get("ci_low"), test.get("ci_high")], "n_seeds": len(cell["seeds"]), "blind": blind,
             "blind_gap": None if mean is None or blind is None else mean - blind,
             "mirror": _mean(cell.get("mirror")), "flipped": _mean(cell.get("flipped")),
             "chance": _mean(cell.get("chance")), "prior": _mean(cell.get("prior")),
             "transfer": {targets.get(t, t): _mean(v.get("test")) for t, v in sorted(cell["transfer"].items())},
             "paper": paper_refs(folder, head, probe, "test")}  # fmt: skip
    for t in entry["transfer"]:
        entry.setdefault("paper_transfer", {})[t] = paper_refs(folder, head, probe, f"transfer:{t}")
    return entry


def leaderboard(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration of the experiment report's ``doc`` (:func:`.report.aggregate`)."""
    rows = []
    for r in doc["configurations"]:
        folder = _folders(r)
        runs = [run for c in r["cells"].values() for run in c["runs"]]
        rows.append({"folder": folder, "encoder": r["encoder"], "mode": r["mode"], "head": r["head"],
                     "options": r["options"], "build": r["build"], "random_init": r["random_init"], "tag": r["tag"],
                     "seeds": r["seeds"],
                     "protocol": sorted({str(x["protocol_version"]) for x in runs if x.get("protocol_version")}),
                     "build_fingerprint": sorted({str(x["build_fingerprint"]) for x in runs if x.get("build_fingerprint")}),
                     "probes": {p: probe_entry(c, folder, r["head"], p, doc["transfer_targets"])
                                for p, c in r["cells"].items()}})  # fmt: skip
    return rows


def planned_rows(exp) -> list[dict[str, Any]]:
    """The rows a plan will fill (mode x encoder x head, each MLLM), with the paper's numbers alone."""

    probes = list(probe_names()) if "all" in exp.probes else list(exp.probes)
    keys = [(f"{m}-{e}", h, m) for m, mode in exp.modes.items() for e in mode.encoders for h in mode.heads]
    keys += [(f"mllm-{n}", "*", "MLLM") for n in exp.mllms]
    rows = []
    for folder, head, mode in keys:
        cells = {p: {"paper": paper_refs(folder, head, p, "test"),
                     "paper_transfer": {t: paper_refs(folder, head, p, f"transfer:{t}") for t in exp.transfer}}
                 for p in probes}  # fmt: skip
        rows.append({"folder": folder, "mode": mode, "head": head, "seeds": list(exp.seeds), "probes": cells})
    return rows


# --------------------------------------------------------------------------- files
def _csv(rows: list[dict[str, Any]], probes: list[str]) -> str:
    head = ["folder", "encoder", "mode", "head", "options", "build", "seeds", "protocol", "build_fingerprint"]
    cols = [f"{p}{suffix}" for p in probes for suffix in ("", " std", " blind", " blind_gap", " mirror", " paper")]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head + cols)
    for r in rows:
        cells = []
        for p in probes:
            e = r["probes"].get(p, {})
            num = [e.get(k) for k in ("mean", "std", "blind", "blind_gap", "mirror")]
            cells += ["" if v is None else f"{v:.6g}" for v in num] + [ref_text(e.get("paper", []), False)]
        w.writerow([r.get("folder", ""), r.get("encoder", ""), r.get("mode", ""), r.get("head", ""),
                    r.get("options", ""), r.get("build", ""), " ".join(map(str, r.get("seeds", []))),
                    " ".join(r.get("protocol", [])), " ".join(r.get("build_fingerprint", [])), *cells])  # fmt: skip
    return buf.getvalue()


def _write(out: Path, doc: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    write_bytes(out / JSON_FILE, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    write_bytes(out / CSV_FILE, _csv(doc["rows"], doc["probes"]))
    return [out / JSON_FILE, out / CSV_FILE]


def write_leaderboard(doc: dict[str, Any], out: Path, provenance: dict | None = None) -> list[Path]:
    """``out/leaderboard.json`` and ``.csv`` of the report's ``doc``."""
    return _write(Path(out), {"format": FORMAT, "reference_only": False, "probes": doc["probes"],
                              "experiment": (provenance or {}).get("experiment"),
                              "paper": paper_numbers()["paper"], "rows": leaderboard(doc)})  # fmt: skip


def write_reference_leaderboard(exp, out: Path) -> list[Path]:
    """A dry run's leaderboard: the planned rows with the paper's numbers, no result."""
    rows = planned_rows(exp)
    probes = sorted({p for r in rows for p in r["probes"]})
    return _write(Path(out), {"format": FORMAT, "reference_only": True, "probes": probes, "experiment": exp.name,
                              "paper": paper_numbers()["paper"], "rows": rows})  # fmt: skip


# --------------------------------------------------------------------------- compare
def read_leaderboard(path: str | Path) -> dict[str, Any]:
    """A leaderboard.json, given as the file, its report folder or the experiment's OUT."""
    p = Path(path)
    for cand in (p, p / JSON_FILE, p / "report" / JSON_FILE):
        if cand.is_file():
            try:
                doc = json.loads(cand.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ConfigError(f"{cand}: not JSON ({e})") from None
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ConfigError(f"{cand}: not a SPAR-Bench leaderboard (format {FORMAT})")
            return doc
    raise ConfigError(f"{path}: no {JSON_FILE} (give the file, the report folder or the experiment's OUT)")


def _key(r: dict) -> tuple:
    return (r.get("folder"), r.get("head"), r.get("options", ""), r.get("build", ""))


def within(a: dict, b: dict) -> str:
    """``yes`` when each mean lies within the other's interval, ``no`` when neither does, else ``one``."""
    def inside(x, ci) -> bool:
        return x is not None and None not in ci and ci[0] <= x <= ci[1]

    n = inside(a.get("mean"), b.get("ci", [None, None])) + inside(b.get("mean"), a.get("ci", [None, None]))
    return {2: "yes", 1: "one", 0: "no"}[n]


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """A Markdown table: every configuration x probe both hold, A, B, B - A and whether within intervals."""
    rb = {_key(r): r for r in b["rows"]}
    lines = ["| configuration | probe | A | B | B - A | within intervals |", "|---|---|---|---|---|---|"]
    shared = 0
    for r in a["rows"]:
        other = rb.get(_key(r))
        if other is None:
            continue
        for p, e in r["probes"].items():
            f = other["probes"].get(p)
            if f is None or e.get("mean") is None or f.get("mean") is None:
                continue
            shared += 1
            scale = 100.0 if e.get("percent") else 1.0
            lines.append(f"| {r['folder']} {r['head']} | {p} | {e['mean'] * scale:.2f} | {f['mean'] * scale:.2f} "
                         f"| {(f['mean'] - e['mean']) * scale:+.2f} | {within(e, f)} |")
    only = sorted({f"{k[0]} {k[1]}" for k in set(rb) ^ {_key(r) for r in a["rows"]}})
    if not shared:
        raise ConfigError("the two leaderboards share no configuration x probe with results")
    tail = ["", f"In one leaderboard only: {', '.join(only)}"] if only else []
    return "\n".join(lines + tail) + "\n"
