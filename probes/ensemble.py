"""Batched training: the members of one probe x head trained together as one stacked model.

Members are heads of one architecture on one probe, differing in their seed and, for a
``--grid`` over them, their learning rate and weight decay. :func:`train_heads` stacks
their parameters (``torch.func.stack_module_state``) and runs ONE vmapped forward and
backward per step for all of them. Each member keeps what training it alone gives it:

* its own initialisation (the caller builds each head with its seed, as for one run);
* its own data order (a ``torch.Generator`` seeded with its seed, as :func:`train_head`);
* its own features (token heads: its own seeded PCA projection);
* its own AdamW state, learning rate and weight decay, and its own gradient clipping;
* its own early stopping: its best validation epoch's weights are restored, whatever
  the other members do; training ends when every member has stopped.

A member that stops leaves the stack: its parameters, buffers, AdamW state, learning
rate, weight decay, generator and features are dropped from the stacked tensors, so
later epochs compute only the members still training (on the CPU, where arithmetic is
the cost, a stopped member costs nothing more). Its best weights and its loss history
are kept. The stack's composition is a function of the inputs, so results stay
deterministic.

Successive halving (:class:`Prune`, ``spar-probe sweep --grid-prune K``): after epoch K
each seed's grid points (members differing in lr / weight decay) keep only the one with
the lowest validation loss so far; the others stop there, recorded as pruned.

Why: a head's step on a GPU is bound by kernel launches, not arithmetic, so S members
cost about what one does. On the CPU a head's step is bound by its arithmetic and
batching gains nothing (``bench/heads.py`` measures it), so ``spar-probe sweep`` batches
only on a GPU unless asked (``--batch-runs``).

Equivalence: a member is NOT bit-identical to training its seed alone. Stacked matmuls
round differently and dropout masks come from one shared random stream, so trajectories
part after the first steps. Its metrics agree with single-run training IN DISTRIBUTION;
``tests/test_ensemble.py`` trains seeds both ways and checks it, and checks that a
member's first step equals its alone run's to float rounding.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from tqdm.auto import tqdm

from spar_bench.errors import ConfigError
from spar_bench.procs import check_stop

from .targets import Targets
from .train import (
    TrainConfig,
    TrainResult,
    batch_tensors,
    deterministic,
    epoch_order,
    eval_order,
    group_batch,
    is_grouped,
    to_device,
)

BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW defaults, as train_head uses


def without_lr_wd(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with what members may hold apart (learning rate, weight decay) set to fixed values."""
    return replace(cfg, lr=1.0, weight_decay=0.0)


def check_batchable(cfgs: list[TrainConfig]) -> None:
    """Members may differ in ``lr`` and ``weight_decay`` only."""

    if len({without_lr_wd(c) for c in cfgs}) != 1:
        raise ConfigError("runs trained as one batch may differ in seed, lr and weight decay only")


class StackedAdamW:
    """AdamW (torch's defaults, decoupled weight decay) on stacked parameters ``(S, ...)``,
    with a learning rate and a weight decay per member."""

    def __init__(self, params: dict, lr: list[float], weight_decay: list[float]):
        import torch

        self.params = params
        dev = next(iter(params.values())).device
        self.lr = torch.tensor(lr, dtype=torch.float32, device=dev)
        self.wd = torch.tensor(weight_decay, dtype=torch.float32, device=dev)
        self.m = {k: torch.zeros_like(p) for k, p in params.items()}
        self.v = {k: torch.zeros_like(p) for k, p in params.items()}
        self.t = 0

    def _per_member(self, x, like):
        return x.view(-1, *([1] * (like.dim() - 1)))

    def step(self) -> None:
        import torch

        self.t += 1
        c1, c2 = 1 - BETAS[0] ** self.t, 1 - BETAS[1] ** self.t
        with torch.no_grad():
            for k, p in self.params.items():
                if p.grad is None:
                    continue
                g, lr = p.grad, self._per_member(self.lr, p)
                p.mul_(1 - lr * self._per_member(self.wd, p))
                self.m[k].lerp_(g, 1 - BETAS[0])
                self.v[k].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                denom = (self.v[k].sqrt() / math.sqrt(c2)).add_(EPS)
                p.addcdiv_(self.m[k] * (lr / c1), denom, value=-1.0)


def clip_per_member(params: dict, max_norm: float) -> None:
    """``clip_grad_norm_`` applied to each member's gradients on its own."""
    import torch

    grads = [p.grad for p in params.values() if p.grad is not None]
    if not grads or not max_norm:
        return
    s = grads[0].shape[0]
    norm = torch.sqrt(sum(g.reshape(s, -1).pow(2).sum(1) for g in grads))
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _stacked_batch(feats: list[np.ndarray], t: Targets, idxs: list[np.ndarray], grouped: bool):
    """``(x, q, index, ys)`` for one step: member m's items ``idxs[m]`` read from ``feats[m]``.

    Grouped (Level 3 token) heads get each member's distinct rows padded with zero rows
    to one width; ``index`` only ever points at real rows.
    """
    import torch

    if not grouped:
        parts = [batch_tensors(f, t, i) for f, i in zip(feats, idxs, strict=True)]
        x = torch.stack([p[0] for p in parts])
        qs, ys, index = [p[1] for p in parts], [p[2] for p in parts], None
    else:
        parts = [group_batch(f, t, i) for f, i in zip(feats, idxs, strict=True)]
        u = max(p[0].shape[0] for p in parts)
        x = torch.stack([torch.cat([p[0], p[0].new_zeros((u - p[0].shape[0], *p[0].shape[1:]))]) for p in parts])
        index = torch.stack([p[1] for p in parts])
        qs, ys = [p[2] for p in parts], [p[3] for p in parts]
    q = None if qs[0] is None else {k: torch.stack([d[k] for d in qs]) for k in qs[0]}
    return x, q, index, ys


def _forward(base, grouped: bool):
    """The vmapped forward of ``base`` over stacked parameters and stacked inputs (None stays None)."""
    from torch.func import functional_call, vmap

    def one(p, b, x, q, index):
        return functional_call(base, (p, b), (x, q, index) if grouped else (x, q))

    def call(params, buffers, x, q, index):
        dims = tuple(None if v is None else 0 for v in (x, q, index))
        return vmap(one, in_dims=(0, 0, *dims), randomness="different")(params, buffers, x, q, index)

    return call


def _val_losses(base, params, buffers, feats: list[np.ndarray], t: Targets, cfg: TrainConfig) -> list[float]:
    """Each member's mean validation loss (items in :func:`~.train.eval_order`, 512 at a time)."""
    import torch

    s, dev = len(feats), next(iter(params.values())).device
    grouped = is_grouped(base, t)
    fwd = _forward(base, grouped)
    total, n = torch.zeros(s, dtype=torch.float64), 0
    order = eval_order(base, t)
    base.eval()
    with torch.no_grad():
        for start in range(0, len(t), 512):
            idx = order[start : start + 512]
            x, q, index, ys = _stacked_batch(feats, t, [idx] * s, grouped)
            out = fwd(params, buffers, *(to_device(dev, v) for v in (x, q, index)))
            for m in range(s):
                y = to_device(dev, ys[m])
                total[m] += float(t.spec.loss_value(out[m], y, cfg.sinkhorn_iters)) * idx.size
            n += idx.size
    return (total / max(n, 1)).tolist()


@dataclass
class MemberResult(TrainResult):
    """A member's :class:`TrainResult`, and the epoch after which a :class:`Prune` stopped it."""

    pruned_at: int | None = None

    def stopped_by(self, patience: int) -> str:
        return "grid_prune" if self.pruned_at is not None else super().stopped_by(patience)

    @property
    def pruned(self) -> dict:
        """What ``metrics.json`` records under ``train`` for a pruned run (nothing otherwise)."""
        if self.pruned_at is None:
            return {}
        return {"pruned_at": self.pruned_at,
                "pruned_reason": f"successive halving: another grid point of its seed had a lower "
                                 f"validation loss after epoch {self.pruned_at}"}  # fmt: skip


@dataclass(frozen=True)
class Prune:
    """Successive halving of a grid (``sweep --grid-prune``): after epoch ``at`` (counting
    from 1), in each group of members (``groups[m]``: its seed), only the member with the
    lowest validation loss so far trains on (ties: the first). ``losers`` names the members
    to prune instead of choosing (the blind baselines follow their real heads)."""

    at: int
    groups: tuple
    losers: tuple[bool, ...] | None = None

    def losers_of(self, best_losses: list[float]) -> list[bool]:
        if self.losers is not None:
            return list(self.losers)
        winner: dict = {}
        for m, g in enumerate(self.groups):
            if g not in winner or best_losses[m] < best_losses[winner[g]]:
                winner[g] = m
        return [winner[g] != m for m, g in enumerate(self.groups)]


def train_heads(heads: list, train: tuple[list[np.ndarray], Targets], val: tuple[list[np.ndarray], Targets],
                cfgs: list[TrainConfig], seeds: list[int], progress: bool = False, prune: Prune | None = None,
                on_epoch: Callable[[int, list[int]], None] | None = None) -> list[MemberResult]:  # fmt: skip
    """Train ``heads`` (one architecture) in place as one batch; one :class:`MemberResult` each.

    ``train`` / ``val`` hold one feature array per member (what :func:`train_head` takes
    for one) and the targets all members share. Each head ends with the weights of its
    own best validation epoch. A member that stops (early stopping, ``prune``) leaves the
    stack; ``on_epoch(epoch, members)`` is told which members each epoch computes.
    """
    import torch
    from torch.func import stack_module_state

    check_batchable(cfgs)
    (feats, tr), (vfeats, va), cfg, s = train, val, cfgs[0], len(heads)
    if len(tr) == 0:
        raise ValueError(f"no training items for {tr.spec.name}")
    for h in heads:
        h.to(cfg.device)
    params, buffers = stack_module_state(heads)
    base = copy.deepcopy(heads[0]).to("meta")
    fwd = _forward(base, is_grouped(base, tr))
    opt = StackedAdamW(params, [c.lr for c in cfgs], [c.weight_decay for c in cfgs])
    st = _Active(list(range(s)), list(feats), list(vfeats), [torch.Generator().manual_seed(int(sd)) for sd in seeds])
    best: list[tuple] = [(math.inf, 0, None)] * s
    stopped, pruned = [False] * s, [None] * s
    hist: list[tuple[list[float], list[float]]] = [([], []) for _ in range(s)]
    epochs = cfg.epochs_for(base.input_kind)
    bar = tqdm(range(epochs), desc=f"{tr.spec.name} x{s}", leave=False, disable=not progress)
    with torch.random.fork_rng(devices=[]), deterministic():
        torch.manual_seed(int(seeds[0]))
        for epoch in bar:
            if on_epoch is not None:
                on_epoch(epoch, list(st.members))
            losses = _train_epoch(base, fwd, params, buffers, opt, (st.feats, tr), st.gens, cfg)
            vls = _val_losses(base, params, buffers, st.vfeats, va, cfg) if len(va) else losses
            for i, m in enumerate(st.members):
                hist[m][0].append(losses[i])
                hist[m][1].append(vls[i])
                if vls[i] < best[m][0] - 1e-6:
                    best[m] = (vls[i], epoch, _member_state(params, buffers, i))
                elif epoch - best[m][1] >= cfg.patience:
                    stopped[m] = True
            if prune is not None and epoch + 1 == prune.at:
                for m, lose in enumerate(prune.losers_of([b[0] for b in best])):
                    if lose and not stopped[m]:
                        stopped[m], pruned[m] = True, prune.at
            _drop_stopped(st, stopped, best, params, buffers, opt)
            bar.set_postfix(active=len(st.members))
            if not st.members:
                break
    results = []
    for m, h in enumerate(heads):
        final = _member_state(params, buffers, st.members.index(m)) if m in st.members else None
        h.load_state_dict(best[m][2] if best[m][2] is not None else final)
        results.append(MemberResult(len(hist[m][0]), best[m][1], float(best[m][0]), *hist[m], pruned[m]))
    return results


@dataclass
class _Active:
    """The members still training (their indices in ``heads``), in stack order, with their
    training features, validation features and data-order generators."""

    members: list[int]
    feats: list
    vfeats: list
    gens: list


def _drop_stopped(st: _Active, stopped: list[bool], best: list, params: dict, buffers: dict, opt) -> None:
    """Remove the stopped members from the stack (parameters, buffers, optimizer state, generators,
    features), so later epochs compute only the members still training."""
    import torch

    keep = [i for i, m in enumerate(st.members) if not stopped[m]]
    if len(keep) == len(st.members):
        return
    for i, m in enumerate(st.members):
        if stopped[m] and best[m][2] is None:  # never improved on inf: it ends with its last weights
            best[m] = (best[m][0], best[m][1], _member_state(params, buffers, i))
    idx = torch.tensor(keep, dtype=torch.long, device=opt.lr.device)
    for d in (params, buffers, opt.m, opt.v):
        for k, v in list(d.items()):
            d[k] = v.detach().index_select(0, idx).requires_grad_(v.requires_grad)
    opt.lr, opt.wd = opt.lr[idx], opt.wd[idx]
    for name in ("members", "feats", "vfeats", "gens"):
        setattr(st, name, [getattr(st, name)[i] for i in keep])


def _member_state(params: dict, buffers: dict, m: int) -> dict:
    return {k: v[m].detach().clone() for k, v in {**params, **buffers}.items()}


def _train_epoch(base, fwd, params, buffers, opt, train, gens, cfg: TrainConfig) -> list[float]:
    """One epoch of every member (each in its own seeded order); each member's mean loss."""
    import torch

    feats, tr = train
    s, dev = len(gens), next(iter(params.values())).device
    grouped = is_grouped(base, tr)
    orders = [epoch_order(base, tr, g) for g in gens]
    totals = np.zeros(s)
    base.train()
    for start in range(0, len(tr), cfg.batch_size):
        check_stop()  # a SIGTERM whose SystemExit a finalizer swallowed
        idxs = [np.sort(o[start : start + cfg.batch_size]) for o in orders]
        x, q, index, ys = _stacked_batch(feats, tr, idxs, grouped)
        out = fwd(params, buffers, *(to_device(dev, v) for v in (x, q, index)))
        per = [tr.spec.loss_value(out[m], to_device(dev, ys[m]), cfg.sinkhorn_iters) for m in range(s)]
        for p in params.values():
            p.grad = None
        torch.stack(per).sum().backward()
        clip_per_member(params, cfg.grad_clip)
        opt.step()
        totals += np.array([float(v.detach()) for v in per]) * idxs[0].size
    return (totals / len(tr)).tolist()


# --------------------------------------------------------------------------- runs trained as one batch
def batch_key(run):
    """Runs with equal keys may be trained as one batch: they differ in seed, lr and weight decay only."""
    return run.replace(seed=0, train=without_lr_wd(run.train))
