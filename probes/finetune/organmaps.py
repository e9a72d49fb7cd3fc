"""Organ-map pretraining: an encoder trained to say which organs each of its tokens covers.

The target of token ``t`` of a Level 3 slice is the share of its cell's pixels (the 224
frame cut into the encoder's token grid) that carry each label (0 background, 1..16 the
organs): the label map area-pooled onto the token grid. A linear map of each token is
trained against those shares with binary cross-entropy, each label its own output, so a
small organ is not outvoted by its large neighbour as it would be under a softmax; an
optional soft Dice term (:attr:`OrganMapConfig.dice`, :func:`organ_map_loss`) weighs every
organ present in a slice alike, however few cells it covers, where the BCE, a mean over
cells, lets a small organ's few cells go nearly unheard. A Dice-trained map finds small
organs but overstates how much of each cell they fill, so such a run also gets a *share head*
(:func:`fit_share_head`): a linear map of the frozen tokens fitted by the BCE alone, whose
maps are calibrated shares (their sum is an organ's area). No
question and no answer is seen: the encoder learns where each organ is from its appearance
alone, and a probe head trained on its frozen features (``spar-probe fit``) then has
organ maps to compute from.

It is the encoder of the calibration's *computation* model (the ``calibration`` step of
``spar-bench run recall-vs-computation``, docs/RESULTS.md "calibrated"): trained on random layouts, whose organs have distinct
intensities, it can only find an organ by its appearance, never by where organs usually lie.

One run = (encoder, model args, build, :class:`OrganMapConfig`). Its folder holds
``encoder.safetensors`` (``spar-probe cache --weights`` reads it, model args and training in
its metadata), ``organ_head.pt`` (the linear map), ``config.json`` and ``metrics.json``
(the loss per epoch; written last: it marks a finished run, which a rerun keeps), and with a
Dice term ``share_head.pt``. An
interrupted run resumes from ``checkpoint.pt`` at its last finished epoch; the epoch order
is drawn from ``(seed, epoch)`` alone, so a resumed run trains on the batches an
uninterrupted one does.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from spar_bench.builder.schema import N_ORGANS
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.procs import check_stop
from spar_bench.provenance import CACHE_PACKAGES, package_versions, protocol_versions
from spar_bench.seeding import derive_seed

from ..hardware import pick_device
from ..runs.record import RunRecord
from ..runs.session import RunOptions, execute
from ..runs.store import check_run_dir
from ..tasks import get_probe
from .config import lr_factor
from .model import EXPORT_FILE, encode, export_encoder, load_trainable

HEAD_FILE = "organ_head.pt"
SHARE_HEAD_FILE = "share_head.pt"
#: the share head's fit: Adam at this learning rate, this many passes over the training slices
SHARE_HEAD_FIT = {"epochs": 5, "lr": 1e-2, "batch_size": 256}
CHECKPOINT_FILE = "checkpoint.pt"
#: the run kind of an organ-map run's record (``config.json``)
RUN_KIND = "organ-maps"
#: label 0 background, 1..16 the organs
N_LABELS = N_ORGANS + 1
#: the encoder the organ maps train by default (run kind ``organmaps``; the calibration's
#: computation model): a narrow ResNet-10 at 128 x 128 input with output stride 16, 8 x 8 tokens,
#: so that small organs keep their pixels in the stem (at 64 px the smallest are 2-3 pixels wide)
MAP_ENCODER = "timm:resnet10t"
MAP_MODEL_ARGS = {"channels": [16, 32, 64, 128], "stem_width": 16, "output_stride": 16,
                  "pretrained_cfg_overlay": {"input_size": [3, 128, 128]}}
#: the probe whose level holds the whole slices and their label maps (the registry knows levels)
SLICE_PROBE = "level3.relative_position"


def slice_level() -> str:
    """The level of the whole 224 slices (Level 3), from the probe registry."""

    return get_probe(SLICE_PROBE).level


@dataclass(frozen=True)
class OrganMapConfig:
    """The pretraining schedule: AdamW, linear warm-up then cosine decay, a fixed epoch count
    (the loss does not overfit: every token of every slice is a target)."""

    epochs: int = 8
    lr: float = 2e-3
    weight_decay: float = 0.01
    batch_size: int = 32
    warmup_epochs: float = 0.8
    seed: int = 0
    #: weight of the soft Dice term added to the BCE (0: BCE alone), see :func:`organ_map_loss`
    dice: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError(f"organ maps: epochs, batch_size and lr must be positive, got {self}")
        if self.dice < 0:
            raise ConfigError(f"organ maps: the Dice weight must be >= 0, got {self.dice}")


def organ_map_loss(logits, shares, dice: float = 0.0):
    """The pretraining loss of ``logits`` against ``shares`` (both ``(N, cells, labels)``,
    label 0 the background): the BCE of every output, plus ``dice`` times one minus the mean
    soft Dice ``2 sum(p s) / (sum p + sum s)`` over the (slice, organ) pairs where the organ
    is present. Every present organ counts once, whatever its size."""
    import torch
    import torch.nn.functional as F

    loss = F.binary_cross_entropy_with_logits(logits, shares)
    if dice == 0:
        return loss
    p, s = torch.sigmoid(logits[..., 1:]), shares[..., 1:]
    present = s.sum(1) > 0
    if not bool(present.any()):
        return loss
    soft = 2 * (p * s).sum(1) / (p.sum(1) + s.sum(1)).clamp(min=1e-6)
    return loss + dice * (1 - soft[present].mean())


def organ_shares(labels: np.ndarray, grid: int, n_labels: int) -> np.ndarray:
    """``(N, grid*grid, n_labels)`` float32: per cell of a ``grid`` x ``grid`` tiling of each
    ``(N, H, W)`` label map (row-major, like a CNN's flattened tokens), the share of its pixels
    carrying each label. Cells are ``floor(pixel * grid / size)``: any size, any grid."""
    labels = np.asarray(labels)
    n, h, w = labels.shape
    if labels.size and int(labels.max()) >= n_labels:
        raise ConfigError(f"organ maps: label {int(labels.max())} outside 0..{n_labels - 1}")
    rows, cols = np.arange(h) * grid // h, np.arange(w) * grid // w
    cell = (rows[:, None] * grid + cols[None, :]).astype(np.int64)
    per_cell = np.bincount(cell.ravel(), minlength=grid * grid).astype(np.float64)
    out = np.empty((n, grid * grid, n_labels), dtype=np.float32)
    for s in range(0, n, 256):  # bounded memory: 256 maps' keys at a time
        lab = labels[s : s + 256].astype(np.int64)
        key = (np.arange(lab.shape[0])[:, None, None] * grid * grid + cell[None]) * n_labels + lab
        counts = np.bincount(key.ravel(), minlength=lab.shape[0] * grid * grid * n_labels)
        out[s : s + lab.shape[0]] = counts.reshape(-1, grid * grid, n_labels) / per_cell[None, :, None]
    return out


def token_grid(enc, n_tokens: int) -> int:
    """The side of the encoder's square grid of patch tokens (prefix tokens excluded)."""
    n = n_tokens - int(enc.spec.n_prefix)
    side = int(round(n**0.5))
    if side * side != n:
        raise ConfigError(f"organ maps: encoder {enc.spec.name} has {n} patch tokens, not a square grid")
    return side


def slice_count(build, split: str) -> int:
    """The number of whole slices of a build's split; a one-line error where there are none."""
    level = slice_level()
    n = build.count(level, split) if level in build.levels() and split in build.splits(level) else 0
    if n == 0:
        raise ConfigError(f"organ maps: build {build.root.name} has no {level} {split} slices "
                          f"(build it with --levels {level})")
    return n


def _split_data(build, split: str, grid: int, n_labels: int):
    """``(images uint8 (N, 224, 224), shares (N, grid*grid, n_labels))`` of a split's slices, as tensors."""
    import torch

    level, rows = slice_level(), np.arange(slice_count(build, split))
    images = build.images(level, split, rows)
    shares = organ_shares(build.images(level, split, rows, field="label"), grid, n_labels)
    return torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(shares)


class _Model:
    """The trainable encoder, its linear organ map and their optimiser and schedule."""

    def __init__(self, encoder: str, model_args: dict | None, cfg: OrganMapConfig, n_labels: int, steps: int,
                 dev):
        import torch

        self.enc = load_trainable(encoder, weights=None, init="scratch", seed=cfg.seed, model_kwargs=model_args)
        self.enc.prefer_channels_last().to(dev)
        self.dice = cfg.dice
        with torch.no_grad():
            tokens, _ = encode(self.enc, torch.zeros(1, 224, 224, dtype=torch.uint8))
        self.n_tokens, dim = tokens.shape[1], tokens.shape[2]
        self.grid = token_grid(self.enc, self.n_tokens)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(cfg.seed, "organ-map-head"))
            self.head = torch.nn.Linear(dim, n_labels).to(dev)
        params = list(self.enc.module.parameters()) + list(self.head.parameters())
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warm = int(round(cfg.warmup_epochs * steps / cfg.epochs))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, warm, steps))

    def loss(self, images, shares):
        tokens, _ = encode(self.enc, images)  # the images go to the encoder's device there
        shares = shares.to(tokens.device, non_blocking=True)
        return organ_map_loss(self.head(tokens[:, int(self.enc.spec.n_prefix) :]), shares, self.dice)

    def state(self, epoch: int, history: list) -> dict:
        return {"epoch": epoch, "history": history, "encoder": self.enc.module.state_dict(),
                "head": self.head.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict()}

    def load(self, state: dict) -> None:
        self.enc.module.load_state_dict(state["encoder"])
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])


def _epoch(m: _Model, x, y, cfg: OrganMapConfig, epoch: int, bar) -> float:
    """One seeded pass over the training slices; the mean loss."""
    import torch

    order = np.random.default_rng(derive_seed(cfg.seed, "organ-map-order", epoch)).permutation(len(x))
    m.enc.module.train()
    total = 0.0
    for s in range(0, len(order), cfg.batch_size):
        check_stop()  # a swallowed SIGTERM: stop here; checkpoint.pt holds the last finished epoch
        i = torch.from_numpy(np.sort(order[s : s + cfg.batch_size]))
        loss = m.loss(x[i], y[i])
        m.opt.zero_grad(set_to_none=True)
        loss.backward()
        m.opt.step()
        m.sched.step()
        total += float(loss.detach()) * len(i)
        bar.update(len(i))
    return total / len(order)


def _val_loss(m: _Model, x, y) -> float:
    import torch

    m.enc.module.eval()
    total = 0.0
    with torch.no_grad():
        for s in range(0, len(x), 128):
            total += float(m.loss(x[s : s + 128], y[s : s + 128])) * len(x[s : s + 128])
    return total / len(x)


def _identity(encoder: str, model_args: dict | None, build, cfg: OrganMapConfig) -> dict[str, Any]:
    return {"encoder": encoder, "model_args": model_args or {}, "dataset_dir": build.root.name,
            "dataset_fingerprint": build.fingerprint, "organ_map_config": asdict(cfg)}


def _same_identity(stored: dict, ident: dict) -> bool:
    """Whether a stored identity (a finished run's ``config.json``, a checkpoint's) is ``ident``;
    a run from before a config field existed was trained at that field's default."""
    cfg = {**asdict(OrganMapConfig()), **stored.get("organ_map_config", {})}
    return {k: stored.get(k) for k in ident} | {"organ_map_config": cfg} == json.loads(json.dumps(ident))


def organ_map_record(encoder: str, model_args: dict | None, build, cfg: OrganMapConfig):
    """The :class:`~spar_bench.probes.runs.record.RunRecord` of an organ-map run, as far as it is
    known before training (its identity: encoder, model args, build fingerprint, config)."""

    return RunRecord(kind=RUN_KIND, probe=slice_level(), head=RUN_KIND, seed=cfg.seed, model=encoder,
                     build=build.root.name, build_fingerprint=build.fingerprint,
                     inputs={"model_args": model_args or {}}, options={"organ_map_config": asdict(cfg)},
                     versions=package_versions(CACHE_PACKAGES), protocol=protocol_versions(build.manifest))


def _legacy_finished(rd: Path, ident: dict) -> bool:
    """Whether ``rd`` holds a finished run written before the run record (its ``config.json`` has
    no ``kind``) of this identity, compared by its old identity (a config field it lacks counts
    at its default); one of other settings is refused in one line. A run with a record is the
    session's to judge (:func:`~spar_bench.probes.runs.session.execute`)."""
    if not (rd / "metrics.json").is_file() or not (rd / EXPORT_FILE).is_file():
        return False
    try:
        kept = json.loads((rd / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(kept, dict) or "kind" in kept:
        return False
    if not _same_identity(kept, ident):
        raise ConfigError(f"organ maps: {rd} holds a finished run of other settings; use another folder")
    return True


def _run_files(m: _Model, meta: dict, share: tuple | None, timing: dict) -> dict:
    """The run's declared files (:func:`~spar_bench.probes.runs.store.write_run`): encoder, organ
    head, share head (a Dice term), timing (presence only)."""
    import torch

    head_state = {k: v.detach().cpu() for k, v in m.head.state_dict().items()}
    files = {EXPORT_FILE: (lambda p: export_encoder(m.enc, p, meta), True),
             HEAD_FILE: (lambda p: torch.save({"state_dict": head_state, "n_labels": N_LABELS, "grid": m.grid}, p), True),
             "timing.json": (lambda p: p.write_text(json.dumps(timing) + "\n"), False)}
    if share is not None:
        head, loss = share
        files[SHARE_HEAD_FILE] = (lambda p: torch.save({"state_dict": head.state_dict(), "fit": SHARE_HEAD_FIT,
                                                        "train_loss": loss}, p), True)
    return files


def _train(m: _Model, ckpt: Path, ident: dict, cfg: OrganMapConfig, data: tuple, progress: bool):
    """``(history, first epoch trained here, seconds)``: the epochs still to train, resumed from
    ``ckpt`` when it holds a run of ``ident``, with a checkpoint after every epoch. ``data``:
    the training and validation ``(images, shares)``."""
    import torch

    x, y, xv, yv = data
    history, start = [], 0
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if _same_identity(state.get("identity") or {}, ident):
            m.load(state)
            start, history = state["epoch"] + 1, state["history"]
    t0 = time.perf_counter()
    with tqdm(total=(cfg.epochs - start) * len(x), unit="img", desc="organ maps", disable=not progress) as bar:
        for epoch in range(start, cfg.epochs):
            train = _epoch(m, x, y, cfg, epoch, bar)
            history.append({"epoch": epoch, "train_loss": train, "val_loss": _val_loss(m, xv, yv)})
            bar.set_postfix(val=f"{history[-1]['val_loss']:.4f}")
            tmp = ckpt.with_name(ckpt.name + ".tmp")
            torch.save({**m.state(epoch, history), "identity": ident}, tmp)
            tmp.replace(ckpt)
    return history, start, time.perf_counter() - t0


class OrganMapJob:
    """The organ-map pretraining of one encoder on one build as a job of the session
    (:func:`~spar_bench.probes.runs.session.execute`: kept when finished with this identity,
    refused in one line when finished with another, else started, fitted, scored and written
    whole by :func:`~spar_bench.probes.runs.store.write_run`). An interrupted run resumes from
    its checkpoint in ``rd``."""

    declared = frozenset({EXPORT_FILE, HEAD_FILE, SHARE_HEAD_FILE, "timing.json", CHECKPOINT_FILE})

    def __init__(self, encoder: str, model_args: dict | None, build, cfg: OrganMapConfig, rd: Path,
                 device: str = "cpu", progress: bool = True):
        self.encoder, self.model_args, self.build, self.cfg, self.rd = encoder, model_args, build, cfg, Path(rd)
        self.device, self.progress = device, progress
        self.ident = _identity(encoder, model_args, build, cfg)
        self.record = organ_map_record(encoder, model_args, build, cfg)
        self.model: _Model | None = None
        self.dev: Any = None

    def start(self) -> None:
        """No slices, or a bad device: an error, and no folder."""
        import torch

        steps = self.cfg.epochs * -(-slice_count(self.build, "train") // self.cfg.batch_size)
        slice_count(self.build, "val")
        self.dev = dev = pick_device(self.device)
        check_run_dir(self.rd, self.declared, what="organ-map run folder")
        self.rd.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.cfg.seed)
        self.model = _Model(self.encoder, self.model_args, self.cfg, N_LABELS, steps, dev)

    def fit(self) -> dict[str, Any]:
        """Train the organ maps (resumed from the checkpoint), then the share head (a Dice term)."""
        m, cfg = self.model, self.cfg
        x, y = _split_data(self.build, "train", m.grid, N_LABELS)
        data = (x, y, *_split_data(self.build, "val", m.grid, N_LABELS))
        history, start, seconds = _train(m, self.rd / CHECKPOINT_FILE, self.ident, cfg, data, self.progress)
        share = fit_share_head(m.enc, m.head, x, y, cfg.seed) if cfg.dice > 0 else None
        timing = {"seconds": seconds, "epochs": cfg.epochs - start, "device": self.dev.type,
                  "images_per_s": (cfg.epochs - start) * len(x) / max(seconds, 1e-9)}
        return {"history": history, "share": share, "timing": timing}

    def score(self, fitted: dict[str, Any]):
        """The training's metrics (losses per epoch), the record with the grid, the run's files."""
        m, build, cfg = self.model, self.build, self.cfg
        training = {"mode": "organ-maps", "build": build.root.name, "build_fingerprint": build.fingerprint,
                    "label": f"trained from scratch on the organ maps of build {build.root.name}",
                    "init_weights": {"kind": "random-init"}, "organ_map_config": asdict(cfg)}
        meta = {"encoder": self.encoder, "model_args": self.model_args or {}, "training": training,
                "encoder_config": m.enc.spec.to_dict()}
        history, share = fitted["history"], fitted["share"]
        record = self.record.replace(extra={"grid": m.grid, "n_tokens": m.n_tokens, "device": self.dev.type})
        metrics = {"history": history, "final_val_loss": history[-1]["val_loss"],
                   "share_head_train_loss": None if share is None else share[1]}
        return metrics, record, _run_files(m, meta, share, fitted["timing"])  # the checkpoint goes with the old folder


def pretrain_organ_maps(encoder: str, build_root: str | Path, out: str | Path, cfg: OrganMapConfig,
                        model_args: dict | None = None, progress: bool = True, device: str = "cpu") -> Path:
    """Train ``encoder`` from scratch on the organ maps of a build's Level 3 slices (see the
    module doc) through the session (:class:`OrganMapJob`); returns the run folder ``out`` (a
    finished run there is kept). ``device`` (``cpu``, ``cuda[:N]``, ``auto``) is where the
    encoder trains, in fp32; the slices stay in host memory and go over a batch at a time. The
    device is not part of the run's identity (a run finished on another device is kept);
    ``config.json`` records it."""

    job = OrganMapJob(encoder, model_args, Build(build_root), cfg, Path(out), device, progress)
    if _legacy_finished(job.rd, job.ident):
        return job.rd
    return execute(job, RunOptions(progress=progress))


def run_settings(rd: Path) -> tuple[str, dict[str, Any]]:
    """``(encoder, organ_map_config)`` of a finished organ-map run (its record, or a config.json
    written before the record)."""

    config = json.loads((Path(rd) / "config.json").read_text())
    if isinstance(config, dict) and "kind" not in config:
        return config["encoder"], config["organ_map_config"]
    rec = RunRecord.read(Path(rd))
    return str(rec.model), rec.options["organ_map_config"]


class OrganMapModel(NamedTuple):
    """A finished run: the encoder, its organ head (where each organ is), its share head (how
    much of each cell it fills: the organ head itself for a run without a Dice term) and the
    side of its token grid."""

    enc: Any
    head: Any
    grid: int
    share_head: Any


def _linear(state: dict):
    import torch

    w = state["weight"]
    head = torch.nn.Linear(w.shape[1], w.shape[0])
    head.load_state_dict(state)
    return head.eval()


def load_organ_map_model(rd: str | Path, device: str = "cpu") -> OrganMapModel:
    """The :class:`OrganMapModel` of a finished run, in eval mode: the encoder on ``device``
    (``cpu``, ``cuda[:N]``, ``auto``), the linear heads on the CPU (they read host tokens:
    :func:`patch_tokens`)."""
    import torch

    rd = Path(rd)
    if not (rd / "metrics.json").is_file():
        raise ConfigError(f"organ maps: {rd} holds no finished run (no metrics.json)")
    encoder, cfg = run_settings(rd)
    saved = torch.load(rd / HEAD_FILE, map_location="cpu", weights_only=True)
    enc = load_trainable(encoder, weights=str(rd / EXPORT_FILE), init="weights", seed=0)
    enc.prefer_channels_last().to(pick_device(device)).module.eval()
    head = _linear(saved["state_dict"])
    share = head
    if cfg.get("dice", 0.0) > 0:
        if not (rd / SHARE_HEAD_FILE).is_file():
            raise ConfigError(f"organ maps: {rd} was trained with a Dice term but has no {SHARE_HEAD_FILE}")
        share = _linear(torch.load(rd / SHARE_HEAD_FILE, map_location="cpu", weights_only=True)["state_dict"])
    return OrganMapModel(enc, head, int(saved["grid"]), share)


def patch_tokens(enc, images, batch: int = 128):
    """``(N, tokens, dim)`` float32 tensor in host memory: the patch tokens (prefix tokens
    dropped) of uint8 ``images (N, H, W)`` (array or tensor), without gradients, computed on
    the encoder's device."""
    import torch

    out = []
    with torch.no_grad():
        for s in range(0, len(images), batch):
            chunk = images[s : s + batch]
            chunk = chunk if isinstance(chunk, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(chunk))
            tokens, _ = encode(enc, chunk)
            out.append(tokens[:, int(enc.spec.n_prefix) :].float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0, 0)


def fit_share_head(enc, head, images, shares, seed: int):
    """``(share head, its final training loss)``: a copy of the organ ``head`` fitted by the
    BCE alone (:data:`SHARE_HEAD_FIT`, batches in a ``seed``-drawn order) to ``shares`` from
    the frozen ``enc``'s tokens of ``images``, so its maps are calibrated shares again."""
    import torch
    import torch.nn.functional as F

    enc.module.eval()
    tokens = patch_tokens(enc, images)
    share = _linear({k: v.detach().cpu().clone() for k, v in head.state_dict().items()}).train()
    opt = torch.optim.Adam(share.parameters(), lr=SHARE_HEAD_FIT["lr"])
    gen = torch.Generator().manual_seed(derive_seed(seed, "share-head"))
    bs, loss = SHARE_HEAD_FIT["batch_size"], 0.0
    for _ in range(SHARE_HEAD_FIT["epochs"]):
        order, total = torch.randperm(len(tokens), generator=gen), 0.0
        for s in range(0, len(order), bs):
            i = order[s : s + bs]
            batch_loss = F.binary_cross_entropy_with_logits(share(tokens[i]), shares[i])
            opt.zero_grad(set_to_none=True)
            batch_loss.backward()
            opt.step()
            total += float(batch_loss.detach()) * len(i)
        loss = total / max(len(order), 1)
    return share.eval(), loss


def predict_maps(model: OrganMapModel, images: np.ndarray, batch: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """``(organ maps, share maps)``, each ``(N, grid*grid, n_labels)`` float32: every label's
    predicted presence in every token cell of uint8 ``images (N, H, W)`` by the organ head and
    by the share head (:class:`OrganMapModel`)."""
    import torch

    tokens = patch_tokens(model.enc, images, batch)
    with torch.no_grad():
        return torch.sigmoid(model.head(tokens)).numpy(), torch.sigmoid(model.share_head(tokens)).numpy()


def map_geometry(maps: np.ndarray, grid: int, size: int = 224) -> tuple[np.ndarray, np.ndarray]:
    """``(centres (N, n_labels, 2) as (x, y) pixels of the ``size`` frame, areas (N, n_labels)
    in pixels)`` of organ maps: each label's centre is the cells' centres weighted by its share
    (sub-cell precision from partial cells), its area the summed shares times a cell's area."""
    c = (np.arange(grid) + 0.5) * size / grid
    xy = np.stack([np.tile(c, grid), np.repeat(c, grid)], 1)  # row-major cells: (x, y)
    mass = maps.sum(1)  # (N, C)
    centres = np.einsum("ntc,tk->nck", maps, xy) / np.maximum(mass, 1e-6)[..., None]
    return centres.astype(np.float32), (mass * (size / grid) ** 2).astype(np.float32)
