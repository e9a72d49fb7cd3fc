"""Probe specs: the one place that knows what a probe (and a level) is.

Modelled on lm-evaluation-harness's ``Task``: each of the eight probes is one frozen
:class:`ProbeSpec` in the :data:`PROBE_SPECS` registry. A spec owns

* ``name`` and ``level`` (the cache and shard group its items live in);
* ``fields``: the shard fields it reads (:meth:`ProbeSpec.load_targets`);
* ``output`` and ``output_shape``: what a head must produce per item
  (``"points"`` ``(16, 2)`` normalised (x, y) per organ; ``"assignment"`` ``(16, 16)``
  scores of (mosaic position, slot); ``"classes"`` ``(n_classes,)`` logits);
  ``asks``: items are questions (organ A, organ B, axis, probe) about a shared image;
* ``loss``: the training loss (:meth:`ProbeSpec.loss_value`);
* ``metrics``: the declared metrics, headline first (:data:`METRICS` gives each
  one's label and direction), and ``per_organ``: the metric also reported per organ;
* ``chance``, ``majority`` and the **prior**: the best input-free prediction, fitted in
  closed form on the training split (:meth:`ProbeSpec.fit_prior`);
* ``class_names`` (Level 3), and ``axes``: the names of the question axes a probe's
  metrics are also split by (relative position: left/right, anterior/posterior);
* the **conflict items** (:meth:`ProbeSpec.conflict`, Level 3): the items whose answer in
  the image differs from the prior's answer, scored by one function,
  :func:`spar_bench.probes.metrics.conflict_metrics`, for heads and MLLMs alike.

``fit``, ``eval``, ``sweep``, ``report`` and the heads read these specs; none of them
branches on a level name. Adding a probe = one entry here (or ``register_probe``) plus
its sampler in the builder.

The priors:

* Level 1 (``localisation``): every organ at its mean training centroid (the atlas);
* Level 2 (``arrangement``): every tile in its organ's most frequent training slot (the
  slots of one mosaic resolved by the Hungarian algorithm on the per-organ slot
  frequencies). It is given which organ each tile shows - what a model that recognises
  the organs but ignores where they lie could do - which the blind head is not;
* Level 3: the majority training answer per question type (organ A, organ B, axis) of
  the probe; a question type unseen in training gets the probe's majority answer.

``spar-probe --help`` loads this module (the probes' names), so the metrics, the Sinkhorn
layer and torch are imported where they are used (docs/DEVELOPING.md, Imports).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import factorial
from typing import Any

import numpy as np

from spar_bench.builder.schema import (
    LEVEL3_CLASS_NAMES,
    LEVEL3_N_CLASSES,
    LEVEL3_PROBES,
    LEVEL4_CLASS_NAMES,
    LEVEL4_N_CLASSES,
    LEVEL4_PROBES,
    LEVEL_SPECS,
    N_ORGANS,
    RELATIVE_POSITION_AXES,
    VOLUME_AXES,
)
from spar_bench.errors import ConfigError, IntegrityError
from spar_bench.registry import Registry

from .targets import Targets, cache_rows, read_fields


@dataclass(frozen=True)
class Metric:
    """How a metric is shown: label, direction, and whether it is a rate (shown in %)."""

    key: str
    label: str
    higher_is_better: bool
    percent: bool


METRICS: dict[str, Metric] = {
    m.key: m
    for m in (
        Metric("med_px", "MED (px)", False, False),
        Metric("med_mm", "MED (mm)", False, False),
        Metric("sdr10", "SDR@10", True, True),
        Metric("med_vox", "MED (vox)", False, False),
        Metric("sdr10_vox", "SDR@10 vox", True, True),
        Metric("perm_acc", "perm. acc.", True, True),
        Metric("tile_acc", "tile acc.", True, True),
        Metric("kendall_tau", "Kendall tau", True, False),
        Metric("accuracy", "accuracy", True, True),
        Metric("macro_f1", "macro-F1", True, True),
    )
}


@dataclass(frozen=True)
class ProbeSpec:
    """One probe: what it reads, predicts, optimises and reports (see the module doc)."""

    name: str
    level: str
    fields: tuple[str, ...]
    output: str
    output_shape: tuple[int, ...]
    loss: str
    metrics: tuple[str, ...]
    per_organ: str | None = None
    class_names: tuple[str, ...] = ()
    #: names of the values of the items' ``axis`` (metrics also reported per axis); () none
    axes: tuple[str, ...] = ()
    asks: bool = False
    prior_rule: str = ""
    #: the prior sees what the blind head sees, so it bounds it (a blind head below it is
    #: under-trained); False where the prior is told more (Level 2: which organ each tile is)
    prior_bounds_blind: bool = True

    # ------------------------------------------------------------------ declared facts
    @property
    def headline(self) -> str:
        return self.metrics[0]

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.headline].higher_is_better

    @property
    def n_classes(self) -> int:
        """Answer classes (question probes); 0 otherwise."""
        return len(self.class_names)

    @property
    def n_outputs(self) -> int:
        """Width of a flat output layer (32, 256 or n_classes)."""
        return int(np.prod(self.output_shape))

    @property
    def n_queries(self) -> int:
        """Query tokens of a token head: one per organ/position, or one per question."""
        return 1 if self.asks else self.output_shape[0]

    def shape_output(self, flat):
        """A flat ``(B, n_outputs)`` head output in this probe's shape."""
        return flat.reshape(-1, *self.output_shape)

    # ------------------------------------------------------------------ behaviour
    def load_targets(self, build, split: str, cache_keys: np.ndarray) -> Targets:
        raise NotImplementedError

    def question(self, t: Targets, idx: np.ndarray) -> dict[str, np.ndarray] | None:
        """The question arrays a head reads beside the features (None: no question)."""
        return None

    def loss_value(self, out, y: dict, sinkhorn_iters: int = 20):
        raise NotImplementedError

    def decode(self, out: np.ndarray, t: Targets) -> np.ndarray:
        """Predictions from raw head outputs ``(N, *output_shape)``."""
        raise NotImplementedError

    def empty_prediction(self) -> np.ndarray:
        raise NotImplementedError

    def score(self, t: Targets, pred: np.ndarray, rng, n_boot: int) -> dict:
        """Every declared metric of ``pred`` on ``t``; bootstrap CIs over patients when ``rng``."""
        raise NotImplementedError

    def chance(self, t: Targets) -> float | None:
        return None

    def majority(self, train: Targets) -> int | None:
        """The majority training answer (question probes), else None."""
        return None

    def majority_rate(self, majority: int | None, t: Targets) -> float | None:
        return None

    def fit_prior(self, train: Targets) -> dict:
        """The input-free optimum fitted in closed form on ``train`` (JSON-safe)."""
        raise NotImplementedError

    def prior_predict(self, prior: dict, t: Targets) -> np.ndarray:
        raise NotImplementedError

    def conflict(self, prior: dict | None, t: Targets, pred: np.ndarray, rng, n_boot: int) -> dict | None:
        """Scores of ``pred`` on the items whose answer differs from the prior's (None: the
        probe has no such items: Levels 1-2)."""
        return None

    def worse(self, a: float | None, b: float | None, rel: float = 0.02) -> bool:
        """Whether headline score ``a`` is worse than ``b`` by more than ``rel`` of ``b``."""
        if a is None or b is None:
            return False
        gap = (b - a) if self.higher_is_better else (a - b)
        return gap > rel * abs(b)

    def describe(self) -> dict[str, Any]:
        """The spec as JSON-safe data (recorded in runs and reports)."""
        return {
            "name": self.name, "level": self.level, "fields": list(self.fields),
            "output": self.output, "output_shape": list(self.output_shape), "loss": self.loss,
            "metrics": list(self.metrics), "headline": self.headline,
            "higher_is_better": self.higher_is_better, "per_organ": self.per_organ,
            "class_names": list(self.class_names), "axes": list(self.axes), "prior": self.prior_rule,
            "prior_bounds_blind": self.prior_bounds_blind,
        }  # fmt: skip


def _mirror_flags(build, level: str, split: str, n: int, d: dict) -> np.ndarray:
    return d["is_mirror"].astype(bool) if "is_mirror" in d else np.zeros(n, bool)


def _flip_flags(d: dict) -> np.ndarray | None:
    """The rows' ``is_flipped`` (Level 4), or None when the level has no such field."""
    return d["is_flipped"].astype(bool) if "is_flipped" in d else None


def _with_mirror(build, level: str, split: str, names: list[str]) -> list[str]:
    have = build.fields(level, split)
    return [*names, *(f for f in ("is_mirror", "is_flipped") if f in have)]


# ---------------------------------------------------------------------- Level 1
@dataclass(frozen=True)
class LocalisationSpec(ProbeSpec):
    """Level 1: each organ's normalised centroid from a class-ordered mosaic."""

    def load_targets(self, build, split, cache_keys):
        d = read_fields(build, self.level, split, _with_mirror(build, self.level, split, list(self.fields)))
        return self._targets(build, split, cache_keys, d, self._targets_y(d))

    def _targets_y(self, d: dict) -> dict:
        """The target arrays of one split's fields ``d``."""
        return {
            "centroid": d["centroid"].astype(np.float32),
            "present": d["present"].astype(bool),
            "mm_per_pixel": d["mm_per_pixel"].astype(np.float32),
        }

    def _targets(self, build, split, cache_keys, d, y):
        n = len(d["key"])
        rows = cache_rows(cache_keys, d["key"], f"{build.root}/{self.level}/{split}")
        return Targets(self, split, rows, d["patient_id"].astype(str),
                       _mirror_flags(build, self.level, split, n, d), y, _flip_flags(d))  # fmt: skip

    def shape_output(self, flat):
        return 0.5 + flat.reshape(-1, *self.output_shape)  # centred on the image

    def loss_value(self, out, y, sinkhorn_iters=20):
        import torch

        m = y["present"].to(out.dtype)[..., None]
        target = torch.nan_to_num(y["centroid"], nan=0.5)
        return (((out - target) ** 2) * m).sum() / (2 * m.sum()).clamp(min=1.0)

    def decode(self, out, t):
        return out

    def empty_prediction(self):
        return np.zeros((0, *self.output_shape), np.float32)

    def score(self, t, pred, rng, n_boot):
        from .metrics import level1_metrics

        if len(t) == 0:
            return {"n": 0}
        groups = t.patient if rng is not None else None
        return level1_metrics(pred, t.y["centroid"], t.y["present"], t.y["mm_per_pixel"],
                              groups, rng, n_boot)  # fmt: skip

    def fit_prior(self, train):
        from .metrics import atlas_predictions

        return {"centroid": atlas_predictions(train.y["centroid"], train.y["present"], 1)[0].tolist()}

    def prior_predict(self, prior, t):
        c = np.asarray(prior["centroid"], np.float32)
        return np.broadcast_to(c, (len(t), *c.shape)).copy()


# ---------------------------------------------------------------------- Level 2
@dataclass(frozen=True)
class ArrangementSpec(LocalisationSpec):
    """Level 2: the arrangement slot of each shuffled tile (Sinkhorn loss, Hungarian decode)."""

    def _targets_y(self, d: dict) -> dict:
        return {
            **super()._targets_y(d),
            "target_slot": d["target_slot"].astype(np.int64),
            "present_pos": d["present_pos"].astype(bool),
            "perm": d["perm"].astype(np.int64),
        }

    def shape_output(self, flat):
        return flat.reshape(-1, *self.output_shape)

    def loss_value(self, out, y, sinkhorn_iters=20):
        from .sinkhorn import log_sinkhorn, permutation_loss, slot_mask

        rows = y["present_pos"]
        log_p = log_sinkhorn(out, rows, slot_mask(rows), n_iters=sinkhorn_iters)
        return permutation_loss(log_p, y["target_slot"], rows)

    def decode(self, out, t):
        from .sinkhorn import hungarian_decode

        return hungarian_decode(out, t.y["present_pos"]).astype(np.int64)

    def empty_prediction(self):
        return np.zeros((0, self.output_shape[0]), np.int64)

    def score(self, t, pred, rng, n_boot):
        from .metrics import level2_metrics

        if len(t) == 0:
            return {"n": 0}
        groups = t.patient if rng is not None else None
        return level2_metrics(pred, t.y["target_slot"], t.y["present_pos"], groups, rng, n_boot,
                              perm=t.y.get("perm"))  # fmt: skip

    def chance(self, t):
        """Expected exact-permutation accuracy of a uniformly random assignment (mean 1/n!)."""

        n = np.asarray(t.y["present_pos"], bool).sum(axis=1)
        n = n[n > 0]
        return float(np.mean([1.0 / factorial(int(k)) for k in n])) if n.size else None

    def fit_prior(self, train):
        pos = train.y["present_pos"]
        organ, slot = train.y["perm"][pos], train.y["target_slot"][pos]
        counts = np.zeros((N_ORGANS, self.output_shape[1]), np.int64)
        np.add.at(counts, (organ, slot), 1)
        return {"slot_counts": counts.tolist()}

    def prior_predict(self, prior, t):
        """Each tile's organ's slot frequencies, resolved into one arrangement per mosaic."""
        from .sinkhorn import hungarian_decode

        counts = np.asarray(prior["slot_counts"], np.float64)
        freq = (counts + 1e-3) / (counts + 1e-3).sum(axis=1, keepdims=True)
        scores = np.log(freq)[np.clip(t.y["perm"], 0, N_ORGANS - 1)]
        return hungarian_decode(scores, t.y["present_pos"]).astype(np.int64)


# ---------------------------------------------------------------------- Level 3
Q_FIELDS = ("q_slice", "q_probe", "q_axis", "q_organ_a", "q_organ_b", "q_answer")
QUESTION_KEYS = ("organ_a", "organ_b", "axis", "probe")


@dataclass(frozen=True)
class QuestionSpec(ProbeSpec):
    """Levels 3 and 4: one multiple-choice question about a slice or a volume (cross-entropy,
    accuracy). The level's question vocabulary is declared here, so the heads size their
    question embeddings from the spec (Level 3's are unchanged by Level 4's)."""

    index: int = -1  # the probe's id in the shards' ``q_probe`` (LEVEL3_PROBES / LEVEL4_PROBES order)
    #: the questions table's pointer into the level's rows (``LevelSpec.row_field``)
    row_field: str = "q_slice"
    #: the rows' field of mm per pixel (voxel), read for each question
    scale_field: str = "mm_per_pixel"
    #: the question's organs (Level 4 adds ``organ_c``, distance's third organ)
    organs: tuple[str, ...] = ("organ_a", "organ_b")
    #: the axes the level's questions may name (``q_axis`` 0, 1, ...; -1 none)
    question_axes: tuple[str, ...] = RELATIVE_POSITION_AXES
    #: the number of probes of the level's questions (values of ``q_probe``)
    n_probes: int = len(LEVEL3_PROBES)

    @property
    def question_fields(self) -> tuple[str, ...]:
        """The questions table's fields it reads (Level 3: :data:`Q_FIELDS`)."""
        return (self.row_field, "q_probe", "q_axis", *(f"q_{o}" for o in self.organs), "q_answer")

    @property
    def question_keys(self) -> tuple[str, ...]:
        """The question arrays a head reads (Level 3: :data:`QUESTION_KEYS`)."""
        return (*self.organs, "axis", "probe")

    def load_targets(self, build, split, cache_keys):
        row_fields = [f for f in self.fields if not f.startswith("q_")]
        s = read_fields(build, self.level, split, _with_mirror(build, self.level, split, row_fields))
        q = read_fields(build, self.level, split, list(self.question_fields))
        where = f"{build.root}/{self.level}/{split}"
        keep = q["q_probe"].astype(np.int64) == self.index
        qs = q[self.row_field][keep].astype(np.int64)
        item_row = self._item_rows(build, split, cache_keys, s["key"], keep, qs, where)
        is_mirror = _mirror_flags(build, self.level, split, len(s["key"]), s)
        flipped = _flip_flags(s)
        answer = q["q_answer"][keep].astype(np.int64)
        if answer.size and (answer.min() < 0 or answer.max() >= self.n_classes):
            raise IntegrityError(
                f"{where}: {self.name} answers outside 0..{self.n_classes - 1}; the shards are corrupt"
            )
        y = {
            "answer": answer,
            **{o: q[f"q_{o}"][keep].astype(np.int64) for o in self.organs},
            "axis": q["q_axis"][keep].astype(np.int64),
            "probe": np.full(answer.shape, self.index, dtype=np.int64),
            self.scale_field: s[self.scale_field].astype(np.float32)[qs],
        }
        return Targets(self, split, item_row, s["patient_id"].astype(str)[qs], is_mirror[qs], y,
                       None if flipped is None else flipped[qs])  # fmt: skip

    def _item_rows(self, build, split, cache_keys, row_keys, keep, qs, where) -> np.ndarray:
        """Each question's cache row: its slice's (volume's) row, found by the row's key; in a
        question cache (keyed by question: ``mllm:DIR@llm:N+q``, :mod:`.question_rows`) its
        own row, found by the question key (a split without such questions may hold none)."""
        if not keep.any():
            return np.zeros(0, np.int64)
        if len(cache_keys) and str(cache_keys[0]) not in set(map(str, row_keys)):
            q_keys = read_fields(build, self.level, split, ["q_key"])["q_key"][keep].astype(str)
            if str(cache_keys[0]) in set(q_keys):
                return cache_rows(cache_keys, q_keys, where)
        return cache_rows(cache_keys, row_keys, where)[qs]

    def question(self, t, idx):
        return {k: t.y[k][idx] for k in self.question_keys}

    def loss_value(self, out, y, sinkhorn_iters=20):
        import torch.nn.functional as F

        return F.cross_entropy(out, y["answer"])

    def decode(self, out, t):
        return out.argmax(axis=1)

    def empty_prediction(self):
        return np.zeros((0,), np.int64)

    def score(self, t, pred, rng, n_boot):
        from .metrics import level3_metrics

        if len(t) == 0:
            return {"n": 0}
        groups = t.patient if rng is not None else None
        y, pred = t.y["answer"], np.asarray(pred)
        out = level3_metrics(y, pred, self.n_classes, None, groups, rng, n_boot)
        if self.axes:
            out["per_axis"] = self._by_axis(t, lambda m: level3_metrics(
                y[m], pred[m], self.n_classes, None, None if groups is None else groups[m], rng, n_boot))
        return out

    def _by_axis(self, t: Targets, score) -> dict:
        from .metrics import by_axis

        return by_axis(t.y["axis"], self.axes, score)

    def conflict(self, prior, t, pred, rng, n_boot):
        """:func:`~spar_bench.probes.metrics.conflict_metrics` of ``pred`` against this spec's
        prior (``fit_prior`` on train), per axis too; None without a prior or items."""
        from .metrics import conflict_metrics

        if prior is None or len(t) == 0:
            return None
        y, pred, y_prior = t.y["answer"], np.asarray(pred), self.prior_predict(prior, t)
        groups = t.patient if rng is not None else None

        def score(m):
            return conflict_metrics(y[m], pred[m], y_prior[m], None if groups is None else groups[m],
                                    rng, n_boot)  # fmt: skip

        out = score(np.ones(len(t), bool))
        if self.axes:
            out["per_axis"] = self._by_axis(t, score)
        return out

    def chance(self, t):
        return 1.0 / self.n_classes

    def majority(self, train):
        from .metrics import majority_class

        return majority_class(train.y["answer"], self.n_classes) if len(train) else None

    def majority_rate(self, majority, t):
        if majority is None or len(t) == 0:
            return None
        return float(np.mean(t.y["answer"] == majority))

    def fit_prior(self, train):
        by_type: dict[str, Counter] = {}
        for key, ans in zip(_question_types(train), train.y["answer"].tolist(), strict=True):
            by_type.setdefault(key, Counter())[ans] += 1
        answers = {k: min(c, key=lambda a: (-c[a], a)) for k, c in sorted(by_type.items())}
        return {"answer": answers, "default": self.majority(train) or 0}

    def prior_predict(self, prior, t):
        table, default = prior["answer"], int(prior["default"])
        return np.array([table.get(k, default) for k in _question_types(t)], np.int64)


def _question_types(t: Targets) -> list[str]:
    """One key per item: ``"organA|organB|axis"`` (Level 4: ``"organA|organB|organC|axis"``;
    organ -1 = none)."""
    cols = zip(*(t.y[k].tolist() for k in (*t.spec.organs, "axis")), strict=True)
    return ["|".join(map(str, c)) for c in cols]


# ---------------------------------------------------------------------- Level 4
@dataclass(frozen=True)
class VolumeLocalisationSpec(LocalisationSpec):
    """Level 4: each organ's normalised (x, y, z) centroid in its S^3 volume (masked MSE); MED
    in voxels (``|pred - true| * S``) and mm (times ``mm_per_voxel``), SDR within
    :data:`~spar_bench.probes.metrics.SDR_RADIUS_VOX` (10) voxels."""

    def load_targets(self, build, split, cache_keys):
        d = read_fields(build, self.level, split, _with_mirror(build, self.level, split, list(self.fields)))
        y = {**self._targets_y(d), "size": np.full(len(d["key"]), volume_side(build, self.level, split), np.float32)}
        return self._targets(build, split, cache_keys, d, y)

    def _targets_y(self, d: dict) -> dict:
        return {
            "centroid": d["centroid"].astype(np.float32),
            "present": d["present"].astype(bool),
            "mm_per_voxel": d["mm_per_voxel"].astype(np.float32),
        }

    def score(self, t, pred, rng, n_boot):
        from .metrics import LEVEL4_KEYS, SDR_RADIUS_VOX, localisation_metrics

        if len(t) == 0:
            return {"n": 0}
        groups = t.patient if rng is not None else None
        return localisation_metrics(pred, t.y["centroid"], t.y["present"], t.y["mm_per_voxel"], t.y["size"],
                                    SDR_RADIUS_VOX, LEVEL4_KEYS, groups, rng, n_boot)  # fmt: skip


def volume_side(build, level: str, split: str) -> int:
    """The side S of the S^3 volumes of ``level``/``split`` (the stored images' shape)."""
    shape = build.images(level, split, np.zeros(0, np.int64)).shape
    if len(shape) != 4 or len(set(shape[1:])) != 1:
        raise IntegrityError(f"{build.root}/{level}/{split}: images of shape {shape[1:]} are no S^3 volumes")
    return int(shape[1])


# ---------------------------------------------------------------------- the registry
L12_FIELDS = ("key", "patient_id", "present", "centroid", "mm_per_pixel")

PROBE_SPECS: Registry = Registry("probe")


def register_probe(spec: ProbeSpec, *, override: bool = False) -> ProbeSpec:
    """Add ``spec`` to :data:`PROBE_SPECS` (its name must be new unless ``override``)."""
    unknown = set(spec.metrics) - set(METRICS)
    if unknown:
        raise ConfigError(f"probe {spec.name!r}: unknown metric(s) {sorted(unknown)}; known: {sorted(METRICS)}")
    order = PROBE_SPECS.meta(spec.name)["order"] if spec.name in PROBE_SPECS else len(PROBE_SPECS)
    PROBE_SPECS.register(spec.name, spec, override=override, level=spec.level, order=order)
    return spec


register_probe(LocalisationSpec(
    name="level1.localisation", level="level1", fields=L12_FIELDS, output="points",
    output_shape=(N_ORGANS, 2), loss="masked MSE of normalised (x, y) over present organs",
    metrics=("med_px", "med_mm", "sdr10"), per_organ="med_px",
    prior_rule="mean training centroid per organ (atlas)",
))  # fmt: skip
register_probe(ArrangementSpec(
    name="level2.arrangement", level="level2",
    fields=(*L12_FIELDS, "perm", "target_slot", "present_pos"), output="assignment",
    output_shape=(N_ORGANS, N_ORGANS), loss="permutation loss through log-domain Sinkhorn",
    metrics=("perm_acc", "tile_acc", "kendall_tau"), per_organ="tile_acc",
    prior_rule="most frequent training slot per organ (Hungarian per mosaic; knows each tile's organ)",
    prior_bounds_blind=False,
))  # fmt: skip
for _i, _p in enumerate(LEVEL3_PROBES):
    register_probe(QuestionSpec(
        name=f"level3.{_p}", level="level3", fields=("key", "patient_id", "mm_per_pixel", *Q_FIELDS),
        output="classes", output_shape=(LEVEL3_N_CLASSES[_p],), loss="cross-entropy",
        metrics=("accuracy", "macro_f1"), class_names=LEVEL3_CLASS_NAMES[_p], asks=True,
        axes=RELATIVE_POSITION_AXES if _p == "relative_position" else (),
        prior_rule="majority training answer per question type (organ A, organ B, axis)", index=_i,
    ))  # fmt: skip


_L4_ROWS = LEVEL_SPECS["level4"].row_field
_L4_ORGANS = ("organ_a", "organ_b", "organ_c")
L4_Q_FIELDS = (_L4_ROWS, "q_probe", "q_axis", *(f"q_{o}" for o in _L4_ORGANS), "q_answer")
register_probe(VolumeLocalisationSpec(
    name="level4.localisation", level="level4", fields=("key", "patient_id", "present", "centroid", "mm_per_voxel"),
    output="points", output_shape=(N_ORGANS, 3), loss="masked MSE of normalised (x, y, z) over present organs",
    metrics=("med_vox", "med_mm", "sdr10_vox"), per_organ="med_vox",
    prior_rule="mean training centroid per organ (3-D atlas)",
))  # fmt: skip
for _i, _p in enumerate(LEVEL4_PROBES):
    register_probe(QuestionSpec(
        name=f"level4.{_p}", level="level4", fields=("key", "patient_id", "mm_per_voxel", *L4_Q_FIELDS),
        output="classes", output_shape=(LEVEL4_N_CLASSES[_p],), loss="cross-entropy",
        metrics=("accuracy", "macro_f1"), class_names=LEVEL4_CLASS_NAMES[_p], asks=True,
        axes=VOLUME_AXES if _p == "relative_position" else (),
        prior_rule="majority training answer per question type (organ A, organ B, organ C, axis)", index=_i,
        row_field=_L4_ROWS, scale_field="mm_per_voxel", organs=_L4_ORGANS, question_axes=VOLUME_AXES,
        n_probes=len(LEVEL4_PROBES),
    ))  # fmt: skip


def get_probe(name: str) -> ProbeSpec:
    """The spec of probe ``name``; an unknown name is a :class:`ConfigError` with suggestions."""
    if isinstance(name, ProbeSpec):
        return name
    return PROBE_SPECS.get(name)


def probe_names() -> list[str]:
    """Every registered probe, in registration order (Level 1, Level 2, Level 3 ...)."""
    return sorted(PROBE_SPECS.names(), key=lambda n: PROBE_SPECS.meta(n)["order"])


__all__ = ["METRICS", "PROBE_SPECS", "Metric", "ProbeSpec", "get_probe", "probe_names",
           "register_probe"]  # fmt: skip
