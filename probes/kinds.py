"""Run kinds: ``kind`` -> the class that runs it, as ``HEADS`` is for heads (lazy: a kind's
package is imported only when a run of it is made).

:func:`spar_bench.probes.runs.session.run` makes every run from its spec through this registry
(``spec.kind``). Every kind's class opens its job the same way (``open(spec, out, options)``:
see :class:`~spar_bench.probes.runs.session.Job`). A predictor made from a build
(``on_build(probe_spec, build)``) with ``fit``, ``predict`` and ``blind``
(:class:`~spar_bench.probes.runs.predictors.Predictor`) gets that ``open`` from
:class:`~spar_bench.probes.runs.build_job.OnBuild` (its job, a ``BuildJob``, runs it on the
build's splits with every control); a class registered with ``on_build`` alone is given it
(:func:`run_kind`). A kind whose finished runs can be scored on another target without retraining says so
itself: ``rescore(rd, target)`` (:func:`~spar_bench.probes.runs.session.evaluate_on` calls it).
A new kind is one class and one line here; a plug-in package registers its own under
the entry-point group :data:`ENTRY_POINT_GROUP` (``name = "module:Class"``), or calls
``RUN_KINDS.register`` itself. (``PREDICTORS``, its earlier name, stays an alias
for code that imports it.)
"""

from __future__ import annotations

from typing import NamedTuple

from spar_bench.errors import ConfigError
from spar_bench.registry import Registry

from .runs.build_job import OnBuild

RUN_KINDS: Registry = Registry("run kind")
RUN_KINDS.register_lazy("head", "spar_bench.probes.runs.session:HeadJob")
#: marker: the file only a (damaged) run of the kind holds (finetune.model.EXPORT_FILE)
RUN_KINDS.register_lazy("finetune", "spar_bench.probes.finetune.predictor:FinetuneJob", marker="encoder.safetensors")
RUN_KINDS.register_lazy("mllm", "spar_bench.probes.vqa.predictor:MllmJob")
RUN_KINDS.register_lazy("prior", "spar_bench.probes.runs.predictors:ConstantPrior")
RUN_KINDS.register_lazy("oracle", "spar_bench.probes.runs.mask_oracle:MaskOracle")
RUN_KINDS.register_lazy("slice-oracle", "spar_bench.probes.references.slice_oracle:SliceOracle")
RUN_KINDS.register_lazy("reader", "spar_bench.probes.references.reader:AppearanceReader")
RUN_KINDS.register_lazy("organmaps", "spar_bench.probes.finetune.readout:OrganMaps")
RUN_KINDS.register_lazy("organmaps3d", "spar_bench.probes.finetune.organmaps3d:OrganMaps3d")

class Trains(NamedTuple):
    """What a build-reading run kind trains for each seed, as its ``trains(options)`` says: at
    most ``epochs`` passes over the training items of its level (``volumes``: Level 4's original
    volumes at the build's side; else Level 3's slices, mirrored copies included, resized to
    ``side`` pixels), shared by the probes of that seed. The plan prices its ``predict:`` steps
    by it (``spar-bench run --dry-run``, SLURM's time limits); a kind without ``trains`` fits
    nothing beyond a head run's cost."""

    epochs: int
    volumes: bool = False
    side: int | None = None


#: the registry's earlier name, an alias kept for code that imports it
PREDICTORS = RUN_KINDS

#: the entry-point group of run kinds that other packages provide
ENTRY_POINT_GROUP = "spar_bench.run_kinds"
_entry_points_loaded = False


def run_kind(name: str):
    """The class of run kind ``name`` (registered here or by a plug-in's entry point); an unknown
    name is one line with "did you mean"."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        from importlib.metadata import entry_points

        _entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in RUN_KINDS:
                RUN_KINDS.register_lazy(ep.name, ep.value, source=f"entry point {ep.value}")
    source = RUN_KINDS.meta(name).get("source")  # an unknown name: one line with "did you mean"
    return opens(RUN_KINDS.get(name) if source is None else _plugin(name, source))


def opens(cls):
    """``cls`` as every run kind is: answering ``open``; a predictor class with ``on_build`` alone
    (a plug-in's, or one registered by hand) gets :class:`~.runs.build_job.OnBuild`'s."""
    if getattr(cls, "open", None) is not None:
        return cls

    return type(cls.__name__, (cls, OnBuild), {"__module__": cls.__module__, "__doc__": cls.__doc__})


def _plugin(name: str, source: str):
    """A plug-in's run kind, loaded; what keeps it from running (its import raises, its module
    is missing, its class has neither ``open`` nor ``on_build`` with ``fit`` and ``predict``, its
    name cannot be a folder's) is one line naming the kind, its entry point and the error."""
    from spar_bench.names import name_problem

    where = f"run kind {name!r} (a plug-in's, {source})"
    try:
        cls = RUN_KINDS.get(name)
    except Exception as e:  # noqa: BLE001 (a plug-in's import may raise anything)
        raise ConfigError(f"{where} cannot be loaded: {type(e).__name__}: {e}; fix or uninstall the plug-in") from None
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"{where}: its name {problem}, and a run kind names its runs' folder; rename it")
    missing = [m for m in ("on_build", "fit", "predict") if getattr(cls, m, None) is None]
    if getattr(cls, "open", None) is None and missing:
        raise ConfigError(f"{where}: {getattr(cls, '__name__', cls)!s} has no {', '.join(missing)}; a run kind "
                          "opens its own job (open) or is a predictor made on_build with fit and predict")
    return cls
