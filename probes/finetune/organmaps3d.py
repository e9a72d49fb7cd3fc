"""Level 4's computation model: a 3-D encoder that learns organ maps of whole volumes, then
answers the geometric questions by reading its own maps (run kind ``organmaps3d``).

The 3-D counterpart of :mod:`.organmaps` (the 2-D calibration's computation model). The
target of token ``t`` of a stored Level 4 volume is the share of its cell's voxels (the S^3
cube cut into the encoder's ``g^3`` token grid of :attr:`OrganMap3dConfig.layer`) that carry
each label (0 background, 1..16 the organs): the label volume area-pooled onto the token grid
(:func:`organ_shares3d`). A linear map of each token is trained against those shares from
scratch with :func:`~.organmaps.organ_map_loss` (BCE, plus a soft Dice term so a small organ's
few cells count), optionally on randomly flipped copies of the volumes and their maps
(``flips``, :func:`flip_batch`), stopped early on the validation volumes' loss. No question and
no answer is seen: the encoder learns where each organ is from its appearance alone.

The answers are then a *geometric readout*, nothing fitted to answers: each organ's centre is
the cells' centres weighted by its predicted share, its size the summed shares
(:func:`map_organs`: a :class:`~spar_bench.builder.samples.level4.VolumeOrgans` built from the
maps), and the question's rule is the mask oracle's own
(:func:`~spar_bench.probes.runs.mask_oracle.answer`) applied to those measures. Fed the true
label volume at full resolution (grid = S), the readout IS the mask oracle
(tests/test_organmaps3d.py). Probes read out: :data:`READOUT_PROBES` (relative position,
distance, volume, symmetry) and localisation; the others need surfaces or lesions the maps do
not hold, and are refused in one line.

Its blind baseline is the question-type prior (:class:`~spar_bench.probes.runs.predictors.ConstantPrior`
fitted on the training items): what the model answers with the volume taken away is what the
question alone earns. Options (``predictors.NAME.options`` of an experiment file, a
:class:`~spar_bench.probes.runs.spec.PredictorSpec`'s ``options``) are the fields of
:class:`OrganMap3dConfig`; ``device`` is no part of the run's identity.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from spar_bench.builder.samples.level4 import VolumeOrgans, normalised_centroid
from spar_bench.builder.schema import LEVEL4_PROBES, LEVEL_SPECS
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.fields import options_of
from spar_bench.probes.runs.predictors import ConstantPrior
from spar_bench.procs import check_stop
from spar_bench.seeding import derive_seed

from ..hardware import pick_device
from ..kinds import Trains
from ..runs.build_job import BuildJob
from ..runs.mask_oracle import MaskOracle
from .config import lr_factor
from .model import encode, load_trainable
from .organmaps import organ_map_loss

#: the Level 4 probes whose rule reads organ centres and sizes only (the readout answers them)
READOUT_PROBES = ("relative_position", "distance", "volume", "symmetry")
#: the narrow 3-D ResNet-10 of experiments/recall-vs-computation-3d.yaml (``input_size``: the volume side)
DEFAULT_MODEL_ARGS = {"widen_factor": 0.5, "no_max_pool": True, "conv1_t_size": 3, "conv1_t_stride": 2}


@dataclass(frozen=True)
class OrganMap3dConfig:
    """The encoder, the token layer its maps are read from, and the schedule: AdamW, linear
    warm-up then cosine decay over ``max_epochs``, stopped when the validation loss has not
    improved for ``patience`` epochs (the best epoch's weights are kept)."""

    encoder: str = "monai:resnet10"
    model_args: dict = field(default_factory=lambda: dict(DEFAULT_MODEL_ARGS))
    #: the encoder layer whose tokens are mapped (ResNet-10 at input 32: layer 0 a 16^3 grid, layer 1 8^3)
    layer: int = 1
    max_epochs: int = 30
    patience: int = 5
    lr: float = 3e-3
    weight_decay: float = 0.01
    batch_size: int = 4
    warmup_epochs: float = 1.0
    #: weight of the soft Dice term (:func:`~.organmaps.organ_map_loss`)
    dice: float = 1.0
    #: train on randomly flipped copies (each axis, each volume, seeded), maps flipped alike
    flips: bool = False
    device: str = "cpu"
    #: torch CPU threads while it trains and predicts (0: torch's default); one is fastest on a shared CPU
    threads: int = 1

    def __post_init__(self) -> None:
        if self.max_epochs < 1 or self.batch_size < 1 or self.lr <= 0 or self.patience < 1:
            raise ConfigError(f"organmaps3d: max_epochs, batch_size, patience and lr must be positive, got {self}")
        if self.dice < 0:
            raise ConfigError(f"organmaps3d: the Dice weight must be >= 0, got {self.dice}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> OrganMap3dConfig:
        """The config of a run's ``options``; an unknown key is one line with "did you mean"."""

        opts = options_of(cls, options, "organmaps3d")
        if "model_args" in opts:
            opts["model_args"] = {**DEFAULT_MODEL_ARGS, **(opts["model_args"] or {})}
        return cls(**opts)

    def identity(self) -> dict[str, Any]:
        """What the run computes (device and threads left out: they change no answer beyond numerics)."""
        return {k: v for k, v in asdict(self).items() if k not in ("device", "threads")}


# --------------------------------------------------------------------------- targets and readout
def organ_shares3d(labels: np.ndarray, grid: int, n_labels: int) -> np.ndarray:
    """``(N, grid^3, n_labels)`` float32: per cell of a ``grid^3`` tiling of each ``(N, S, S, S)``
    label volume (z-major, like a 3-D encoder's flattened tokens), the share of its voxels
    carrying each label. Cells are ``floor(index * grid / S)`` on every axis."""
    labels = np.asarray(labels)
    n, size = labels.shape[0], labels.shape[1]
    if labels.ndim != 4 or labels.shape[1:] != (size, size, size):
        raise ConfigError(f"organmaps3d: label volumes must be (N, S, S, S) cubes, got {labels.shape}")
    if labels.size and int(labels.max()) >= n_labels:
        raise ConfigError(f"organmaps3d: label {int(labels.max())} outside 0..{n_labels - 1}")
    ax = np.arange(size) * grid // size
    cell = ((ax[:, None, None] * grid + ax[None, :, None]) * grid + ax[None, None, :]).astype(np.int64)
    per_cell = np.bincount(cell.ravel(), minlength=grid**3).astype(np.float64)
    out = np.empty((n, grid**3, n_labels), dtype=np.float32)
    for i in range(n):
        counts = np.bincount((cell * n_labels + labels[i].astype(np.int64)).ravel(), minlength=grid**3 * n_labels)
        out[i] = counts.reshape(grid**3, n_labels) / per_cell[:, None]
    return out


def map_organs(maps: np.ndarray, size: int, mm_per_voxel: float):
    """The :class:`~spar_bench.builder.samples.level4.VolumeOrgans` of one volume's organ maps
    ``(g^3, 17)`` (label 0 the background): each organ's centroid (z, row, col) in voxel indices
    is the cells' centres weighted by its share, its voxel count the summed shares times a cell's
    voxels; an organ with no mass is absent (NaN centroid). Boxes are the whole cube (no rule
    read out here uses them)."""

    grid = round(maps.shape[0] ** (1 / 3))
    if grid**3 != maps.shape[0]:
        raise ConfigError(f"organmaps3d: {maps.shape[0]} map cells are not a cube grid")
    c = (np.arange(grid) + 0.5) * size / grid - 0.5  # a cell's centre as a voxel index
    zyx = np.stack(np.meshgrid(c, c, c, indexing="ij"), -1).reshape(-1, 3)  # z-major cells
    organ = maps[:, 1:].astype(np.float64)
    mass = organ.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        centroid = (organ.T @ zyx) / mass[:, None]
    centroid[mass <= 0] = np.nan
    counts = mass * (size / grid) ** 3
    n = organ.shape[1]
    return VolumeOrgans(counts, centroid, float(mm_per_voxel), [int(o) for o in np.flatnonzero(mass > 0)],
                        np.zeros((n, 3), np.int64), np.full((n, 3), size - 1, np.int64))  # fmt: skip


@dataclass
class MapVolume:
    """What :func:`~spar_bench.probes.runs.mask_oracle.answer` reads of a volume, from maps."""

    organs: Any
    rules: dict[str, float]


def readout(probe: str, organs, t, items: np.ndarray, rules: dict[str, float]) -> np.ndarray:
    """The answers of items ``items`` of ``t`` (one volume's questions) by the mask oracle's rule
    for Level 4 probe ``probe`` on measures ``organs`` (:func:`map_organs`)."""
    from spar_bench.probes.runs.mask_oracle import answer

    v, y = MapVolume(organs, rules), t.y
    return np.array([answer(probe, v, int(y["organ_a"][i]), int(y["organ_b"][i]), int(y["organ_c"][i]),
                            int(y["axis"][i])) for i in items.tolist()], np.int64)  # fmt: skip


def localise(organs, size: int) -> np.ndarray:
    """(16, 3) normalised (x, y, z) centroids, 0.5 where an organ is absent (as the mask oracle)."""

    c = normalised_centroid(organs, size)
    return np.where(np.isfinite(c), c, np.float32(0.5))


#: the last maps trained in this process: ``key -> (weights, MapTraining)``. Every probe of one
#: seed trains the same maps (same build, volumes, config and seed: the same bytes), so a
#: run of several probes trains them once per seed, not once per probe.
FITTED_KEPT = 8
_FITTED: dict[tuple, tuple[dict, Any]] = {}


# --------------------------------------------------------------------------- the model
class MapNet:
    """The trainable 3-D encoder, its linear organ map and their optimiser and schedule."""

    def __init__(self, cfg: OrganMap3dConfig, size: int, seed: int, steps: int, dev):
        import torch

        args = {**cfg.model_args, "input_size": size}
        self.cfg, self.layer = cfg, cfg.layer
        self.enc = load_trainable(cfg.encoder, weights=None, init="scratch", seed=seed, model_kwargs=args)
        self.enc.to(dev)
        with torch.no_grad():
            tokens, _ = encode(self.enc, torch.zeros(1, size, size, size, dtype=torch.uint8), self.layer)
        self.grid = round(tokens.shape[1] ** (1 / 3))
        if self.grid**3 != tokens.shape[1]:
            raise ConfigError(f"organmaps3d: layer {self.layer} of {cfg.encoder} has {tokens.shape[1]} tokens, "
                              "not a cube grid")  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "organ-map-3d-head"))
            self.head = torch.nn.Linear(tokens.shape[2], 17).to(dev)
        params = list(self.enc.module.parameters()) + list(self.head.parameters())
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = int(round(cfg.warmup_epochs * steps / cfg.max_epochs))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, warm, steps))

    def logits(self, volumes):
        tokens, _ = encode(self.enc, volumes, self.layer)
        return self.head(tokens[:, int(self.enc.spec.n_prefix) :])

    def loss(self, volumes, shares):
        logits = self.logits(volumes)
        return organ_map_loss(logits, shares.to(logits.device, non_blocking=True), self.cfg.dice)

    def weights(self) -> dict:
        return copy.deepcopy({"encoder": self.enc.module.state_dict(), "head": self.head.state_dict()})

    def load(self, w: dict) -> None:
        self.enc.module.load_state_dict(w["encoder"])
        self.head.load_state_dict(w["head"])

    def maps(self, volumes: np.ndarray, batch: int = 16) -> np.ndarray:
        """``(N, g^3, 17)`` float32 predicted shares of uint8 volumes ``(N, S, S, S)``."""
        import torch

        self.enc.module.eval()
        out = []
        with torch.no_grad():
            for s in range(0, len(volumes), batch):
                x = torch.from_numpy(np.ascontiguousarray(volumes[s : s + batch]))
                out.append(torch.sigmoid(self.logits(x)).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.grid**3, 17), np.float32)


def flip_batch(x, y, grid: int, rng: np.random.Generator):
    """Volumes ``x (B, S, S, S)`` and their maps ``y (B, g^3, L)`` each flipped on a random
    subset of its three axes (the same flips for a volume and its map)."""
    import torch

    y = y.reshape(len(y), grid, grid, grid, -1)
    xs, ys = [], []
    for i, axes in enumerate(rng.integers(0, 2, (len(x), 3)).astype(bool)):
        dims = [d for d, f in enumerate(axes) if f]
        xs.append(torch.flip(x[i], dims) if dims else x[i])
        ys.append(torch.flip(y[i], dims) if dims else y[i])
    return torch.stack(xs), torch.stack(ys).reshape(len(x), grid**3, -1)


@dataclass
class MapTraining:
    """The training record: epochs, the best epoch and its validation loss, why it stopped."""

    epochs_run: int
    best_epoch: int
    best_val_loss: float
    history: list
    seconds: float
    stopped: str

    def stopped_by(self, patience: int) -> str:
        return self.stopped


def _epoch(m: MapNet, data: tuple, seed: int, epoch: int) -> float:
    """One seeded pass over the training volumes; the mean loss."""
    import torch

    x, y = data
    order = np.random.default_rng(derive_seed(seed, "organ-map-3d-order", epoch)).permutation(len(x))
    flips = np.random.default_rng(derive_seed(seed, "organ-map-3d-flips", epoch))
    m.enc.module.train()
    total = 0.0
    for s in range(0, len(order), m.cfg.batch_size):
        check_stop()
        i = torch.from_numpy(np.sort(order[s : s + m.cfg.batch_size]))
        xb, yb = flip_batch(x[i], y[i], m.grid, flips) if m.cfg.flips else (x[i], y[i])
        loss = m.loss(xb, yb)
        m.opt.zero_grad(set_to_none=True)
        loss.backward()
        m.opt.step()
        m.sched.step()
        total += float(loss.detach()) * len(i)
    return total / len(order)


def _val_loss(m: MapNet, data: tuple) -> float:
    import torch

    x, y = data
    m.enc.module.eval()
    with torch.no_grad():
        return sum(float(m.loss(x[s : s + 16], y[s : s + 16])) * len(x[s : s + 16])
                   for s in range(0, len(x), 16)) / len(x)  # fmt: skip


def train_maps(m: MapNet, train: tuple, val: tuple, seed: int) -> MapTraining:
    """Train ``m`` on ``train`` ``(volumes, shares)`` tensors, early-stopped on ``val``'s loss;
    the best epoch's weights are left in ``m``."""
    history, best, best_w, t0 = [], (float("inf"), -1), None, time.perf_counter()
    stopped = "max_epochs"
    for epoch in range(m.cfg.max_epochs):
        history.append({"epoch": epoch, "train_loss": _epoch(m, train, seed, epoch), "val_loss": _val_loss(m, val)})
        if history[-1]["val_loss"] < best[0]:
            best, best_w = (history[-1]["val_loss"], epoch), m.weights()
        elif epoch - best[1] >= m.cfg.patience:
            stopped = "early_stopping"
            break
    m.load(best_w)
    return MapTraining(len(history), best[1], best[0], history, time.perf_counter() - t0, stopped)


@contextmanager
def torch_threads(n: int):
    """Run the block on ``n`` torch CPU threads (0: as they are), then restore them."""
    import torch

    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the predictor
@dataclass
class OrganMaps3d:
    """The computation model of one Level 4 probe on ``build`` (see the module doc), a
    :class:`~spar_bench.probes.runs.predictors.Predictor`: ``fit`` trains the organ maps on the
    training items' volumes (validation: the validation items'), ``predict`` reads them out."""

    spec: Any
    build: Any
    cfg: OrganMap3dConfig = field(default_factory=OrganMap3dConfig)
    seed: int = 0
    kind: str = "organmaps3d"
    net: MapNet | None = field(default=None, repr=False)
    training: MapTraining | None = None

    def __post_init__(self) -> None:
        if not LEVEL_SPECS[self.spec.level].volume:
            raise ConfigError(f"organmaps3d answers Level 4 (volume) probes only, not {self.spec.name}")
        if self.spec.output != "points" and LEVEL4_PROBES[self.spec.index] not in READOUT_PROBES:
            raise ConfigError(f"organmaps3d: {self.spec.name} needs surfaces or lesions its organ maps do not hold; "
                              f"it reads out localisation and {', '.join(READOUT_PROBES)}")  # fmt: skip

    @classmethod
    def on_build(cls, spec, build) -> OrganMaps3d:
        return cls(spec, build)

    @staticmethod
    def trains(options: dict[str, Any] | None) -> Trains:
        """Its most epochs for each seed, on the training volumes (the plan's price of a ``predict:`` step)."""
        return Trains(OrganMap3dConfig.from_options(options).max_epochs, volumes=True)

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        """A one-line error for options that are no :class:`OrganMap3dConfig` (at plan time)."""
        OrganMap3dConfig.from_options(options)

    @classmethod
    def open(cls, run, out, options):
        """The run of ``run`` (a :class:`~spar_bench.probes.runs.spec.PredictorSpec`, its ``options``
        the :class:`OrganMap3dConfig`): a build job whose record holds the training."""

        build = Build(run.features)
        cfg = OrganMap3dConfig.from_options(getattr(run, "options", None))
        return OrganMapJob.of(run, cls(run.spec, build, cfg, run.seed), build, out, run.kind)

    def blind(self):
        return ConstantPrior(self.spec)

    def _volumes(self, split: str, rows: np.ndarray, fld: str = "image") -> np.ndarray:
        return self.build.images(self.spec.level, split, rows, field=fld)

    def _data(self, split: str, rows: np.ndarray, grid: int):
        import torch

        shares = organ_shares3d(self._volumes(split, rows, "label"), grid, 17)
        return torch.from_numpy(np.ascontiguousarray(self._volumes(split, rows))), torch.from_numpy(shares)

    def fit(self, train, val) -> MapTraining:
        import torch

        level = self.spec.level
        val_split = "val" if "val" in self.build.splits(level) else "train"
        rows, vrows = np.unique(train.rows), np.unique(val.rows)
        if len(rows) == 0 or len(vrows) == 0:
            raise ConfigError(f"organmaps3d: {self.build.root.name} has no training or validation volumes for {self.spec.name}")
        size = int(self._volumes("train", rows[:1]).shape[-1])
        torch.manual_seed(self.seed)
        steps = self.cfg.max_epochs * -(-len(rows) // self.cfg.batch_size)
        self.net = MapNet(self.cfg, size, self.seed, steps, pick_device(self.cfg.device))
        if self.cfg.flips and size % self.net.grid:
            raise ConfigError(f"organmaps3d: flips need the volume side ({size}) to be a multiple of the map grid "
                              f"({self.net.grid}) so a flipped map is the flipped volume's; use flips: false")  # fmt: skip
        key = (self.build.fingerprint, val_split, self.seed, repr(sorted(self.cfg.identity().items())),
               rows.tobytes(), vrows.tobytes())
        if key in _FITTED:  # the same maps for another probe of this seed: trained once per process
            weights, self.training = _FITTED[key]
            self.net.load(weights)
            return self.training
        tr, va = self._data("train", rows, self.net.grid), self._data(val_split, vrows, self.net.grid)
        with torch_threads(self.cfg.threads):
            self.training = train_maps(self.net, tr, va, self.seed)
        if len(_FITTED) >= FITTED_KEPT:
            _FITTED.pop(next(iter(_FITTED)))
        _FITTED[key] = (self.net.weights(), self.training)
        return self.training

    def predict(self, t, split: str = "test") -> np.ndarray:
        if self.net is None:
            raise ConfigError(f"organmaps3d: {self.spec.name} predicts only after fit()")
        oracle = MaskOracle(self.spec, self.build)  # the build's rules and voxel sizes, read as it reads them
        rules, mm = oracle.rules(), self.build.read(self.spec.level, split, ["mm_per_voxel"])["mm_per_voxel"]
        points = self.spec.output == "points"
        out = np.zeros((len(t), *self.spec.output_shape), np.float32) if points else np.zeros(len(t), np.int64)
        rows = np.unique(t.rows)
        volumes = self._volumes(split, rows)
        with torch_threads(self.cfg.threads):
            maps_of = self.net.maps(volumes)
        for row, maps in zip(rows.tolist(), maps_of, strict=True):
            organs = map_organs(maps, volumes.shape[-1], float(mm[row]))
            items = np.flatnonzero(t.rows == row)
            out[items] = localise(organs, volumes.shape[-1]) if points else \
                readout(LEVEL4_PROBES[self.spec.index], organs, t, items, rules)  # fmt: skip
        return out

    def record(self) -> dict[str, Any]:
        """The run's training: the config (device included), the grid, the loss per epoch, time."""
        tr = self.training
        return {"mode": "organ-maps-3d", "config": asdict(self.cfg), "grid": self.net.grid if self.net else None,
                "readout": "share-weighted cell centres and summed shares; the mask oracle's rule",
                "blind": "the question-type prior fitted on the training items",
                **({"history": tr.history} if tr else {})}  # fmt: skip


@dataclass
class OrganMapJob(BuildJob):
    """A :class:`~spar_bench.probes.runs.build_job.BuildJob` of :class:`OrganMaps3d` whose metrics and
    record also hold its training (``training``; the config in the record's ``extra``)."""

    @classmethod
    def of(cls, run, predictor: OrganMaps3d, build, out, slug: str) -> OrganMapJob:
        job = super().of(run, predictor, build, out, slug)
        job.record = job.record.replace(inputs={"organ_maps_3d": predictor.cfg.identity()})  # resolved defaults too
        return job

    def score(self, fitted):
        metrics, record, files = super().score(fitted)
        training = self.predictor.record()
        metrics["training"] = training
        return metrics, record.replace(extra={**record.extra, "training": training}), files
