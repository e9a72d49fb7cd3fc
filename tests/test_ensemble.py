"""Batched (ensemble) training against training each run alone: the same start, the same
metrics in distribution, each member's own early stopping, learning rate and weight decay."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.probes.ensemble import StackedAdamW, clip_per_member, train_heads
from spar_bench.probes.heads import build_head
from spar_bench.probes.targets import Targets
from spar_bench.probes.tasks import get_probe
from spar_bench.probes.train import TrainConfig, predict, seeded, train_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def relative_position(n_slices: int, seed: int, tokens: bool):
    """Slices with 16 organs at random x; questions "is A left of B" (answer 1 if x_a < x_b).

    Pooled features are the 16 x positions; tokens are one per organ, one-hot identity + x.
    """
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (n_slices, 16)).astype(np.float32)
    if tokens:
        feats = np.concatenate([np.broadcast_to(np.eye(16, dtype=np.float32), (n_slices, 16, 16)),
                                x[..., None]], axis=-1).copy()  # fmt: skip
    else:
        feats = x
    per = 6
    rows = np.repeat(np.arange(n_slices), per)
    a, b = rng.integers(0, 16, rows.size), rng.integers(0, 16, rows.size)
    b = np.where(a == b, (b + 1) % 16, b)
    answer = (x[rows, a] < x[rows, b]).astype(np.int64)
    y = {"answer": answer, "organ_a": a, "organ_b": b, "axis": np.ones(rows.size, np.int64),
         "probe": np.zeros(rows.size, np.int64)}  # fmt: skip
    patient = (rows // 4).astype(str)
    t = Targets(get_probe("level3.relative_position"), "train", rows, patient, np.zeros(rows.size, bool), y)
    return feats, t


def _accuracy(head, feats, t) -> float:
    return float(np.mean(predict(head, feats, t) == t.y["answer"]))


def _head(name: str, feats: np.ndarray, seed: int, **cfg):
    n_tokens = feats.shape[1] if feats.ndim == 3 else 1
    return seeded(lambda: build_head(name, "level3.relative_position", feats.shape[-1], n_tokens, **cfg), seed)


def test_stacked_adamw_and_clip_equal_torch_per_member():
    import torch

    torch.manual_seed(0)
    w = [torch.randn(5, 3, requires_grad=True) for _ in range(3)]
    stacked = {"w": torch.stack([v.detach() for v in w]).requires_grad_()}
    lrs, wds = [1e-3, 3e-3, 1e-2], [0.0, 0.01, 0.1]
    opts = [torch.optim.AdamW([v], lr=lr, weight_decay=wd) for v, lr, wd in zip(w, lrs, wds, strict=True)]
    sopt = StackedAdamW(stacked, lrs, wds)
    for step in range(4):
        grads = torch.randn(3, 5, 3) * (10.0 if step == 0 else 0.1)
        for m, (v, o) in enumerate(zip(w, opts, strict=True)):
            v.grad = grads[m].clone()
            torch.nn.utils.clip_grad_norm_([v], 1.0)
            o.step()
        stacked["w"].grad = grads.clone()
        clip_per_member(stacked, 1.0)
        sopt.step()
    for m in range(3):
        torch.testing.assert_close(stacked["w"][m].detach(), w[m].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,tokens", [("mlp", False), ("transformer", True)])
def test_first_epoch_matches_alone_without_dropout(name, tokens):
    """With dropout off, one epoch of a member equals one epoch of its run alone (float rounding)."""
    import torch

    feats, t = relative_position(40, 0, tokens)
    cfg = TrainConfig(max_epochs=1, batch_size=32)
    seeds = [0, 1, 2]
    alone = [_head(name, feats, s, dropout=0.0) for s in seeds]
    for h, s in zip(alone, seeds, strict=True):
        train_head(h, (feats, t), (feats, t.subset(np.arange(0))), cfg, s)
    batched = [_head(name, feats, s, dropout=0.0) for s in seeds]
    train_heads(batched, ([feats] * 3, t), ([feats] * 3, t.subset(np.arange(0))), [cfg] * 3, seeds)
    for a, b in zip(alone, batched, strict=True):
        for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            torch.testing.assert_close(va, vb, rtol=1e-3, atol=1e-4, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name,tokens", [("mlp", False), ("transformer", True)])
def test_members_agree_with_alone_in_distribution(name, tokens):
    """Five seeds trained alone and batched reach the same accuracy distribution, well above chance.

    Members are not bit-identical to their alone runs (see spar_bench.probes.ensemble), so the
    test compares the two samples of five: their means within twice the seed spread (at least
    2 points). Measured (transformer, loaded machine): alone .87 .90 .88 .62 .68, batched .53
    .88 .90 .68 .82 - some seeds of both kinds take off late, as they do alone.
    """
    feats, t = relative_position(300, 0, tokens)
    vfeats, va = relative_position(60, 1, tokens)
    tfeats, te = relative_position(80, 2, tokens)
    cfg = TrainConfig(max_epochs=40, patience=5, batch_size=128, lr=3e-3)
    small = {"d_model": 32, "n_heads": 2} if tokens else {}
    seeds = [0, 1, 2, 3, 4]
    alone = []
    for s in seeds:
        h = _head(name, feats, s, **small)
        train_head(h, (feats, t), (vfeats, va), cfg, s)
        alone.append(_accuracy(h, tfeats, te))
    heads = [_head(name, feats, s, **small) for s in seeds]
    results = train_heads(heads, ([feats] * 5, t), ([vfeats] * 5, va), [cfg] * 5, seeds)
    batched = [_accuracy(h, tfeats, te) for h in heads]
    assert np.mean(alone) > 0.65 and np.mean(batched) > 0.65, (alone, batched)  # learned (chance 0.5)
    spread = max(np.std(alone), np.std(batched), 0.02)
    assert abs(np.mean(alone) - np.mean(batched)) <= 2 * spread, (alone, batched)
    assert all(r.best_epoch < r.epochs_run for r in results)


@pytest.mark.slow
def test_each_member_stops_on_its_own_and_keeps_its_best_epoch():
    """A member with a far too high learning rate stops early; the others go on; each
    restores the weights of its own best validation epoch."""
    feats, t = relative_position(200, 0, False)
    vfeats, va = relative_position(40, 1, False)
    good = TrainConfig(max_epochs=30, patience=4, batch_size=64, lr=3e-3)
    bad = TrainConfig(max_epochs=30, patience=4, batch_size=64, lr=50.0)
    heads = [_head("mlp", feats, 0), _head("mlp", feats, 0)]
    res = train_heads(heads, ([feats] * 2, t), ([vfeats] * 2, va), [good, bad], [0, 0])
    assert res[0].epochs_run != res[1].epochs_run  # each stopped on its own validation losses
    for h, r in zip(heads, res, strict=True):
        assert r.epochs_run == 30 or r.epochs_run - 1 - r.best_epoch == 4  # patience 4
        assert r.best_val_loss == min(r.val_loss)
        from spar_bench.probes.train import mean_loss

        assert mean_loss(h, t.spec, vfeats, va, good) == pytest.approx(r.best_val_loss, rel=1e-4)
    assert _accuracy(heads[0], vfeats, va) > _accuracy(heads[1], vfeats, va)


def test_members_may_differ_in_lr_and_weight_decay_only():
    from spar_bench.errors import ConfigError

    feats, t = relative_position(20, 0, False)
    heads = [_head("mlp", feats, 0), _head("mlp", feats, 1)]
    with pytest.raises(ConfigError, match="differ in seed, lr and weight decay only"):
        train_heads(heads, ([feats] * 2, t), ([feats] * 2, t), [TrainConfig(), TrainConfig(batch_size=8)], [0, 1])


@pytest.mark.slow
def test_sweep_batch_runs_writes_the_same_run_folders_and_records_the_batch(pipeline, tmp_path):
    """``sweep --batch-runs on``: seeds x lr of one probe x head train as one batch; every run
    writes the folder a single run would, and records the runs it was trained with."""
    import json

    from spar_bench.probes.cli import cli

    from helpers import run_cmd

    def sweep(out, mode):
        args = ["sweep", "--features", pipeline["cache"], "--heads", "mlp,transformer", "--probes",
                "level1.localisation,level3.relative_position", "--seeds", "0,1", "--grid", "lr=1e-3,3e-3",
                "--max-epochs", 2, "--d-model", 32, "--bootstrap", 20, "--jobs", 1, "--batch-runs", mode,
                "--out", out]  # fmt: skip
        assert run_cmd(cli, args) == 0
        return sorted(p.parent.relative_to(out).as_posix() for p in out.rglob("metrics.json"))

    batched, single = sweep(tmp_path / "b", "on"), sweep(tmp_path / "s", "off")
    assert batched == single and len(batched) == 16
    for rel in batched:
        m = json.loads((tmp_path / "b" / rel / "metrics.json").read_text())
        assert rel in m["batch"]["runs"] and len(m["batch"]["runs"]) == 4, m["batch"]
        assert m["controls"]["blind"]["n"] == m["test"]["n"]
        assert "batch" not in json.loads((tmp_path / "s" / rel / "metrics.json").read_text())


@pytest.mark.slow
def test_a_stopped_member_leaves_the_stack():
    """Once a member stops, later epochs compute only the others (the stack shrinks); the
    stopped member keeps its own best weights and history, and the result is deterministic."""
    import torch

    feats, t = relative_position(200, 0, False)
    vfeats, va = relative_position(40, 1, False)
    good = TrainConfig(max_epochs=20, patience=3, batch_size=64, lr=3e-3)
    bad = TrainConfig(max_epochs=20, patience=3, batch_size=64, lr=50.0)

    def run():
        heads = [_head("mlp", feats, 0), _head("mlp", feats, 1)]
        seen: list[list[int]] = []
        res = train_heads(heads, ([feats] * 2, t), ([vfeats] * 2, va), [good, bad], [0, 1],
                          on_epoch=lambda epoch, members: seen.append(members))  # fmt: skip
        return heads, res, seen

    heads, res, seen = run()
    assert res[1].epochs_run < res[0].epochs_run, res
    assert seen[: res[1].epochs_run] == [[0, 1]] * res[1].epochs_run  # both computed until it stops
    assert seen[res[1].epochs_run :] == [[0]] * (res[0].epochs_run - res[1].epochs_run)  # then only 0
    assert len(res[1].val_loss) == res[1].epochs_run and res[1].best_val_loss == min(res[1].val_loss)
    again, res2, _ = run()
    assert [r.val_loss for r in res] == [r.val_loss for r in res2]
    for a, b in zip(heads, again, strict=True):
        for va_, vb in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
            assert torch.equal(va_, vb)


@pytest.mark.slow
def test_prune_keeps_each_seeds_best_grid_point_after_epoch_k():
    """``Prune(at=K)``: after epoch K only the grid point of each seed with the lowest validation
    loss so far trains on; the others stop there, recorded as pruned at K."""
    from spar_bench.probes.ensemble import Prune

    feats, t = relative_position(200, 0, False)
    vfeats, va = relative_position(40, 1, False)
    cfgs = [TrainConfig(max_epochs=12, patience=50, batch_size=64, lr=lr) for lr in (3e-3, 1e-5, 3e-3, 1e-5)]
    seeds = [0, 0, 1, 1]
    heads = [_head("mlp", feats, s) for s in seeds]
    seen: list[list[int]] = []
    res = train_heads(heads, ([feats] * 4, t), ([vfeats] * 4, va), cfgs, seeds,
                      prune=Prune(2, tuple(seeds)), on_epoch=lambda e, m: seen.append(m))  # fmt: skip
    assert [r.pruned_at for r in res] == [None, 2, None, 2]
    assert [r.epochs_run for r in res] == [12, 2, 12, 2]
    assert seen[:2] == [[0, 1, 2, 3]] * 2 and seen[2:] == [[0, 2]] * 10
    for w, loser in ((0, 1), (2, 3)):  # the survivor had the lower validation loss at epoch 2
        assert min(res[w].val_loss[:2]) < min(res[loser].val_loss[:2])
    assert res[1].pruned["pruned_at"] == 2 and res[0].pruned == {}


def test_stopped_by_tells_early_stopping_from_the_epoch_cap_and_pruning():
    from spar_bench.probes.ensemble import MemberResult
    from spar_bench.probes.train import TrainResult

    assert TrainResult(20, 11, 0.5, [], []).stopped_by(8) == "early_stopping"  # 8 epochs without a better loss
    assert TrainResult(40, 39, 0.5, [], []).stopped_by(8) == "max_epochs"  # still improving at the cap
    assert TrainResult(40, 32, 0.5, [], []).stopped_by(8) == "max_epochs"  # improved 7 epochs before the end
    assert MemberResult(2, 1, 0.5, [], [], pruned_at=2).stopped_by(8) == "grid_prune"
