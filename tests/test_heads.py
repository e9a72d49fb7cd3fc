"""Heads: registry, shapes, determinism, and a 'control works' check on a learnable Level 2."""

from __future__ import annotations

import numpy as np
import pytest

from spar_bench.errors import ConfigError
from spar_bench.probes.heads import HEADS, build_head, head_input
from spar_bench.probes.targets import Targets
from spar_bench.probes.tasks import get_probe
from spar_bench.probes.train import TrainConfig, predict, seeded, train_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _question(n: int, rng: np.random.Generator) -> dict:
    return {
        "organ_a": rng.integers(0, 16, n),
        "organ_b": rng.integers(0, 16, n),
        "axis": np.zeros(n, np.int64),
        "probe": np.zeros(n, np.int64),
    }


def synthetic_level2(n: int, n_present: int, seed: int):
    """Tokens that encode each tile's slot (one-hot) at the tile's own position.

    The pooled vector (mean of tokens) is the same for every sample, so a pooled head
    cannot beat chance, while a head reading tokens can solve it exactly.
    """
    rng = np.random.default_rng(seed)
    present = np.zeros((n, 16), bool)
    slot = np.full((n, 16), -1, np.int64)
    tokens = rng.normal(0, 0.05, (n, 16, 24)).astype(np.float32)
    for i in range(n):
        pos = rng.choice(16, n_present, replace=False)
        present[i, pos] = True
        slot[i, pos] = rng.permutation(n_present)
        tokens[i, pos, slot[i, pos]] += 1.0
        tokens[i, pos, 16] += 1.0
    pooled = tokens.mean(axis=1)
    t = Targets(
        get_probe("level2.arrangement"),
        "train",
        np.arange(n),
        np.repeat(np.arange(n // 10), 10).astype(str),
        np.zeros(n, bool),
        {"target_slot": slot, "present_pos": present},
    )
    return tokens, pooled, t


def test_registry_names_and_errors():
    assert {"linear", "mlp", "attnpool", "coordpool", "transformer"} <= set(HEADS.names())
    assert head_input("mlp") == "pooled" and head_input("transformer") == "tokens"
    with pytest.raises(ConfigError, match="did you mean|Did you mean"):
        build_head("transfomer", get_probe("level2.arrangement"), 8)
    with pytest.raises(ConfigError, match="no option"):
        build_head("mlp", get_probe("level2.arrangement"), 8, widht=3)
    with pytest.raises(ConfigError, match="unknown probe"):
        get_probe("level3.colour")


@pytest.mark.parametrize("name", ["linear", "mlp", "attnpool", "coordpool", "transformer"])
@pytest.mark.parametrize(
    "probe,shape",
    [
        ("level1.localisation", (3, 16, 2)),
        ("level2.arrangement", (3, 16, 16)),
        ("level3.symmetry", (3, 3)),
    ],
)
def test_output_shapes(name, probe, shape):
    import torch

    head = build_head(name, get_probe(probe), 20, 9)
    x = torch.randn(3, 20) if head.input_kind == "pooled" else torch.randn(3, 9, 20)
    q = {k: torch.as_tensor(v) for k, v in _question(3, np.random.default_rng(0)).items()}
    q["organ_b"][0] = -1  # "none"
    assert tuple(head(x, q).shape) == shape


def test_token_projection_is_fixed_pca_and_saved_in_state_dict():
    head = build_head("transformer", get_probe("level1.localisation"), 32, 5, proj_dim=8)
    rng = np.random.default_rng(0)
    sample = rng.normal(size=(400, 32)) @ rng.normal(size=(32, 32))
    head.fit_projection(sample)
    out = head.preproject(sample.reshape(80, 5, 32))
    assert out.shape == (80, 5, 8)
    np.testing.assert_allclose(out.reshape(-1, 8).std(axis=0), 1.0, rtol=1e-2)
    assert "proj_w" in head.state_dict()


def test_a_projection_fitted_on_the_same_sample_is_kept_in_the_process(monkeypatch):
    """A second head fitted on the same sample (a sweep's token heads on one level) gets the
    same buffers without fitting again; another sample, width or dtype is fitted anew."""
    import torch

    from spar_bench.probes.heads import base

    monkeypatch.setattr(base, "PROJECTIONS", {})
    fits = []
    real = base.TokenHead._fitted_projection
    monkeypatch.setattr(base.TokenHead, "_fitted_projection", lambda self, t: fits.append(t.shape) or real(self, t))
    rng = np.random.default_rng(0)
    sample = (rng.normal(size=(400, 32)) @ rng.normal(size=(32, 32))).astype(np.float32)
    heads = [build_head("transformer", get_probe("level3.size"), 32, 5, proj_dim=8) for _ in range(2)]
    for h in heads:
        h.fit_projection(sample)
    assert len(fits) == 1
    a, b = heads[0].state_dict(), heads[1].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in ("proj_mean", "proj_w", "proj_scale"))
    heads[0].proj_w.mul_(2)  # a head's buffers are its own
    monkeypatch.setattr(base, "PROJECTIONS", {})
    fresh = build_head("transformer", get_probe("level3.size"), 32, 5, proj_dim=8)
    fresh.fit_projection(sample)
    assert torch.equal(fresh.proj_w, b["proj_w"])  # the kept fit is the fit
    for other in (sample[:200], sample.astype(np.float64)):
        fresh.fit_projection(other)
    build_head("transformer", get_probe("level3.size"), 32, 5, proj_dim=4).fit_projection(sample)
    assert len(fits) == 5


def _fit(name, feats, t, seed, epochs=30):
    head = seeded(
        lambda: build_head(name, t.spec, feats.shape[-1], feats.shape[1] if feats.ndim == 3 else 1),
        seed,
    )
    cfg = TrainConfig(max_epochs=epochs, batch_size=64, lr=3e-3, patience=100)
    n = len(t)
    tr, va = t.subset(np.arange(n) < n * 0.8), t.subset(np.arange(n) >= n * 0.8)
    train_head(head, (feats, tr), (feats, va), cfg, seed)
    return head, predict(head, feats, va), va


def test_same_seed_same_predictions_different_seed_differs():
    tokens, pooled, t = synthetic_level2(200, 5, 0)
    _, p1, _ = _fit("mlp", pooled, t, seed=7, epochs=3)
    _, p2, _ = _fit("mlp", pooled, t, seed=7, epochs=3)
    h3, _, _ = _fit("mlp", pooled, t, seed=8, epochs=3)
    h1, _, _ = _fit("mlp", pooled, t, seed=7, epochs=3)
    np.testing.assert_array_equal(p1, p2)
    w1 = h1.state_dict()["body.0.weight"]
    assert not np.allclose(w1.numpy(), h3.state_dict()["body.0.weight"].numpy())


@pytest.mark.slow
def test_control_works_transformer_beats_pooled_mlp_on_learnable_level2():
    from spar_bench.probes.metrics import level2_metrics

    tokens, pooled, t = synthetic_level2(400, 5, 1)
    _, p_mlp, va = _fit("mlp", pooled, t, seed=0, epochs=20)
    _, p_tr, _ = _fit("transformer", tokens, t, seed=0, epochs=20)
    m_mlp = level2_metrics(p_mlp, va.y["target_slot"], va.y["present_pos"])
    m_tr = level2_metrics(p_tr, va.y["target_slot"], va.y["present_pos"])
    assert m_mlp["tile_acc"] < 0.45  # pooled mean carries no arrangement: ~chance (1/5)
    assert m_tr["tile_acc"] > m_mlp["tile_acc"] + 0.3
    assert m_tr["perm_acc"] > m_mlp["perm_acc"]


@pytest.mark.slow
def test_level1_and_level3_heads_learn_a_simple_signal():
    from spar_bench.probes.metrics import level1_metrics, level3_metrics

    rng = np.random.default_rng(0)
    n = 400
    cent = rng.uniform(0.2, 0.8, (n, 16, 2)).astype(np.float32)
    present = np.ones((n, 16), bool)
    feats = np.concatenate([cent.reshape(n, 32), rng.normal(0, 0.01, (n, 8))], axis=1).astype(
        np.float32
    )
    t1 = Targets(
        get_probe("level1.localisation"),
        "train",
        np.arange(n),
        np.arange(n).astype(str),
        np.zeros(n, bool),
        {"centroid": cent, "present": present, "mm_per_pixel": np.ones(n, np.float32)},
    )
    _, pred, va = _fit("linear", feats, t1, seed=0, epochs=60)
    m = level1_metrics(pred, va.y["centroid"], va.y["present"], va.y["mm_per_pixel"])
    atlas = level1_metrics(
        np.full_like(va.y["centroid"], 0.5), va.y["centroid"], va.y["present"], va.y["mm_per_pixel"]
    )
    assert m["med_px"] < 0.6 * atlas["med_px"]

    # relative position among three organs: is A's column larger than B's?
    x = cent[:, :, 0]
    a = rng.integers(0, 3, n)
    b = (a + rng.integers(1, 3, n)) % 3
    q = {"organ_a": a, "organ_b": b, "axis": np.zeros(n, np.int64), "probe": np.zeros(n, np.int64)}
    answer = (x[np.arange(n), a] > x[np.arange(n), b]).astype(np.int64)
    t3 = Targets(
        get_probe("level3.relative_position"),
        "train",
        np.arange(n),
        np.arange(n).astype(str),
        np.zeros(n, bool),
        {"answer": answer, **q},
    )
    _, pred, va = _fit("mlp", feats, t3, seed=0, epochs=40)
    assert level3_metrics(va.y["answer"], pred, 2)["accuracy"] > 0.8


def _level3_slices(n_slices: int, per_slice: int, n_tokens: int, width: int, seed: int):
    """Random token slices and ``per_slice`` random questions on each (items grouped by row)."""
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n_slices, n_tokens, width)).astype(np.float32)
    n = n_slices * per_slice
    q = _question(n, rng)
    q["organ_b"][::5] = -1  # some questions without organ B
    t = Targets(
        get_probe("level3.relative_position"),
        "test",
        rng.permutation(np.repeat(np.arange(n_slices), per_slice)),
        np.repeat(np.arange(n_slices), per_slice).astype(str),
        np.zeros(n, bool),
        {"answer": rng.integers(0, 2, n), **q},
    )
    return feats, t


def test_level3_transformer_answer_does_not_depend_on_the_other_questions_in_the_batch():
    import torch

    from spar_bench.probes.train import group_batch

    feats, t = _level3_slices(6, 5, 7, 12, seed=0)
    head = seeded(lambda: build_head("transformer", t.spec, 12, 7), 0)
    assert head.shares_body and len(head.body_layers) == 1
    head.eval()
    everything = np.arange(len(t))
    with torch.no_grad():
        x, index, q, _ = group_batch(feats, t, everything)
        assert x.shape[0] == 6 and index.shape == (len(t),)  # each slice encoded once
        full = head(x, q, index).numpy()
        # the same questions one at a time, in another order, and with a slice per item
        perm = np.random.default_rng(1).permutation(len(t))
        for idx in (perm, perm[:7], perm[7:8], everything[::-1]):
            x, index, q, _ = group_batch(feats, t, idx)
            np.testing.assert_allclose(head(x, q, index).numpy(), full[idx], atol=1e-5)
        x_items = torch.from_numpy(feats[t.rows])
        q_all = {k: torch.as_tensor(t.y[k]) for k in ("organ_a", "organ_b", "axis", "probe")}
        np.testing.assert_allclose(head(x_items, q_all).numpy(), full, atol=1e-5)
    # predict: batch size and item order change nothing
    p = predict(head, feats, t)
    np.testing.assert_array_equal(predict(head, feats, t, batch_size=3), p)
    np.testing.assert_array_equal(predict(head, feats, t.subset(perm)), p[perm])
    np.testing.assert_array_equal(p, full.argmax(axis=1))


def test_level3_transformer_trains_on_whole_slices_deterministically():
    import torch

    from spar_bench.probes.train import epoch_order

    feats, t = _level3_slices(12, 4, 5, 10, seed=2)
    head = build_head("transformer", t.spec, 10, 5)
    order = epoch_order(head, t, torch.Generator().manual_seed(0))
    assert sorted(order) == list(range(len(t)))
    runs = np.flatnonzero(np.diff(t.rows[order])).size + 1
    assert runs == 12  # the questions of a slice are consecutive
    _, p1, _ = _fit("transformer", feats, t, seed=3, epochs=2)
    _, p2, _ = _fit("transformer", feats, t, seed=3, epochs=2)
    np.testing.assert_array_equal(p1, p2)


def test_unusable_device_is_a_one_line_error():
    from spar_bench.probes.hardware import pick_device

    with pytest.raises(ConfigError, match="--device must be auto, cpu or cuda"):
        pick_device("tpu")


@pytest.mark.gpu
def test_heads_train_on_cuda_like_on_cpu():
    """A head trained on CUDA learns what it learns on the CPU.

    The two devices draw from different RNG streams and round differently, so single
    runs differ (measured on an H200, dropout 0.1: 0.48-0.87 tile accuracy over seeds on
    either device); compared here: the mean over 3 seeds without dropout
    (measured: CPU 0.73, CUDA 0.79).
    """
    from spar_bench.probes.metrics import level2_metrics

    tokens, _pooled, t = synthetic_level2(400, 5, 1)
    n = len(t)
    tr, va = t.subset(np.arange(n) < n * 0.8), t.subset(np.arange(n) >= n * 0.8)
    acc: dict[str, list[float]] = {"cpu": [], "cuda": []}
    for device in acc:
        for seed in (0, 1, 2):
            head = seeded(
                lambda: build_head("transformer", t.spec, tokens.shape[-1], tokens.shape[1], dropout=0.0),
                seed,
            )
            cfg = TrainConfig(max_epochs=20, batch_size=64, lr=3e-3, patience=100, device=device)
            train_head(head, (tokens, tr), (tokens, va), cfg, seed=seed)
            assert next(head.parameters()).device.type == device
            pred = predict(head, tokens, va)
            acc[device].append(level2_metrics(pred, va.y["target_slot"], va.y["present_pos"])["tile_acc"])
    cpu, cuda = np.mean(acc["cpu"]), np.mean(acc["cuda"])
    assert cuda > 0.6 and abs(cuda - cpu) < 0.15, acc


def test_fast_encoder_layer_is_the_module_function():
    """encoder_layer computes nn.TransformerEncoderLayer's function from its parameters:
    bit-identical in eval mode; in training mode its dropout keeps 1 - p of the entries."""
    import torch

    from spar_bench.probes.heads.transformer import dropout, encoder_layer

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, 0.1, "gelu", batch_first=True, norm_first=True)
    x = torch.randn(5, 7, 32)
    layer.eval()
    with torch.no_grad():
        assert torch.equal(encoder_layer(layer, x), layer(x))
    kept = (dropout(torch.ones(200_000), 0.25, True) != 0).float().mean().item()
    assert abs(kept - 0.75) < 0.01
    assert torch.equal(dropout(x, 0.25, False), x)


def test_coordpool_grid_coordinates_and_where_it_looked():
    import torch

    from spar_bench.probes.heads.coordpool import grid_coordinates

    c = grid_coordinates(5)  # 1 prefix token + a 2 x 2 grid, row-major (row, col)
    assert c.tolist() == [[0, 0], [-0.5, -0.5], [-0.5, 0.5], [0.5, -0.5], [0.5, 0.5]]
    assert grid_coordinates(197).shape == (197, 2) and grid_coordinates(197)[0].abs().sum() == 0
    assert grid_coordinates(9, [1, 2, 2, 2])[1:].abs().max() == 0.5  # (z, row, col) of a 3-D grid
    with pytest.raises(ValueError, match="does not hold"):
        grid_coordinates(10, [0, 2, 2, 2])
    # a head whose keys single out one token reads that token's cell centre: make every query
    # attend to token 7 only (row 1, col 3 of a 4 x 4 grid) and check the coordinates it pools
    head = build_head("coordpool", get_probe("level3.relative_position"), 16, 16, d_model=8, n_heads=2)
    head.eval()
    with torch.no_grad():
        pattern = torch.tensor([1.0, -1.0] * 4)
        head.embed.bias.zero_()  # x = 0: every token is its position embedding
        head.pos.zero_()
        head.pos[7] = pattern  # LayerNorm keeps token 7 at +-1, the others at 0
        head.k_proj.weight.copy_(torch.eye(8))
        head.k_proj.bias.zero_()
        head.q_proj.weight.zero_()
        head.q_proj.bias.copy_(50.0 * pattern)
        seen = {}
        head.where.register_forward_hook(lambda m, i, o: seen.update(where=i[0]))
        x = torch.zeros(1, 16, 16)
        q = {k: torch.zeros(1, dtype=torch.long) for k in ("organ_a", "organ_b", "axis", "probe")}
        head(x, q)
    np.testing.assert_allclose(seen["where"].reshape(2, 2), [[-0.25, 0.75]] * 2, atol=1e-3)


@pytest.mark.slow
def test_coordpool_learns_relative_position_from_content_alone():
    """Tokens say only WHICH organ lies in a cell (one-hot, no position in the content); the
    answer is whether A's cell is left of B's. coordpool reads the columns where it attends."""
    from spar_bench.probes.metrics import level3_metrics

    rng = np.random.default_rng(0)
    n, side, k = 1200, 6, 6
    tokens = rng.normal(0, 0.05, (n, side * side, 16)).astype(np.float32)
    cells = np.stack([rng.choice(side * side, k, replace=False) for _ in range(n)])
    for o in range(k):
        tokens[np.arange(n), cells[:, o], o] += 1.0
    a = rng.integers(0, k, n)
    b = (a + rng.integers(1, k, n)) % k
    col = cells % side
    keep = col[np.arange(n), a] != col[np.arange(n), b]
    answer = (col[np.arange(n), a] > col[np.arange(n), b]).astype(np.int64)
    q = {"organ_a": a, "organ_b": b, "axis": np.zeros(n, np.int64), "probe": np.zeros(n, np.int64)}
    t = Targets(get_probe("level3.relative_position"), "train", np.arange(n), np.arange(n).astype(str),
                np.zeros(n, bool), {"answer": answer, **q}).subset(keep)
    _, pred, va = _fit("coordpool", tokens, t, seed=0, epochs=25)
    assert level3_metrics(va.y["answer"], pred, 2)["accuracy"] > 0.9


@pytest.mark.parametrize("name", ["attnpool", "coordpool", "transformer"])
def test_a_token_head_refuses_another_token_count_and_a_blind_one_reads_one(name):
    """Fewer tokens than a head was built for would shift every position embedding silently;
    the blind baseline's one constant row is the one input of another count, made explicit."""
    import torch

    probe = "level3.relative_position"
    head = build_head(name, probe, 16, 9)
    head.fit_projection(np.random.default_rng(0).normal(size=(64, 16)))
    q = {k: torch.as_tensor(v) for k, v in _question(2, np.random.default_rng(0)).items()}
    x = torch.as_tensor(head.preproject(np.random.default_rng(1).normal(size=(2, 9, 16)).astype(np.float32)))
    assert head(x, q).shape[0] == 2
    for t in (4, 10):
        with pytest.raises(ValueError, match=f"{t} tokens but the head was built for 9"):
            head(x[:, :t] if t < 9 else torch.cat([x, x[:, :1]], 1), q)
    pos = head.pos.detach().clone()
    head.read_one_token()
    assert head.pos.shape == (1, pos.shape[1]) and torch.equal(head.pos.detach(), pos[:1])
    assert head(x[:, :1], q).shape[0] == 2
    with pytest.raises(ValueError, match="built for 1"):
        head(x, q)
