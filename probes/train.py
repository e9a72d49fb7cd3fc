"""Training loop of a probe head with early stopping, and prediction.

Defaults (:class:`TrainConfig`): AdamW, lr 1e-3, weight decay 0.01, batch 256, early
stopping when the validation loss has not improved for 8 epochs (the best epoch's
weights are kept) under a hard ceiling of :data:`DEFAULT_MAX_EPOCHS` epochs for every
head, gradient-norm clipping at 1.0. Patience ends the runs; the ceiling only bounds a
run whose validation loss keeps creeping down (docs/SCALE.md: on the default sweep it
does not bind; the old 40-epoch cap of the token heads ended every Levels 1-2
transformer run while it still improved). The loss, the question a head reads and the decoding of
predictions are the probe spec's (:mod:`spar_bench.probes.tasks`): Level 1 mean squared
error of the normalised (x, y) over present organs; Level 2 the permutation loss
through 20 log-domain Sinkhorn iterations masked to present tiles and valid slots,
decoded by the Hungarian algorithm; Level 3 cross-entropy.

Batching of probes that ask questions (Level 3): token heads receive each batch's DISTINCT slices once plus an item ->
slice index (:func:`group_batch`), and a head that encodes a slice once for all its
questions (``head.shares_body``, the Level 3 ``transformer``) is trained on epochs that
shuffle slices and keep each slice's questions together (:func:`epoch_order`), so a
batch of 256 questions holds ~256 / (questions per slice) slices. Its answers do not
depend on the batch, so prediction groups items by slice too.

Determinism: all torch randomness (initialisation, dropout, shuffling) happens inside
``torch.random.fork_rng`` seeded from the run's seed, with
``torch.use_deterministic_algorithms(True)``; the global RNG state of the caller is
left untouched. Same seed, same data, same thread count -> same weights and metrics.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.procs import check_stop

from .targets import Targets

if TYPE_CHECKING:
    from .heads import Head


#: The hard epoch ceiling of every head (``--max-epochs``); early stopping ends runs before it.
DEFAULT_MAX_EPOCHS = 300


@dataclass(frozen=True)
class TrainConfig:
    """How a head is trained (recorded in each run's ``config.json``); values checked on creation."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    batch_size: int = 256
    # the ceiling is recorded in every run's config.json; a run finished under another
    # default (0.2: None, meaning 100 pooled / 40 token heads) is refused, not reused
    max_epochs: int | None = DEFAULT_MAX_EPOCHS  # None: DEFAULT_MAX_EPOCHS
    patience: int = 8
    sinkhorn_iters: int = 20
    grad_clip: float = 1.0
    val_fraction: float = 0.15  # patient-grouped hold-out of train when there is no val split
    device: str = "cpu"  # "cuda" trains the head on a GPU (same seeds; float results may differ)

    def __post_init__(self) -> None:
        rules = (
            ("lr", self.lr > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("batch_size", self.batch_size >= 1, "must be at least 1"),
            ("max_epochs", self.max_epochs is None or self.max_epochs >= 1, "must be at least 1"),
            ("patience", self.patience >= 1, "must be at least 1"),
            ("sinkhorn_iters", self.sinkhorn_iters >= 1, "must be at least 1"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0 (0: no clipping)"),
            ("val_fraction", 0 < self.val_fraction < 1, "must lie strictly between 0 and 1"),
        )
        for name, ok, rule in rules:
            if not ok or not math.isfinite(float(getattr(self, name) or 0)):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {rule}, got {getattr(self, name)}")

    def epochs_for(self, input_kind: str) -> int:
        """The epoch ceiling of a head reading ``input_kind`` features (the same for all)."""
        return int(self.max_epochs) if self.max_epochs is not None else DEFAULT_MAX_EPOCHS

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainResult:
    epochs_run: int
    best_epoch: int
    best_val_loss: float
    train_loss: list[float]
    val_loss: list[float]

    def stopped_by(self, patience: int) -> str:
        return stopped_by(self.epochs_run, self.best_epoch, patience)


def stopped_by(epochs_run: int, best_epoch: int, patience: int) -> str:
    """Why training ended: ``early_stopping`` (no better validation loss for ``patience``
    epochs) or ``max_epochs`` (the cap, with the loss still improving within the patience
    window: the head could have gone further). ``best_epoch`` counts from 0."""
    return "early_stopping" if epochs_run - 1 - best_epoch >= patience else "max_epochs"


def batch_tensors(feats: np.ndarray, t: Targets, idx: np.ndarray):
    """``(x, q, y)`` tensors of the items ``idx`` of ``t`` (features gathered by cache row)."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(feats[t.rows[idx]], dtype=np.float32))
    return (x, *question_and_targets(t, idx))


def question_and_targets(t: Targets, idx: np.ndarray):
    """``(q, y)`` tensors of the items ``idx`` of ``t``: the question (None: the probe asks none)
    and the target arrays."""
    import torch

    q = t.spec.question(t, idx)
    if q is not None:
        q = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in q.items()}
    y = {k: torch.from_numpy(np.ascontiguousarray(v[idx])) for k, v in t.y.items()}
    return q, y


def group_batch(feats: np.ndarray, t: Targets, idx: np.ndarray):
    """``(x, index, q, y)``: the DISTINCT cache rows of items ``idx`` once, and each item's row.

    ``x`` is ``(U, ...)`` for the ``U`` distinct rows, ``index`` ``(len(idx),)`` int64
    maps each item to its row of ``x``; ``q`` and ``y`` are as in :func:`batch_tensors`.
    A token head called as ``head(x, q, index)`` then encodes each slice once for all
    of its Level 3 questions.
    """
    import torch

    uniq, inv = np.unique(t.rows[idx], return_inverse=True)
    x = torch.from_numpy(np.ascontiguousarray(feats[uniq], dtype=np.float32))
    return (x, torch.from_numpy(inv.reshape(-1).astype(np.int64)), *question_and_targets(t, idx))


def is_grouped(head: Head, t: Targets) -> bool:
    """Whether ``head`` reads question items through :func:`group_batch` (token heads)."""
    return t.spec.asks and head.input_kind == "tokens"


def to_device(device, obj):
    """``obj`` (a tensor, a dict of tensors or None) on ``device``."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return {k: v.to(device, non_blocking=True) for k, v in obj.items()}
    return obj.to(device, non_blocking=True)


def _device_of(head):
    return next(head.parameters()).device


def _run(head, feats: np.ndarray, t: Targets, idx: np.ndarray):
    """``(output, y)`` of ``head`` on items ``idx`` (on the head's device); Level 3 token
    heads get distinct rows once."""
    dev = _device_of(head)
    if is_grouped(head, t):
        x, index, q, y = (to_device(dev, v) for v in group_batch(feats, t, idx))
        return head(x, q, index), y
    x, q, y = (to_device(dev, v) for v in batch_tensors(feats, t, idx))
    return head(x, q), y


def eval_order(head: Head, t: Targets) -> np.ndarray:
    """Item order for evaluation: by cache row for heads sharing a body per row, else as is."""
    if head.shares_body:
        return np.argsort(t.rows, kind="stable")
    return np.arange(len(t))


def epoch_order(head: Head, t: Targets, gen) -> np.ndarray:
    """A seeded item order for one training epoch (``gen``: a ``torch.Generator``).

    Heads that share one body per cache row (``head.shares_body``) get the rows in a
    random order with all items of a row kept together, so a minibatch holds whole
    slices and each slice is encoded once; other heads get a random item order.
    """
    import torch

    if not head.shares_body:
        return torch.randperm(len(t), generator=gen).numpy()
    uniq, inv = np.unique(t.rows, return_inverse=True)
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[torch.randperm(uniq.size, generator=gen).numpy()] = np.arange(uniq.size)
    return np.argsort(rank[inv.reshape(-1)], kind="stable")


def predict(head: Head, feats: np.ndarray, t: Targets, batch_size: int = 512) -> np.ndarray:
    """Predictions of ``head`` on the items of ``t``, decoded by the probe spec.

    Level 1: ``(N, 16, 2)`` normalised coordinates; Level 2: ``(N, 16)`` slots decoded
    with the Hungarian algorithm over present tiles; Level 3: ``(N,)`` class indices.
    """
    import torch

    head.eval()
    outs = []
    order = eval_order(head, t)
    with torch.no_grad():
        for s in range(0, len(t), batch_size):
            idx = order[s : s + batch_size]
            outs.append(_run(head, feats, t, idx)[0].float().cpu().numpy())
    if not outs:
        return t.spec.empty_prediction()
    out = np.empty_like(np.concatenate(outs))
    out[order] = np.concatenate(outs)
    return t.spec.decode(out, t)


def mean_loss(head: Head, spec, feats, t: Targets, cfg: TrainConfig) -> float:
    """The mean training loss of ``head`` on the items of ``t`` (evaluation mode, no gradient)."""
    import torch

    head.eval()
    total, n = 0.0, 0
    order = eval_order(head, t)
    with torch.no_grad():
        for s in range(0, len(t), 512):
            idx = order[s : s + 512]
            out, y = _run(head, feats, t, idx)
            total += float(spec.loss_value(out, y, cfg.sinkhorn_iters)) * idx.size
            n += idx.size
    return total / max(n, 1)


def train_head(
    head: Head,
    train: tuple[np.ndarray, Targets],
    val: tuple[np.ndarray, Targets],
    cfg: TrainConfig,
    seed: int,
    progress: bool = False,
) -> TrainResult:
    """Train ``head`` in place on ``train`` = (features, targets), early-stopping on ``val``.

    ``features`` are the arrays the head reads (pooled ``(R, D)`` or already
    pre-projected tokens ``(R, T, k)``), indexed by ``targets.rows``. The head's
    parameters must already be initialised (see :func:`seeded`); the weights of the
    best validation epoch are restored at the end.
    """
    import torch
    from tqdm.auto import tqdm

    feats, tr = train
    vfeats, va = val
    if len(tr) == 0:
        raise ValueError(f"no training items for {tr.spec.name}")
    spec = tr.spec
    head.to(cfg.device)
    epochs = cfg.epochs_for(head.input_kind)
    # foreach: one call over all parameters (torch's CPU default loops over them in Python,
    # about 1.5x slower per step for a transformer head's 56 tensors; the same update, bit for bit)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
    gen = torch.Generator().manual_seed(int(seed))
    best = (math.inf, 0, copy.deepcopy(head.state_dict()))
    hist_tr: list[float] = []
    hist_va: list[float] = []
    bar = tqdm(range(epochs), desc=f"{spec.name}", leave=False, disable=not progress)
    with torch.random.fork_rng(devices=[]), deterministic():
        torch.manual_seed(int(seed))
        for epoch in bar:
            head.train()
            order = epoch_order(head, tr, gen)
            total = 0.0
            for s in range(0, len(tr), cfg.batch_size):
                check_stop()  # a SIGTERM whose SystemExit a finalizer swallowed
                idx = np.sort(order[s : s + cfg.batch_size])
                out, y = _run(head, feats, tr, idx)
                loss = spec.loss_value(out, y, cfg.sinkhorn_iters)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
                opt.step()
                total += float(loss.detach()) * idx.size
            hist_tr.append(total / len(tr))
            vl = mean_loss(head, spec, vfeats, va, cfg) if len(va) else hist_tr[-1]
            hist_va.append(vl)
            bar.set_postfix(train=f"{hist_tr[-1]:.4f}", val=f"{vl:.4f}")
            if vl < best[0] - 1e-6:
                best = (vl, epoch, copy.deepcopy(head.state_dict()))
            elif epoch - best[1] >= cfg.patience:
                break
    head.load_state_dict(best[2])
    return TrainResult(len(hist_tr), best[1], float(best[0]), hist_tr, hist_va)


def seeded(factory, seed: int):
    """Call ``factory()`` (e.g. building a head) with torch's RNG seeded, state restored after."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return factory()


class deterministic:
    """Context manager: ``torch.use_deterministic_algorithms(True)``, restored on exit."""

    def __enter__(self):
        import torch

        self.prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)

    def __exit__(self, *exc):
        import torch

        torch.use_deterministic_algorithms(self.prev)
