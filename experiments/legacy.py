"""The step hashes of 0.2 (steps held command lines), kept to migrate finished steps.

Before steps held specs (:mod:`.plan`), a step's hash covered its argv: the ``spar-build`` and
``spar-probe`` flags its options compiled to. An experiment folder made then records those
hashes in ``.plan/steps/<step>.json``. :func:`old_hashes` computes, for a plan of today, the hash
0.2 gave each step, from the same experiment and a frozen copy of the flags 0.2's commands had
(:data:`COMMANDS`; no CLI is imported, so renaming a flag changes nothing here). The runner
takes a marker that holds its step's 0.2 hash as finished and rewrites it with today's hash
(:func:`spar_bench.experiments.runner.migrate`). A step 0.2 could not have planned (an option
its commands lacked) has no 0.2 hash.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spar_bench.hashing import sha256_json

from .config import Experiment
from .plan import BUILDS, REPORT, RUNS, Step, build_dir, cache_file, encoder_probes, run_folder


@dataclass(frozen=True)
class _Command:
    """A 0.2 command's flags: every option name it took (``_``-spelled), its flags without a
    value, its repeatable ones, and the flags not spelled ``--<name>``."""

    known: str
    flags: str = ""
    multi: str = ""
    spelled: dict[str, str] = field(default_factory=dict)

    def flag(self, name: str) -> str:
        return self.spelled.get(name, "--" + name.replace("_", "-"))


#: the flags of 0.2's commands (``spar-build``, ``spar-build phantom``, ``spar-probe cache|sweep|finetune|vqa``)
COMMANDS: dict[str, _Command] = {
    "build": _Command(
        "arrangement cases compression counterfactual fit_thresholds_on images jobs l12_min_organs levels limit "
        "no_hf on_error out overwrite partition preset resume root samples_per_case seed shard_size source "
        "split_file split_ratio thresholds_from unknown_labels volume_size workers",
        flags="no_hf overwrite resume", multi="cases limit root source split_ratio"),
    "phantom": _Command(
        "in_plane intensities jobs layout n n_slices no_lesions out out_dir overwrite seed size slices workers",
        flags="no_lesions overwrite", spelled={"out_dir": "--out", "n_slices": "--slices"}),
    "cache": _Command(
        "batch batch_size compute data device dtype encoder layers levels loader_workers model_args out overwrite "
        "random_init revision splits tile_encoding token_grid token_int8 token_proj weights workers",
        flags="overwrite random_init token_int8"),
    "sweep": _Command(
        "batch_runs batch_size bootstrap d_model data device dropout features grad_clip grid grid_prune head heads "
        "hidden jobs layer list list_ids lr max_epochs n_boot n_heads n_layers no_controls only out partition "
        "patience preset probe probes proj_dim q_dim seeds sinkhorn_iters threads train_mirrors val_fraction "
        "weight_decay",
        flags="list list_ids no_controls train_mirrors", multi="grid head heads only probe probes",
        spelled={"list_ids": "--list", "n_boot": "--bootstrap"}),
    "finetune": _Command(
        "accum batch_size bootstrap checkpoint_every compute data device encoder encoder_lr freeze_blocks head "
        "head_lr init layer loader_workers max_epochs model_args n_boot no_controls out overwrite patience probe "
        "probes resume revision seeds threads train_mirrors warmup_epochs weight_decay weights workers",
        flags="no_controls overwrite resume train_mirrors", multi="head probe probes",
        spelled={"probes": "--probe", "n_boot": "--bootstrap"}),
    "vqa": _Command(
        "api_key_env base_url batch_size bootstrap cache cache_path concurrency data device dtype generate guided "
        "image_size max_new_tokens model n_boot no_blind no_circular no_convention_hint out probe probes retries "
        "revision seed splits timeout volume_as",
        flags="generate no_blind no_circular no_convention_hint", multi="probe probes",
        spelled={"probes": "--probe", "n_boot": "--bootstrap", "cache_path": "--cache"}),
}  # fmt: skip


class _Unplannable(Exception):
    """An option 0.2's command did not have: 0.2 refused the file, so no step has its hash."""


def _text(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def flags(command: str, options: dict[str, Any]) -> list[str]:
    """``options`` as 0.2's ``plan.flags`` wrote them for ``command``."""
    c = COMMANDS[command]
    known, out = set(c.known.split()), []
    for k, v in options.items():
        kn = k.replace("-", "_")
        if kn not in known and v is False and f"no_{kn}" in known:  # hf: false -> --no-hf
            out.append(c.flag(f"no_{kn}"))
            continue
        if kn not in known:
            raise _Unplannable(kn)
        flag = c.flag(kn)
        if kn in c.flags.split():
            out += [flag] if v else []
        elif isinstance(v, list) and kn in c.multi.split():
            out += [x for item in v for x in (flag, _text(item))]
        elif isinstance(v, list):
            out += [flag, ",".join(_text(x) for x in v)]
        elif isinstance(v, dict):
            out += [flag, json.dumps(v, sort_keys=True)]
        else:
            out += [flag, _text(v)]
    return out


def _encoder_argv(exp: Experiment, e: str) -> list[str]:
    enc = exp.encoders[e]
    return ["--encoder", enc.spec, *(["--weights", enc.weights] if enc.weights else []),
            *(["--revision", enc.revision] if enc.revision else [])]  # fmt: skip


def _build(exp: Experiment, b: str) -> list:
    bd, out, commands = exp.builds[b], build_dir(exp, b), []
    if bd.phantom is not None:
        root = f"{{out}}/{BUILDS}/{b}-phantom"
        ph = flags("phantom", {"n": 12, "layout": "canonical", **bd.phantom})
        commands.append(["spar-build", ["phantom", "--out", root, *ph]])
        sources, roots = ["phantom"], [root]
    else:
        sources, roots = list(bd.sources), list(bd.roots)
    argv = [x for s in sources for x in ("--source", s)] + [x for r in roots for x in ("--root", r)]
    if bd.thresholds_from:
        argv += ["--thresholds-from", build_dir(exp, bd.thresholds_from)]
    return commands + [["spar-build", argv + ["--out", out, *flags("build", bd.options)]]]


def _cache(exp: Experiment, e: str, b: str) -> list:
    enc, argv = exp.encoders[e], _encoder_argv(exp, e)
    argv += ["--random-init"] if enc.random_init else []
    argv += ["--model-args", json.dumps(enc.model_args, sort_keys=True)] if enc.model_args else []
    argv += ["--data", build_dir(exp, b), "--out", cache_file(e, b), *flags("cache", exp.modes["frozen"].cache)]
    return [["spar-probe", ["cache", *argv]]]


def _probe_seeds(exp: Experiment, e: str) -> list[str]:
    return ["--probe", ",".join(encoder_probes(exp, e)), "--seeds", ",".join(str(s) for s in exp.seeds)]


def _heads(exp: Experiment, e: str) -> list:
    m = exp.modes["frozen"]
    argv = ["sweep", "--features", cache_file(e, exp.train_on), "--head", ",".join(m.heads), *_probe_seeds(exp, e),
            "--jobs", str(exp.jobs), "--out", run_folder("frozen", e), *flags("sweep", m.options)]  # fmt: skip
    return [["spar-probe", argv]]


def _train(exp: Experiment, mode: str, e: str) -> list:
    m, enc, argv = exp.modes[mode], exp.encoders[e], _encoder_argv(exp, e)
    argv += ["--init", "scratch"] if mode == "scratch" else []
    argv += ["--model-args", json.dumps(enc.model_args, sort_keys=True)] if enc.model_args else []
    argv += ["--data", build_dir(exp, exp.train_on), "--head", ",".join(m.heads), *_probe_seeds(exp, e), "--resume",
             "--out", run_folder(mode, e), *flags("finetune", m.options)]  # fmt: skip
    return [["spar-probe", ["finetune", *argv]]]


def _vqa(exp: Experiment, name: str, b: str) -> list:
    m = exp.mllms[name]
    out = f"{{out}}/{RUNS}/mllm-{name}" + ("" if b == exp.train_on else f"@{b}")
    argv = ["vqa", "--model", m.model, "--data", build_dir(exp, b), "--out", out, *flags("vqa", m.options)]
    return [["spar-probe", argv]]


def _commands_and_extra(exp: Experiment, step: Step) -> tuple[list, list]:
    """What 0.2 recorded of ``step``: its commands and its ``extra``."""
    head, _, rest = step.id.partition(":")
    if step.kind == "build":
        return _build(exp, rest), []
    if step.kind == "cache":
        return _cache(exp, *rest.split("@", 1)), []
    if step.kind == "heads":
        return _heads(exp, rest), []
    if step.kind == "train":
        return _train(exp, head, rest), []
    if step.kind == "vqa":
        return _vqa(exp, *rest.rsplit("@", 1)), []
    if step.kind == "predict":  # 0.2 had no such step
        raise _Unplannable(step.id)
    if step.kind == "eval":
        spec = step.specs[0][1]
        target = "features" if "features" in spec else "data"
        return [], [["runs", spec["runs"]], [target, spec[target]], ["encoder", spec["encoder"]]]
    argv = ["report", f"{{out}}/{RUNS}", "--out", f"{{out}}/{REPORT}"]
    return [["spar-probe", argv]], [["title", exp.title]]


def old_hashes(exp: Experiment, steps: list[Step]) -> dict[str, str]:
    """The hash 0.2 gave each step of ``steps`` (in dependency order); a step 0.2 could not
    plan, or that needs one, has none."""
    hashes: dict[str, str] = {}
    for s in steps:
        if any(n not in hashes for n in s.needs):
            continue
        try:
            commands, extra = _commands_and_extra(exp, s)
        except _Unplannable:
            continue
        record = {"id": s.id, "kind": s.kind, "commands": commands, "needs": {n: hashes[n] for n in s.needs},
                  "inputs": [list(i) for i in s.inputs], "extra": extra}  # fmt: skip
        hashes[s.id] = sha256_json(record, default=str)
    return hashes
