"""An experiment as a plan: steps, each identified by the hash of its inputs and options.

:func:`make_plan` expands an :class:`~.config.Experiment` into steps in dependency order:

* ``build:<b>``: a phantom generated and built, or sources built (``spar-build``);
* ``cache:<e>@<b>``: the feature cache of frozen encoder ``e`` over build ``b``;
* ``heads:<e>``: the heads of the frozen mode, every probe x seed (``spar-probe sweep``);
* ``<mode>:<e>``: encoder and head trained end to end, ``finetune`` or ``scratch``;
* ``eval:<step>@<b>``: every run of a heads/finetune/scratch step scored on transfer build
  ``b`` without retraining (``spar-probe eval``: on ``b``'s cache, or re-encoding ``b``);
* ``vqa:<m>@<b>``: an MLLM asked build ``b``'s Level 3 questions (``spar-probe vqa``);
* ``report``: ``spar-probe report`` and the experiment's report over every run.

A step's hash covers its commands (paths inside ``out`` written relative to it), the hashes of
the steps it needs, and the digests of what it reads from outside (an existing build's
manifest fingerprint, a weights file's size and modification time): a step whose hash is
recorded as finished is skipped, one recorded with another hash is redone (its outputs
removed first), never both silently.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from .config import Experiment

#: the folder of each kind of output, under ``out``
BUILDS, CACHES, RUNS, REPORT, PLAN = "builds", "cache", "runs", "report", ".plan"


@dataclass(frozen=True)
class Step:
    """One unit of work: its commands (``(program, argv)``; ``{out}`` stands for the experiment's
    folder), the steps it needs, the paths under ``out`` it owns, and its estimated cost."""

    id: str
    kind: str
    commands: tuple[tuple[str, tuple[str, ...]], ...]
    needs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    inputs: tuple[tuple[str, str], ...] = ()  # (what, digest) read from outside the experiment
    cost: tuple[tuple[str, float], ...] = ()  # (unit, amount): images, runs, questions ...
    device: bool = False  # whether the commands take --device
    extra: tuple[tuple[str, Any], ...] = field(default=())  # what an internal step needs

    def ident(self, hashes: dict[str, str]) -> str:
        """sha256 of the commands, the needed steps' hashes and the outside inputs."""
        record = {"id": self.id, "kind": self.kind, "commands": [[p, list(a)] for p, a in self.commands],
                  "needs": {n: hashes[n] for n in self.needs}, "inputs": list(self.inputs),
                  "extra": [[k, v] for k, v in self.extra]}  # fmt: skip
        return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Plan:
    experiment: Experiment
    steps: list[Step]
    hashes: dict[str, str]

    def step(self, step_id: str) -> Step:
        for s in self.steps:
            if s.id == step_id:
                return s
        close = difflib.get_close_matches(step_id, [s.id for s in self.steps], n=1)
        hint = f"; did you mean {close[0]}?" if close else "; list the steps with --list"
        raise ConfigError(f"--only {step_id}: no such step in {self.experiment.source}{hint}")


# --------------------------------------------------------------------------- options as flags
def command_of(program: str, name: str | None):
    """The click command behind ``program`` (``spar-build``/``spar-probe``) and subcommand ``name``."""
    if program == "spar-build":
        from spar_bench.builder.cli import cli
    else:
        from spar_bench.probes.cli import cli
    if name is None:
        return cli
    import click

    return cli.get_command(click.Context(cli), name)


def flags(program: str, name: str | None, options: dict[str, Any], key: str, exp: Experiment) -> list[str]:
    """``options`` (``{samples_per_case: 8, hf: false}``) as the command's flags, each checked
    against the command's parameters; a misspelt key is one line naming the file and the key."""
    cmd = command_of(program, name)
    params = {p.name: p for p in cmd.params if getattr(p, "opts", None) and p.opts[0].startswith("--")}
    spelled = {o[2:].replace("-", "_"): p for p in params.values() for o in p.opts if o.startswith("--")}
    out: list[str] = []
    for k, v in options.items():
        kn = k.replace("-", "_")
        p = spelled.get(kn) or params.get(kn)
        if p is None and v is False and f"no_{kn}" in params:  # hf: false -> --no-hf
            out.append(params[f"no_{kn}"].opts[0])
            continue
        if p is None:
            close = difflib.get_close_matches(kn, list(spelled), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            what = f"{program} {name}" if name else program
            at = exp.where.at(f"{key}.{k}") if exp.where is not None else exp.source
            raise ConfigError(f"{at}: {key}.{k}: {what} has no option --{kn.replace('_', '-')}{hint}")
        out += _flag(p, v)
    return out


def _flag(p, v: Any) -> list[str]:
    if getattr(p, "is_flag", False):
        if p.secondary_opts:
            return [p.opts[0] if v else p.secondary_opts[0]]
        return [p.opts[0]] if v else []
    if isinstance(v, list) and getattr(p, "multiple", False):
        return [x for item in v for x in (p.opts[0], _text(item))]
    if isinstance(v, list):
        return [p.opts[0], ",".join(_text(x) for x in v)]
    if isinstance(v, dict):
        return [p.opts[0], json.dumps(v, sort_keys=True)]
    return [p.opts[0], _text(v)]


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# --------------------------------------------------------------------------- paths and digests
def build_dir(exp: Experiment, b: str) -> str:
    """Where build ``b`` is: its ``path:``, or ``{out}/builds/<b>``."""
    return exp.builds[b].path or f"{{out}}/{BUILDS}/{b}"


def cache_file(e: str, b: str) -> str:
    return f"{{out}}/{CACHE_DIR}/{e}@{b}.h5"


CACHE_DIR = CACHES


def run_folder(mode: str, e: str) -> str:
    """The runs of one mode x encoder: ``{out}/runs/<mode>-<encoder>`` (a step owns its folder)."""
    return f"{{out}}/{RUNS}/{mode}-{e}"


def _path_digest(path: str) -> str:
    """What an outside input is: a build's fingerprint, a file's size and modification time."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        try:
            return "fingerprint:" + json.loads((p / "manifest.json").read_text())["fingerprint"]
        except (OSError, ValueError, KeyError):
            return "unreadable manifest"
    if p.is_file():
        st = p.stat()
        return f"file:{st.st_size}:{st.st_mtime_ns}"
    if p.is_dir():  # every file's name, size and modification time (weights of one size that changed too)
        files = sorted((q.relative_to(p).as_posix(), q.stat().st_size, q.stat().st_mtime_ns)
                       for q in p.rglob("*") if q.is_file())
        return "folder:" + hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return "missing"


def local_path(spec: str) -> str | None:
    """The local file or folder an encoder spec names (``hf:DIR``, ``open_clip:local-dir:DIR``), or None."""
    parts = spec.split(":")
    for i in range(1, len(parts)):
        candidate = ":".join(parts[i:])
        if candidate and Path(candidate).exists():
            return candidate
    return None


#: cases of each public source (an estimate's input when a build is not made yet)
SOURCE_CASES = {"word": 150, "lits": 131, "totalsegmentator": 1228, "nnunet": 100}


def case_count(bd) -> int:
    """Cases a build will have: the phantom's ``n``, else the sources' public sizes."""
    if bd.phantom is not None:
        return int(bd.phantom.get("n", 12))
    return sum(SOURCE_CASES.get(s, 100) for s in bd.sources) if bd.sources else 0


def estimated_images(exp: Experiment, b: str) -> int:
    """Images of build ``b``: counted from its manifest when it exists, else estimated from its
    cases and options (per case: samples_per_case mosaics at Levels 1 and 2, as many Level 3
    slices, doubled with mirrored counterfactuals)."""
    bd = exp.builds[b]
    where = Path(bd.path) if bd.path else exp.out / BUILDS / b
    try:
        counts = json.loads((where / "manifest.json").read_text())["counts"]
        return int(sum(v.get("samples", v.get("slices", 0)) for lv in counts.values() for v in lv.values()
                       if isinstance(v, dict)))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    cases = case_count(bd)
    per = int(bd.options.get("samples_per_case", 32)) * 3
    return int(cases * per * (2 if bd.options.get("counterfactual") == "mirror" else 1))


# --------------------------------------------------------------------------- the steps
def build_step(exp: Experiment, b: str) -> Step | None:
    bd = exp.builds[b]
    if bd.path:
        return None
    out = build_dir(exp, b)
    opts = flags("spar-build", None, bd.options, f"builds.{b}.options", exp)
    commands = []
    if bd.phantom is not None:
        ph = {"n": 12, "layout": "canonical", **bd.phantom}
        root = f"{{out}}/{BUILDS}/{b}-phantom"
        commands.append(("spar-build", ("phantom", "--out", root, *flags("spar-build", "phantom", ph, f"builds.{b}.phantom", exp))))
        sources, roots = ["phantom"], [root]
    else:
        sources, roots = list(bd.sources), list(bd.roots)
    argv = [x for s in sources for x in ("--source", s)] + [x for r in roots for x in ("--root", r)]
    needs: tuple[str, ...] = ()
    if bd.thresholds_from:  # another build's size/distance thresholds: it comes first
        argv += ["--thresholds-from", build_dir(exp, bd.thresholds_from)]
        needs = _needs_build(exp, bd.thresholds_from)
    commands.append(("spar-build", tuple(argv + ["--out", out, *opts])))
    inputs = tuple((r, _path_digest(r)) for r in roots if not r.startswith("{out}"))
    return Step(f"build:{b}", "build", tuple(commands), needs, outputs=(out, f"{out}.tmp", *(roots if bd.phantom is not None else ())),
                inputs=inputs, cost=(("cases", float(case_count(bd))),))  # fmt: skip


def _needs_build(exp: Experiment, b: str) -> tuple[str, ...]:
    return () if exp.builds[b].path else (f"build:{b}",)


def _encoder_flags(exp: Experiment, e: str) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    enc = exp.encoders[e]
    argv = ["--encoder", enc.spec]
    if enc.weights:
        argv += ["--weights", enc.weights]
    if enc.revision:
        argv += ["--revision", enc.revision]
    inputs = ((enc.weights, _path_digest(enc.weights)),) if enc.weights else ()
    local = local_path(enc.spec)
    if local:
        inputs += ((local, _path_digest(local)),)
    return argv, inputs


def cache_step(exp: Experiment, e: str, b: str) -> Step:
    argv, inputs = _encoder_flags(exp, e)
    if exp.encoders[e].random_init:
        argv.append("--random-init")
    frozen = exp.modes["frozen"]
    argv += ["--data", build_dir(exp, b), "--out", cache_file(e, b), *flags("spar-probe", "cache", frozen.cache,
                                                                              "modes.frozen.cache", exp)]
    if exp.builds[b].path:
        inputs += ((exp.builds[b].path, _path_digest(exp.builds[b].path)),)
    return Step(f"cache:{e}@{b}", "cache", (("spar-probe", ("cache", *argv)),), _needs_build(exp, b),
                (cache_file(e, b),), inputs, (("images", float(estimated_images(exp, b))),), device=True)


def _probe_seed_flags(exp: Experiment) -> list[str]:
    return ["--probe", ",".join(exp.probes), "--seeds", ",".join(str(s) for s in exp.seeds)]


def heads_step(exp: Experiment, e: str) -> Step:
    m, b = exp.modes["frozen"], exp.train_on
    argv = ("sweep", "--features", cache_file(e, b), "--head", ",".join(m.heads), *_probe_seed_flags(exp),
            "--jobs", str(exp.jobs), "--out", run_folder("frozen", e),
            *flags("spar-probe", "sweep", m.options, "modes.frozen.options", exp))
    runs = len(m.heads) * len(exp.seeds) * (8 if "all" in exp.probes else len(exp.probes))
    return Step(f"heads:{e}", "heads", (("spar-probe", argv),), (f"cache:{e}@{b}",), (run_folder("frozen", e),),
                cost=(("runs", float(runs)), ("run_images", float(runs * estimated_images(exp, b)))), device=True)


def train_step(exp: Experiment, mode: str, e: str) -> Step:
    """``finetune`` or ``scratch``: encoder + head trained end to end on the training build."""
    m, b = exp.modes[mode], exp.train_on
    argv, inputs = _encoder_flags(exp, e)
    enc = exp.encoders[e]
    if mode == "scratch":
        argv += ["--init", "scratch"]
    if enc.model_args:
        argv += ["--model-args", json.dumps(enc.model_args, sort_keys=True)]
    argv += ["--data", build_dir(exp, b), "--head", ",".join(m.heads), *_probe_seed_flags(exp), "--resume",
             "--out", run_folder(mode, e), *flags("spar-probe", "finetune", m.options, f"modes.{mode}.options", exp)]
    if exp.builds[b].path:
        inputs += ((exp.builds[b].path, _path_digest(exp.builds[b].path)),)
    runs = len(m.heads) * len(exp.seeds) * (8 if "all" in exp.probes else len(exp.probes))
    epochs = float(m.options.get("max_epochs", 20))
    return Step(f"{mode}:{e}", "train", (("spar-probe", ("finetune", *argv)),), _needs_build(exp, b),
                (run_folder(mode, e),), inputs,
                (("runs", float(runs)), ("train_images", runs * epochs * estimated_images(exp, b) / 3)), device=True)


def eval_step(exp: Experiment, source: Step, b: str) -> Step:
    """Every run of ``source`` (a heads or train step) scored on transfer build ``b``."""
    mode, e = source.id.split(":", 1)
    frozen = mode == "heads"
    needs = (source.id, f"cache:{e}@{b}") if frozen else (source.id, *_needs_build(exp, b))
    target = cache_file(e, b) if frozen else build_dir(exp, b)
    local = exp.encoders[e].spec if not frozen and local_path(exp.encoders[e].spec) else None
    extra = (("runs", source.outputs[0]), ("features" if frozen else "data", target), ("encoder", local))
    return Step(f"eval:{source.id}@{b}", "eval", (), needs, (), (), (("images", float(estimated_images(exp, b))),),
                device=not frozen, extra=extra)


def vqa_step(exp: Experiment, name: str, b: str) -> Step:
    m = exp.mllms[name]
    out = f"{{out}}/{RUNS}/mllm-{name}" + ("" if b == exp.train_on else f"@{b}")
    argv = ("vqa", "--model", m.model, "--data", build_dir(exp, b), "--out", out,
            *flags("spar-probe", "vqa", m.options, f"mllms.{name}.options", exp))
    return Step(f"vqa:{name}@{b}", "vqa", (("spar-probe", argv),), _needs_build(exp, b), (out,),
                cost=(("questions", float(estimated_images(exp, b) / 3)),), device=m.model.startswith("hf:"))


def report_step(exp: Experiment, needs: tuple[str, ...]) -> Step:
    argv = ("report", f"{{out}}/{RUNS}", "--out", f"{{out}}/{REPORT}")
    return Step("report", "report", (("spar-probe", argv),), needs, (f"{{out}}/{REPORT}",),
                extra=(("title", exp.title),))


def _build_order(exp: Experiment) -> list[str]:
    """The builds in the file's order, each after the build whose thresholds it takes."""
    order: list[str] = []

    def visit(b: str, seen: tuple[str, ...]) -> None:
        if b in order:
            return
        if b in seen:
            raise ConfigError(f"{exp.source}: builds.{b}.thresholds_from: a cycle ({' -> '.join((*seen, b))})")
        dep = exp.builds[b].thresholds_from
        if dep:
            visit(dep, (*seen, b))
        order.append(b)

    for b in exp.builds:
        visit(b, ())
    return order


def make_plan(exp: Experiment) -> Plan:
    """Every step of ``exp`` in dependency order, with its hash."""
    steps: list[Step] = [s for b in _build_order(exp) if (s := build_step(exp, b)) is not None]
    trained: list[Step] = []
    frozen = exp.modes.get("frozen")
    for e in (frozen.encoders if frozen else ()):
        steps += [cache_step(exp, e, b) for b in (exp.train_on, *exp.transfer)]
        trained.append(heads_step(exp, e))
    for mode in ("finetune", "scratch"):
        trained += [train_step(exp, mode, e) for e in (exp.modes[mode].encoders if mode in exp.modes else ())]
    steps += trained
    steps += [eval_step(exp, t, b) for t in trained for b in exp.transfer]
    steps += [vqa_step(exp, n, b) for n, m in exp.mllms.items() for b in m.builds]
    runs = [s.id for s in steps if s.kind in ("heads", "train", "eval", "vqa")]
    if runs:
        steps.append(report_step(exp, tuple(runs)))
    hashes: dict[str, str] = {}
    for s in steps:
        hashes[s.id] = s.ident(hashes)
    return Plan(exp, steps, hashes)


def partition(plan: Plan, i: int, n: int) -> list[Step]:
    """Partition ``i`` of ``n`` (1-based): a contiguous run of the steps in dependency order, so
    partitions 1..n run one after another do the whole plan, each after its inputs."""
    k = len(plan.steps)
    lo, hi = (i - 1) * k // n, i * k // n
    return plan.steps[lo:hi]
