"""The organ-map encoder read out by geometry, as a :class:`~spar_bench.probes.runs.predictors.Predictor`.

An organ-map run (:mod:`.organmaps`) says where each organ is in every token cell. Its
readout answers the geometric Level 3 probes (:data:`READOUT_PROBES`) with nothing fitted to
answers: every organ's centre from the organ head's map and its area from the share head's
(:func:`.organmaps.predict_maps`, :func:`.organmaps.map_geometry`; one map where the run has
no Dice term), then the oracle's rule for the probe with what each prompt states
(:func:`spar_bench.probes.vqa.oracle.decide`). Computation by construction: what it gets
wrong, its perception got wrong. It is the calibration's computation model on those probes
(:mod:`spar_bench.experiments.calibration`). Its blind baseline is the probe's prior.

Run kind ``organmaps`` (:class:`OrganMaps`) is that model as a run of its own, the 2-D
counterpart of ``organmaps3d``: on one build, ``fit`` trains the organ maps on its Level 3
slices (:func:`.organmaps.pretrain_organ_maps`, once per encoder, build, schedule and seed; a
finished one is kept) and ``predict`` reads them out, scored by the evaluation of every run kind
(test, mirrored counterfactuals, conflict items, chance, majority, prior and blind). Options
(``predictors.NAME.options``, ``spar-probe predict --option``): the fields of :class:`MapEncoder`
and of :class:`~.organmaps.OrganMapConfig` but its seed, which is the run's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.builder.samples.pixels import Geometry, decide
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.fields import options_of
from spar_bench.hashing import sha256_json

from ..kinds import Trains
from ..references.slice_oracle import question_index, split_questions, stated_cuts
from ..runs.build_job import BuildJob
from ..runs.predictors import ConstantPrior
from .organmaps import (
    MAP_ENCODER,
    MAP_MODEL_ARGS,
    OrganMapConfig,
    load_organ_map_model,
    map_geometry,
    predict_maps,
    pretrain_organ_maps,
    slice_level,
)

#: The Level 3 probes an organ-map encoder answers by geometry; the others (Levels 1-2, counting:
#: lesions are not in the maps) are frozen probes of it.
READOUT_PROBES = ("level3.relative_position", "level3.orientation", "level3.symmetry", "level3.size",
                  "level3.distance")


def readout_answers(q, centre: np.ndarray, area: np.ndarray) -> np.ndarray:
    """The class of every question of ``q`` (:func:`~spar_bench.probes.vqa.questions.load_questions`)
    from every slice's label centres ``(rows, labels, 2)`` and areas in pixels ``(rows, labels)``
    (label = organ id + 1), by the oracle's rule with what each prompt states."""

    pred = np.empty(len(q), dtype=np.int64)
    for i in range(len(q)):
        r, a, o = int(q.row[i]), int(q.organ_a[i]) + 1, max(int(q.organ_b[i]), -1) + 1  # -1: no organ B
        mpp = float(q.mm_per_pixel[i])
        g = Geometry(tuple(centre[r, a]), tuple(centre[r, o]), float(area[r, a]) * mpp**2,
                     float(area[r, o]) * mpp**2, 0, mpp)
        pred[i] = decide(q.probe, int(q.axis[i]), g, stated_cuts(q, i))
    return pred


def slice_geometry(rd: Path, build, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """``(centres, areas)`` of every test slice of ``build`` read from organ-map run ``rd``'s maps
    (centres from the organ head's, areas from the share head's)."""

    model = load_organ_map_model(rd, device)
    level = slice_level()
    where, share = predict_maps(model, build.images(level, "test", np.arange(build.count(level, "test"))))
    return map_geometry(where, model.grid)[0], map_geometry(share, model.grid)[1]


@dataclass
class OrganMapReadout:
    """The geometric readout of organ-map run ``rd`` on one probe of ``build`` (see the module doc).
    ``geometry``: the test slices' ``(centres, areas)`` when already read (shared by the probes)."""

    spec: Any
    build: Any
    rd: Path
    device: str = "cpu"
    geometry: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    kind: str = "organ-map-readout"

    def __post_init__(self) -> None:
        if self.spec.name not in READOUT_PROBES:
            raise ConfigError(f"the organ-map readout answers {', '.join(READOUT_PROBES)}, not {self.spec.name}")

    def fit(self, train, val) -> None:
        return None

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)

    def predict(self, t, split: str = "test") -> np.ndarray:
        if split != "test":
            raise ConfigError(f"the organ-map readout reads the test slices, not {split!r}")
        if self.geometry is None:
            self.geometry = slice_geometry(self.rd, self.build, self.device)
        q = split_questions(self.build, self.spec, split)
        return readout_answers(q, *self.geometry)[question_index(q, t)]


# --------------------------------------------------------------------------- run kind ``organmaps``
@dataclass(frozen=True)
class MapEncoder:
    """What the organ maps of run kind ``organmaps`` train, and where: the encoder, its model
    args (merged over :data:`~.organmaps.MAP_MODEL_ARGS`) and the device (no part of the maps'
    identity: a run finished on another device is kept)."""

    encoder: str = MAP_ENCODER
    model_args: dict = field(default_factory=lambda: dict(MAP_MODEL_ARGS))
    device: str = "cpu"


def map_options(options: dict[str, Any] | None, seed: int) -> tuple[MapEncoder, OrganMapConfig]:
    """The :class:`MapEncoder` and :class:`~.organmaps.OrganMapConfig` (seed ``seed``) of run kind
    ``organmaps``'s ``options``; an unknown key or a value of another type is one line."""
    if "seed" in (options or {}):
        raise ConfigError("organmaps: option seed is not an option: the maps' seed is the run's (seeds:, --seed)")
    checked = options_of((MapEncoder, OrganMapConfig), options, "organmaps", skip=("seed",))
    if "model_args" in checked:
        checked["model_args"] = {**MAP_MODEL_ARGS, **checked["model_args"]}
    enc = MapEncoder(**{k: v for k, v in checked.items() if k in _ENCODER_KEYS})
    return enc, OrganMapConfig(**{k: v for k, v in checked.items() if k not in _ENCODER_KEYS}, seed=seed)


_ENCODER_KEYS = frozenset(f.name for f in fields(MapEncoder))


def maps_folder(out: str | Path, build, enc: MapEncoder, cfg: OrganMapConfig) -> Path:
    """``OUT/organmaps/maps/<build>-<digest>/seed<k>``: the organ-map run of run kind ``organmaps``,
    named by all it computes (encoder, model args, the build's fingerprint, the schedule), so
    every probe and seed of one setting shares it and another setting gets its own."""
    what = {"encoder": enc.encoder, "model_args": enc.model_args, "build": build.fingerprint,
            "config": {k: v for k, v in asdict(cfg).items() if k != "seed"}}
    digest = sha256_json(what)[:10]
    return Path(out) / "organmaps" / "maps" / f"{Path(build.root).name}-{digest}" / f"seed{cfg.seed}"


@dataclass
class OrganMaps:
    """Run kind ``organmaps``: the 2-D computation model of one geometric Level 3 probe
    (:data:`READOUT_PROBES`) on ``build``, a :class:`~spar_bench.probes.runs.predictors.Predictor`
    (see the module doc). ``maps``: the organ-map run's folder (:func:`maps_folder`)."""

    spec: Any
    build: Any
    maps: Path | None
    encoder: MapEncoder = field(default_factory=MapEncoder)
    cfg: OrganMapConfig = field(default_factory=OrganMapConfig)
    kind: str = "organmaps"
    readout: OrganMapReadout | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.spec.name not in READOUT_PROBES:
            raise ConfigError(f"organmaps reads out {', '.join(READOUT_PROBES)}, not {self.spec.name}: its maps "
                              "hold no lesions and no answers (a frozen probe of its encoder answers the others: "
                              "spar-probe cache --weights MAPS/encoder.safetensors)")  # fmt: skip

    @classmethod
    def on_build(cls, spec, build) -> OrganMaps:
        """The predictor with the default options and no maps folder yet: it reads a build, and
        :meth:`open` gives it the runs folder its maps go in."""
        return cls(spec, build, None)

    @staticmethod
    def trains(options: dict[str, Any] | None) -> Trains:
        """The maps' epochs and input side for each seed (the plan's price of a ``predict:`` step)."""
        enc, cfg = map_options(options, 0)
        size = (enc.model_args.get("pretrained_cfg_overlay") or {}).get("input_size") or [3, 224, 224]
        return Trains(cfg.epochs, side=int(size[-1]))

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        """A one-line error for options that are neither :class:`MapEncoder`'s nor the schedule's (at plan time)."""
        map_options(options, 0)

    @classmethod
    def open(cls, run, out, options=None) -> OrganMapsJob:
        """The run of ``run`` (a :class:`~spar_bench.probes.runs.spec.PredictorSpec`, its
        ``options`` :func:`map_options`): a build job whose record also holds the maps' training."""
        build = Build(run.features)
        enc, cfg = map_options(getattr(run, "options", None), run.seed)
        me = cls(run.spec, build, maps_folder(out, build, enc, cfg), enc, cfg)
        return OrganMapsJob.of(run, me, build, out, run.kind)

    def fit(self, train, val) -> None:
        """Train the organ maps on the build's slices (kept when finished: every probe of this
        seed shares them); nothing is fitted to answers."""
        enc = self.encoder
        if self.maps is None:
            raise ConfigError(f"organmaps: {self.spec.name} has no folder for its maps; open it with a runs folder "
                              "(spar-probe predict --kind organmaps, predictors: in an experiment)")
        rd = pretrain_organ_maps(enc.encoder, self.build.root, self.maps, self.cfg, enc.model_args,
                                 progress=False, device=enc.device)
        self.readout = OrganMapReadout(self.spec, self.build, rd, enc.device)

    def blind(self) -> ConstantPrior:
        return ConstantPrior(self.spec)

    def predict(self, t, split: str = "test") -> np.ndarray:
        if self.readout is None:
            raise ConfigError(f"organmaps: {self.spec.name} predicts only after fit()")
        return self.readout.predict(t, split)

    def record(self, out: str | Path) -> dict[str, Any]:
        """The maps' training: where (relative to the runs folder), encoder, model args, schedule,
        the loss per epoch."""
        kept = json.loads((self.maps / "metrics.json").read_text(encoding="utf-8"))
        return {"mode": "organ-maps", "maps": self.maps.relative_to(Path(out)).as_posix(),
                "encoder": self.encoder.encoder, "model_args": self.encoder.model_args, "config": asdict(self.cfg),
                "history": kept.get("history"), "final_val_loss": kept.get("final_val_loss"),
                "readout": "share-weighted cell centres and summed shares; the slice oracle's rule",
                "blind": "the question-type prior fitted on the training items"}  # fmt: skip


@dataclass
class OrganMapsJob(BuildJob):
    """A :class:`~spar_bench.probes.runs.build_job.BuildJob` of :class:`OrganMaps` whose metrics
    and record also hold the maps' training (``training``)."""

    out: Path = Path()

    @classmethod
    def of(cls, run, predictor: OrganMaps, build, out, slug: str) -> OrganMapsJob:
        job = super().of(run, predictor, build, out, slug)
        job.out = Path(out)
        inputs = {"organ_maps": {"encoder": predictor.encoder.encoder, "model_args": predictor.encoder.model_args,
                                 "config": asdict(predictor.cfg)}}
        job.record = job.record.replace(inputs=inputs)
        return job

    def score(self, fitted):
        metrics, record, files = super().score(fitted)
        training = self.predictor.record(self.out)
        metrics["training"] = training
        return metrics, record.replace(extra={**record.extra, "training": training}), files
