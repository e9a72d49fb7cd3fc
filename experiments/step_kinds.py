"""The step kinds of SPAR-Bench, each declared once (:class:`~.steps.StepKind`, registered in
:data:`~.steps.STEPS`).

For each kind, in one place: the options its specs take (the fields of the library's config
dataclasses), the spellings and own fields, the file's mappings of its options and the settings
classes that check them at plan time, the steps it adds to a plan, and the library call that
runs one spec:

* ``phantom``: a phantom generated (``spar-build phantom``), the first spec of its build step;
* ``build``: a build (``build:<b>``, ``spar-build``); ``cache``: the feature cache of a frozen
  encoder over a build (``cache:<e>@<b>``);
* ``sweep``: the heads of the frozen mode, every probe x seed (``heads:<e>``);
* ``finetune``: encoder and head trained end to end, ``finetune`` or ``scratch``
  (``<mode>:<e>``, step kind ``train``);
* ``eval``: every run of a heads/finetune/scratch step scored on a transfer build without
  retraining (``eval:<step>@<b>``);
* ``vqa``: an MLLM asked a build's Level 3 (and Level 4) questions (``vqa:<m>@<b>``);
* ``predict``: a build-reading run kind on every probe x seed (``predict:<p>@<b>``);
* ``calibration``: the 2-D calibration (``calibration:``, :mod:`.calibration`): recall,
  computation, the oracle and the blind rows on every probe of Levels 1-3 (``calibration``);
* ``report``: ``spar-probe report`` and the experiment's report over every run.

Runs are made by :func:`spar_bench.probes.runs.session.run_all` (finetuning, the predictors; the
MLLM track: :func:`ask_mllm`), transfer by :func:`~spar_bench.probes.runs.session.evaluate_on`.
Torch and the extras are imported inside the library's calls: planning (``--dry-run``) imports
no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from spar_bench.builder.build import (
    BUILD_OPTIONS,
    BuildConfig,
    build,
    choice_options,
    config_from_options,
)
from spar_bench.builder.phantom.generate import PhantomOptions, write_phantom_dataset
from spar_bench.builder.samples.config import SampleConfig
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.fields import field_default, field_types
from spar_bench.outputs import write_bytes
from spar_bench.probes.cache import CacheOptions, cache_options, write_cache
from spar_bench.probes.finetune.config import FinetuneConfig, FinetuneSpec, finetune_specs
from spar_bench.probes.kinds import run_kind
from spar_bench.probes.names import names_all, parse_probes
from spar_bench.probes.runs.report import write_report
from spar_bench.probes.runs.session import EvalTarget, evaluate_on, run_all
from spar_bench.probes.runs.spec import ALIASES, OPTIONS, PredictorSpec
from spar_bench.probes.runs.sweep import SweepConfig, sweep
from spar_bench.probes.tasks import probe_names
from spar_bench.probes.train import TrainConfig
from spar_bench.probes.vqa.options import VqaOptions, ask_build, why_skipped

from . import sizes
from .calibration import CalibrationConfig, run_calibration
from .calibration_tables import calibration_section
from .config import Experiment
from .estimate import calibration_seconds
from .plan import (
    BUILDS,
    DEFAULT_LEVELS,
    PLAN,
    REPORT,
    RUNS,
    Step,
    build_dir,
    build_levels,
    cache_file,
    encoder_kind,
    encoder_probes,
    is_volume_probe,
    local_path,
    path_digest,
    run_folder,
)
from .report import write_experiment_report
from .steps import STEPS, StepKind, options

#: the calibration step's folder under the experiment's ``out``
CALIBRATION = "calibration"


# --------------------------------------------------------------------------- sizes of a build
def build_choice(exp: Experiment, b: str) -> sizes.Choice:
    """What build ``b`` makes (:class:`~.sizes.Choice`): its sources, roots, options with the
    preset filled in, and levels."""
    bd = exp.builds[b]
    if bd.phantom is not None:
        sources, roots, n = ("phantom",), (), int(bd.phantom.get("n", 12))
    else:
        sources, roots, n = tuple(bd.sources), tuple(bd.roots), None
    given = options("build", bd.options, f"builds.{b}.options", exp)
    return sizes.Choice(sources, roots, sizes.with_preset(given, sources), build_levels(exp, b) or DEFAULT_LEVELS, n)


def case_count(exp: Experiment, b: str) -> int:
    """Cases build ``b`` will have: a phantom's ``n``, else its sources' cases (on disk, else
    their public sizes) as its own selection (``limit``, ``cases``, a preset's) keeps them."""
    return sizes.case_total(build_choice(exp, b))


def _manifest_counts(exp: Experiment, b: str) -> dict[str, Any] | None:
    bd = exp.builds[b]
    where = Path(bd.path) if bd.path else exp.out / BUILDS / b
    try:
        counts = json.loads((where / "manifest.json").read_text())["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return counts if isinstance(counts, dict) else None


def estimated_images(exp: Experiment, b: str, kind: str | None = None) -> int:
    """Images of build ``b`` (``kind`` ``"3d"``: its Level 4 volumes instead): counted from its
    manifest when it exists, else estimated (:mod:`.sizes`: the build's selected cases x the
    measured images per case of each source, its levels and counterfactual copies)."""
    counts = _manifest_counts(exp, b)
    if counts is not None:
        count = (lambda v: v.get("volumes", 0)) if kind == "3d" else (lambda v: v.get("samples", v.get("slices", 0)))
        try:
            return int(sum(count(v) for lv in counts.values() for v in lv.values() if isinstance(v, dict)))
        except (AttributeError, TypeError):
            pass
    return int(round(sizes.images(build_choice(exp, b), volumes=kind == "3d")))


def estimated_questions(exp: Experiment, b: str) -> int:
    """Level 3 and Level 4 questions of build ``b``'s test split (what an MLLM is asked):
    counted from its manifest when it exists, else estimated (:mod:`.sizes`)."""
    counts = _manifest_counts(exp, b)
    if counts is not None:
        try:
            return int(sum(lv.get("test", {}).get("questions", 0) for name, lv in counts.items()
                           if name in ("level3", "level4")))  # fmt: skip
        except (AttributeError, TypeError):
            pass
    return int(round(sizes.questions(build_choice(exp, b))))



# --------------------------------------------------------------------------- the steps
def build_step(exp: Experiment, b: str) -> Step | None:
    bd = exp.builds[b]
    if bd.path:
        return None
    out = build_dir(exp, b)
    specs: list[tuple[str, dict[str, Any]]] = []
    if bd.phantom is not None:
        ph = options("phantom", {"n": 12, "layout": "canonical", **bd.phantom}, f"builds.{b}.phantom", exp)
        root = f"{{out}}/{BUILDS}/{b}-phantom"
        specs.append(("phantom", {"out": root, **ph}))
        sources, roots = ["phantom"], [root]
    else:
        sources, roots = list(bd.sources), list(bd.roots)
    record: dict[str, Any] = {"source": sources, "root": roots, "out": out}
    needs: tuple[str, ...] = ()
    if bd.thresholds_from:  # another build's size/distance thresholds: it comes first
        record["thresholds_from"] = build_dir(exp, bd.thresholds_from)
        needs = _needs_build(exp, bd.thresholds_from)
    specs.append(("build", {**record, "options": options("build", bd.options, f"builds.{b}.options", exp)}))
    inputs = tuple((r, path_digest(r)) for r in roots if not r.startswith("{out}"))
    return Step(f"build:{b}", "build", tuple(specs), needs, outputs=(out, f"{out}.tmp", *(roots if bd.phantom is not None else ())),
                inputs=inputs, cost=_build_cost(exp, b))  # fmt: skip


def _build_cost(exp: Experiment, b: str) -> tuple[tuple[str, float], ...]:
    """A build's cases and the seconds one process takes to build them (measured per source)."""
    choice = build_choice(exp, b)
    return (("cases", float(sizes.case_total(choice))), ("build_seconds", sizes.build_seconds(choice)))


def _needs_build(exp: Experiment, b: str) -> tuple[str, ...]:
    return () if exp.builds[b].path else (f"build:{b}",)


def _encoder(exp: Experiment, e: str) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """Encoder ``e``'s record (spec, and weights or revision when given) and its outside inputs."""
    enc = exp.encoders[e]
    record: dict[str, Any] = {"encoder": enc.spec}
    if enc.weights:
        record["weights"] = enc.weights
    if enc.revision:
        record["revision"] = enc.revision
    inputs = ((enc.weights, path_digest(enc.weights)),) if enc.weights else ()
    local = local_path(enc.spec)
    if local:
        inputs += ((local, path_digest(local)),)
    return record, inputs


def cache_step(exp: Experiment, e: str, b: str) -> Step:
    record, inputs = _encoder(exp, e)
    enc = exp.encoders[e]
    if enc.random_init:
        record["random_init"] = True
    if enc.model_args:  # e.g. a monai: encoder's input_size
        record["model_args"] = enc.model_args
    if enc.probe:  # a question stage: the cache of one probe's questions
        record["probe"] = enc.probe
    record.update(data=build_dir(exp, b), out=cache_file(e, b),
                  options=options("cache", exp.modes["frozen"].cache, "modes.frozen.cache", exp))
    if exp.builds[b].path:
        inputs += ((exp.builds[b].path, path_digest(exp.builds[b].path)),)
    return Step(f"cache:{e}@{b}", "cache", (("cache", record),), _needs_build(exp, b),
                (cache_file(e, b),), inputs, _encode_cost(exp, e, b), device=True)


def _path_data(exp: Experiment, b: str) -> dict[str, str]:
    """``data: DIR`` for a ``path:`` build read through its cache: a cache records its build
    folder only when it lies beside the cache's folder (no local path is published)."""
    return {"data": build_dir(exp, b)} if exp.builds[b].path else {}


def _encode_cost(exp: Experiment, e: str, b: str) -> tuple[tuple[str, float], ...]:
    """What encoding build ``b`` with encoder ``e`` costs: its images, or a 3-D encoder's volumes."""
    kind = encoder_kind(exp.encoders[e].spec)
    return (("volumes" if kind == "3d" else "images", float(estimated_images(exp, b, kind))),)


def _runs(exp: Experiment, e: str, heads: tuple[str, ...]) -> dict[str, Any]:
    return {"heads": list(heads), "probes": list(encoder_probes(exp, e)), "seeds": list(exp.seeds)}


def _n_runs(exp: Experiment, e: str, heads: tuple[str, ...]) -> int:
    probes = encoder_probes(exp, e)
    if "all" in probes:  # a 2-D encoder, or one of unknown kind: the probes of Levels 1-3
        probes = tuple(p for p in probe_names() if not is_volume_probe(p))
    return len(heads) * len(exp.seeds) * len(probes)


def heads_step(exp: Experiment, e: str) -> Step:
    m, b = exp.modes["frozen"], exp.train_on
    record = {"features": cache_file(e, b), **_path_data(exp, b), **_runs(exp, e, m.heads), "jobs": exp.jobs,
              "out": run_folder("frozen", e), "options": options("sweep", m.options, "modes.frozen.options", exp)}  # fmt: skip
    runs = _n_runs(exp, e, m.heads)
    images = estimated_images(exp, b, encoder_kind(exp.encoders[e].spec))
    return Step(f"heads:{e}", "heads", (("sweep", record),), (f"cache:{e}@{b}",), (run_folder("frozen", e),),
                cost=(("runs", float(runs)), ("run_images", float(runs * images))), device=True)


def train_step(exp: Experiment, mode: str, e: str) -> Step:
    """``finetune`` or ``scratch``: encoder + head trained end to end on the training build."""
    m, b = exp.modes[mode], exp.train_on
    record, inputs = _encoder(exp, e)
    enc = exp.encoders[e]
    if mode == "scratch":
        record["init"] = "scratch"
    if enc.model_args:
        record["model_kwargs"] = enc.model_args
    record.update(data=build_dir(exp, b), **_runs(exp, e, m.heads), out=run_folder(mode, e),
                  options=options("finetune", m.options, f"modes.{mode}.options", exp))
    if exp.builds[b].path:
        inputs += ((exp.builds[b].path, path_digest(exp.builds[b].path)),)
    runs = _n_runs(exp, e, m.heads)
    epochs = float(m.options.get("max_epochs", 20))
    images = estimated_images(exp, b, encoder_kind(enc.spec))
    return Step(f"{mode}:{e}", "train", (("finetune", record),), _needs_build(exp, b),
                (run_folder(mode, e),), inputs,
                (("runs", float(runs)), ("train_images", runs * epochs * images / 3)), device=True)


def eval_step(exp: Experiment, source: Step, b: str) -> Step:
    """Every run of ``source`` (a heads or train step) scored on transfer build ``b``."""
    mode, e = source.id.split(":", 1)
    frozen = mode == "heads"
    needs = (source.id, f"cache:{e}@{b}") if frozen else (source.id, *_needs_build(exp, b))
    target = cache_file(e, b) if frozen else build_dir(exp, b)
    local = exp.encoders[e].spec if not frozen and local_path(exp.encoders[e].spec) else None
    record = {"runs": source.outputs[0], ("features" if frozen else "data"): target, "encoder": local}
    if frozen and exp.builds[b].path:  # a path: build read through its cache (see _path_data)
        record["data"] = build_dir(exp, b)
    n_boot = (source.specs[0][1].get("options") or {}).get("n_boot")
    if n_boot is not None:  # the mode's bootstrap: the transfer scores draw as many replicates as the runs'
        record["n_boot"] = int(n_boot)
    return Step(f"eval:{source.id}@{b}", "eval", (("eval", record),), needs, (), (), _encode_cost(exp, e, b),
                device=not frozen)


def vqa_step(exp: Experiment, name: str, b: str) -> Step:
    m = exp.mllms[name]
    out = f"{{out}}/{RUNS}/mllm-{name}" + ("" if b == exp.train_on else f"@{b}")
    record = {"model": m.model, "data": build_dir(exp, b), "out": out,
              "options": options("vqa", m.options, f"mllms.{name}.options", exp)}
    return Step(f"vqa:{name}@{b}", "vqa", (("vqa", record),), _needs_build(exp, b), (out,),
                cost=(("questions", float(estimated_questions(exp, b))),),
                device=m.model.startswith("hf:"))


def predict_step(exp: Experiment, name: str, b: str) -> Step:
    """A build-reading run kind (``predictors:``) on every probe x seed of build ``b``."""
    pr = exp.predictors[name]
    out = f"{{out}}/{RUNS}/predict-{name}" + ("" if b == exp.train_on else f"@{b}")
    record = {"kind": pr.kind, "data": build_dir(exp, b), "probes": list(exp.probes), "seeds": list(exp.seeds),
              "n_boot": pr.n_boot, "out": out, **({"options": pr.options} if pr.options else {})}  # fmt: skip
    return Step(f"predict:{name}@{b}", "predict", (("predict", record),), _needs_build(exp, b), (out,),
                cost=(("runs", float(len(exp.probes) * len(exp.seeds))), *_map_cost(exp, pr, b)))


def _map_cost(exp: Experiment, pr, b: str) -> tuple[tuple[str, float], ...]:
    """What a build-reading run kind that trains (its ``trains``: the organ-map computation
    models) costs beyond its runs: voxels (``map_voxels``) or pixels (``map_pixels``) it trains
    on, over every epoch of every seed."""
    trains = getattr(run_kind(pr.kind), "trains", None)
    if trains is None:
        return ()
    t, choice = trains(pr.options), build_choice(exp, b)
    items = len(exp.seeds) * t.epochs * sizes.train_items(choice, t.volumes)
    if t.volumes:
        side = int(choice.options.get("volume_size") or field_default(SampleConfig, "volume_size"))
        return (("map_voxels", items * side**3),)
    return (("map_pixels", items * (t.side or 224) ** 2),)


def calibration_step(exp: Experiment) -> Step:
    """The 2-D calibration (``calibration:``): recall, computation, the oracle and the blind rows
    on every probe of Levels 1-3, in ``OUT/calibration``."""
    given = options("calibration", exp.calibration or {}, "calibration", exp)
    record = {"out": f"{{out}}/{CALIBRATION}", **given}
    runs = 2 * len(given.get("seeds") or (0,)) * (len(given.get("probes") or ()) or 1)
    seconds = calibration_seconds(CalibrationConfig(**given))
    return Step("calibration", "calibration", (("calibration", record),), (), (f"{{out}}/{CALIBRATION}",),
                cost=(("runs", float(runs)), ("calibration_seconds", seconds)), device=True)


def report_step(exp: Experiment, needs: tuple[str, ...]) -> Step:
    record = {"runs": f"{{out}}/{RUNS}", "out": f"{{out}}/{REPORT}", "title": exp.title}
    if "calibration" in needs:  # its tables: a section of the report
        record["calibration"] = f"{{out}}/{CALIBRATION}/calibration.json"
    return Step("report", "report", (("report", record),), needs, (f"{{out}}/{REPORT}",))


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



def _plan_builds(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [s for b in _build_order(exp) if (s := build_step(exp, b)) is not None]


def _frozen(exp: Experiment) -> tuple[str, ...]:
    frozen = exp.modes.get("frozen")
    return tuple(frozen.encoders) if frozen else ()


def _plan_caches(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [cache_step(exp, e, b) for e in _frozen(exp) for b in (exp.train_on, *exp.transfer)]


def _plan_heads(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [heads_step(exp, e) for e in _frozen(exp)]


def _plan_trained(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [train_step(exp, mode, e) for mode in ("finetune", "scratch")
            for e in (exp.modes[mode].encoders if mode in exp.modes else ())]  # fmt: skip


def _plan_evals(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [eval_step(exp, t, b) for t in steps if t.kind in ("heads", "train") for b in exp.transfer]


def _plan_vqa(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [vqa_step(exp, n, b) for n, m in exp.mllms.items() if m.answers for b in m.builds]


def _plan_predict(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [predict_step(exp, n, b) for n, p in exp.predictors.items() for b in p.builds]


def _plan_calibration(exp: Experiment, steps: list[Step]) -> list[Step]:
    return [calibration_step(exp)] if exp.calibration is not None else []


def _plan_report(exp: Experiment, steps: list[Step]) -> list[Step]:
    runs = tuple(s.id for s in steps if any(STEPS.get(k).runs for k, _ in s.specs))
    runs += tuple(s.id for s in steps if s.kind == "calibration")
    return [report_step(exp, runs)] if runs else []


# --------------------------------------------------------------------------- options and their checks
def _phantom_fields() -> dict[str, Any]:
    return {"n": int, "jobs": int, **field_types(PhantomOptions)}


def _build_fields() -> dict[str, Any]:
    types = field_types(BuildConfig, SampleConfig)
    found = {k: types.get("workers" if k == "jobs" else k) for k in BUILD_OPTIONS}
    found["no_hf"] = bool
    return found


def _cache_fields() -> dict[str, Any]:
    return {**field_types(CacheOptions), "token_grid": int, "token_proj": str, "token_int8": bool}


def _sweep_fields() -> dict[str, Any]:
    return {**field_types(SweepConfig), **{o.name: o.type for o in OPTIONS.values()}}


def _finetune_fields() -> dict[str, Any]:
    head = {o.name: o.type for o in OPTIONS.values() if o.where == "head"}  # the head's (spar-probe finetune --d-model)
    return {**field_types(FinetuneConfig, FinetuneSpec), "threads": int, **head}


def _vqa_fields() -> dict[str, Any]:
    return field_types(VqaOptions)


def _phantom_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    for b, bd in exp.builds.items():
        if bd.phantom is not None:
            yield bd.phantom, f"builds.{b}.phantom"


def _build_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    for b, bd in exp.builds.items():
        yield bd.options, f"builds.{b}.options"


def _sweep_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    if "frozen" in exp.modes:
        yield exp.modes["frozen"].options, "modes.frozen.options"


def _finetune_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    for m, mode in exp.modes.items():
        if m != "frozen":
            yield mode.options, f"modes.{m}.options"


def _cache_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    if "frozen" in exp.modes:
        yield exp.modes["frozen"].cache, "modes.frozen.cache"


def _calibration_fields() -> dict[str, Any]:
    return field_types(CalibrationConfig)


def _calibration_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    if exp.calibration is not None:
        yield exp.calibration, "calibration"


def _calibration_settings(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    yield from _with(CalibrationConfig, {}, option, value)


def _vqa_given(exp: Experiment) -> Iterator[tuple[dict[str, Any], str]]:
    for n, mllm in exp.mllms.items():
        yield mllm.options, f"mllms.{n}.options"


def _phantom_settings(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    if option in ("n", "jobs") and (not isinstance(value, int) or value < 1):
        raise ConfigError(f"--{option} ({'cases' if option == 'n' else 'processes'}) must be an integer >= 1, "
                          f"got {value!r}")
    yield from _with(PhantomOptions, {}, option, value)


def _build_settings_of(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    # the build of key builds.<b>.options.<k> (a name may hold dots: b.v2; the longest that fits)
    b = max((b for b in exp.builds if key.startswith(f"builds.{b}.options.")), key=len)
    yield from _build_settings(exp.builds[b], option, value)


def _sweep_settings(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    option = ALIASES.get(option, option)
    if option in OPTIONS and OPTIONS[option].where == "train":
        yield TrainConfig, {option: value}
    yield from _with(SweepConfig, {"features": "-"}, option, value)


def _finetune_settings(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    yield from _with(FinetuneConfig, {}, option, value)
    yield from _with(FinetuneSpec, {"encoder": "-", "data": "-", "probe": "-"}, option, value)


def _cache_settings(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    yield from _with(CacheOptions, {}, option, value)


def _vqa_settings(exp: Experiment, option: str, value: Any, key: str) -> Iterator[tuple[type, dict[str, Any]]]:
    yield from _with(VqaOptions, {}, option, value)


def _with(cls: type, required: dict[str, Any], option: str, value: Any) -> Iterator[tuple[type, dict[str, Any]]]:
    """``cls`` with ``option`` set, where it is one of its fields."""
    if option in _names(cls) and option not in required:
        yield cls, {**required, option: value}


def _build_settings(bd, option: str, value: Any) -> Iterator[tuple[type, dict[str, Any]]]:
    """A build's sample settings and build settings (``spar-build``'s own reading of its options)."""

    if option in _names(SampleConfig):
        given = value
        if option == "levels" and not isinstance(value, (list, tuple)):
            given = [s.strip() for s in str(value).split(",") if s.strip()]
        yield SampleConfig, {option: given}
    sources = ("phantom",) if bd.phantom is not None else bd.sources
    base = {"sources": sources, "roots": (".",) * len(sources), "out": "."}
    field_name = {"jobs": "workers"}.get(option, option)
    if field_name in _names(BuildConfig) and field_name not in base and field_name not in ("cases", "limit",
                                                                                            "split_ratio"):
        yield BuildConfig, {**base, field_name: value}
    if option in ("cases", "limit", "split_ratio"):
        yield BuildConfig, {**base, **choice_options({option: value}, sources)}


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}



# --------------------------------------------------------------------------- one call per kind
def _phantom(spec: dict[str, Any], device: str | None) -> None:
    fields = {k: v for k, v in spec.items() if k not in ("out", "n", "jobs")}
    write_phantom_dataset(spec["out"], int(spec["n"]), PhantomOptions(**fields), overwrite=True,
                          workers=int(spec.get("jobs") or 1))


def _build(spec: dict[str, Any], device: str | None) -> None:
    """A build: resumed when half written (``OUT.tmp``), made again when whole without its marker
    (killed after the build: it is deterministic)."""

    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    for k in ("cases", "limit", "split_ratio"):  # per-source options: one entry or a list
        if isinstance(opts.get(k), str):
            opts[k] = (opts[k],)
    target = Path(spec["out"])
    given = {"source": tuple(spec["source"]), "root": tuple(spec["root"]), "out": spec["out"],
             "thresholds_from": spec.get("thresholds_from"), **opts}
    if Path(f"{target}.tmp").exists():
        given["resume"] = True
    elif target.exists():
        given["overwrite"] = True
    build(config_from_options(given, {k for k, v in given.items() if v is not None}))


def _cache(spec: dict[str, Any], device: str | None) -> None:
    fields = {k: spec[k] for k in ("weights", "random_init", "revision", "model_args", "probe") if k in spec}
    opts = {**fields, **spec["options"]}
    if device and "device" not in opts:
        opts["device"] = device
    write_cache(spec["encoder"], spec["data"], spec["out"], cache_options(**opts))


def _sweep(spec: dict[str, Any], device: str | None) -> None:
    """The frozen mode's heads; a preset fills what the file does not give (heads and seeds are given)."""

    given = spec["options"]
    fields = {k: v for k, v in given.items() if k not in OPTIONS}
    if device and "device" not in fields:
        fields["device"] = device
    fields.setdefault("jobs", spec["jobs"])
    if spec.get("data"):  # a path: build read through its cache (plan._path_data)
        fields["data"] = spec["data"]
    cfg = SweepConfig(spec["features"], tuple(spec["heads"]), tuple(spec["probes"]), tuple(spec["seeds"]),
                      spec["out"], **fields, options={k: v for k, v in given.items() if k in OPTIONS})  # fmt: skip
    sweep(cfg, {"heads", "seeds", *given})


def _finetune(spec: dict[str, Any], device: str | None) -> None:
    """Encoder and head trained end to end, every probe x head x seed (resumed where interrupted)."""
    import torch

    opts = dict(spec["options"])
    torch.set_num_threads(int(opts.pop("threads", None) or field_default(SweepConfig, "threads")))  # as --threads
    if device and "device" not in opts:
        opts["device"] = device
    names = {f.name for f in fields(FinetuneConfig)}
    cfg = FinetuneConfig(**{k: v for k, v in opts.items() if k in names})
    rest = {k: v for k, v in opts.items() if k not in names}
    head = {k: rest.pop(k) for k in list(rest) if k in OPTIONS and OPTIONS[k].where == "head"}
    kwargs = json.loads(json.dumps(spec["model_kwargs"], sort_keys=True)) if spec.get("model_kwargs") else None
    own = {k: spec[k] for k in ("weights", "revision", "init") if k in spec}
    grid = finetune_specs(spec["encoder"], spec["data"], spec["probes"], spec["heads"], spec["seeds"],
                          **{**own, **rest}, model_kwargs=kwargs, cfg=cfg, head_options=head or None)  # fmt: skip
    for _ in run_all(grid, spec["out"], skip_unavailable=names_all(spec["probes"]), resume=True):
        pass


def _evaluate(spec: dict[str, Any], device: str | None) -> None:
    """Every finished run of the source step scored on the transfer target (again: ``overwrite``):
    another cache (and, for a ``path:`` build, its folder), or a build a finetune run re-encodes
    (:func:`~spar_bench.probes.runs.session.evaluate_on` chooses by the run's kind)."""

    target = EvalTarget(spec.get("features"), spec.get("data"), n_boot=int(spec.get("n_boot", EvalTarget.n_boot)),
                        overwrite=True, encoder=spec.get("encoder"))
    for m in sorted(Path(spec["runs"]).rglob("metrics.json")):
        evaluate_on(m.parent, target)


def _vqa(spec: dict[str, Any], device: str | None) -> None:
    opts = dict(spec["options"])
    if device and "device" not in opts:
        opts["device"] = device
    for probe, rd in ask_mllm(spec["model"], spec["data"], spec["out"], VqaOptions(**opts)):
        if rd is None:
            click.echo(f"{probe}: {why_skipped(spec['data'], probe, opts.get('splits', 'test'))}; skipped", err=True)


def ask_mllm(model: str, data: str, out: str, opts: Any) -> Iterator[tuple[str, Path | None]]:
    """An MLLM asked every question probe of a build: the one place the runner reaches the vqa run."""

    yield from ask_build(model, data, out, opts)


def _predict(spec: dict[str, Any], device: str | None) -> None:
    """A build-reading run kind on every probe x seed (``all``: the probes of the build's levels)."""

    probes = parse_probes(spec["probes"], Build(spec["data"]).levels())
    grid = [[PredictorSpec(p, spec["kind"], int(s), features=spec["data"], n_boot=int(spec["n_boot"]),
                           options=spec.get("options") or {}) for s in spec["seeds"]] for p in probes]  # fmt: skip
    for _ in run_all(grid, spec["out"], skip_unavailable=names_all(spec["probes"]), progress=False):
        pass


def _report(spec: dict[str, Any], device: str | None) -> None:
    """``spar-probe report``'s tables and plots, then the experiment's report, over every run."""

    out = Path(spec["out"])
    write_report(spec["runs"], out)
    sections = (_calibration_report(Path(spec["calibration"]), out),) if spec.get("calibration") else ()
    write_experiment_report(Path(spec["runs"]), out, title=spec.get("title", ""), provenance=_provenance(out.parent),
                            sections=sections)  # fmt: skip


def _calibration(spec: dict[str, Any], device: str | None) -> None:
    """The 2-D calibration (:func:`~.calibration.run_calibration`); ``--devices`` overrides its device."""

    run_calibration(CalibrationConfig(**({**spec, "device": device} if device else spec)))


def _calibration_report(path: Path, out: Path) -> str:
    """The calibration's tables (docs/RESULTS.md's layout), written as the report's
    ``calibration.md``; returned as a section for ``experiment.md``."""

    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    section = "\n".join(["## Calibration: recall, computation and the oracle on every probe", "",
                         *calibration_section(rows)])
    out.mkdir(parents=True, exist_ok=True)
    write_bytes(out / "calibration.md", section)
    return section


def _provenance(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / PLAN / "plan.json").read_text())["provenance"]
    except (OSError, ValueError, KeyError):
        return {}


# --------------------------------------------------------------------------- the declarations
PHANTOM_KIND = StepKind(
    call=_phantom, fields=_phantom_fields, settings=_phantom_settings, given=_phantom_given, order=5,
    aliases={"slices": "n_slices"}, own=frozenset({"out"}))  # fmt: skip
BUILD_KIND = StepKind(
    call=_build, fields=_build_fields, settings=_build_settings_of, given=_build_given, plan=_plan_builds, order=10,
    aliases={"workers": "jobs", "hf": "!no_hf"}, own=frozenset({"source", "root", "out", "resume", "overwrite"}))  # fmt: skip
CACHE_KIND = StepKind(
    call=_cache, fields=_cache_fields, settings=_cache_settings, given=_cache_given, plan=_plan_caches, order=20,
    auto_device=True, aliases={"workers": "loader_workers", "batch": "batch_size"},
    own=frozenset({"weights", "random_init", "revision", "model_args", "async_writes", "probe", "token_storage"}))  # fmt: skip
SWEEP_KIND = StepKind(
    call=_sweep, fields=_sweep_fields, settings=_sweep_settings, given=_sweep_given, plan=_plan_heads, order=30,
    runs=True, auto_device=True, aliases={"bootstrap": "n_boot", "no_controls": "!controls"},
    own=frozenset({"features", "heads", "probes", "seeds", "out", "only", "partition", "options"}))  # fmt: skip
FINETUNE_KIND = StepKind(
    call=_finetune, fields=_finetune_fields, settings=_finetune_settings, given=_finetune_given, plan=_plan_trained,
    order=40, runs=True, auto_device=True,
    aliases={"bootstrap": "n_boot", "no_controls": "!controls", "loader_workers": "workers"},
    own=frozenset({"encoder", "data", "probe", "head", "seed", "cfg", "head_cfg", "model_kwargs", "resume"}))  # fmt: skip
EVAL_KIND = StepKind(call=_evaluate, plan=_plan_evals, order=50, runs=True)
VQA_KIND = StepKind(
    call=_vqa, fields=_vqa_fields, settings=_vqa_settings, given=_vqa_given, plan=_plan_vqa, order=60, runs=True,
    auto_device=True, aliases={"bootstrap": "n_boot", "probe": "probes", "cache": "cache_path", "seed": "seeds",
                               "no_convention_hint": "!convention_hint", "no_circular": "!circular",
                               "no_blind": "!blind"})  # fmt: skip
PREDICT_KIND = StepKind(call=_predict, plan=_plan_predict, order=70, runs=True)
CALIBRATION_KIND = StepKind(
    call=_calibration, fields=_calibration_fields, settings=_calibration_settings, given=_calibration_given,
    plan=_plan_calibration, order=80, auto_device=True, own=frozenset({"out"}))  # fmt: skip
REPORT_KIND = StepKind(call=_report, plan=_plan_report, order=90, fresh=True)
