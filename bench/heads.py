"""Benchmark: training probe heads from a feature cache vs re-running the encoder every epoch.

    python bench/heads.py                        # phantom + random-init timm:resnet18 in a temp dir
    python bench/heads.py --work /tmp/b --epochs 20 --encoder timm:resnet18 --jobs 2

Measures, in one run, on the same data (Level 1 train split of a small phantom build):

1. ``cache``    - train an ``mlp`` head for ``--epochs`` epochs from the cached pooled
   features (load included);
2. ``re-encode`` - the same head and epochs, but every batch's images are read from the
   shards and pushed through the frozen encoder again (the usual research script).
   ``--encode-epochs`` epochs are measured and the rest extrapolated linearly (said so);
3. ``sweep``    - a full sweep from one cache: ``--heads`` x all 8 probes x 1 seed, ``--jobs``
   processes, with blind controls (what `spar-probe sweep` does);
4. ``level3``   - seconds per training epoch of the ``transformer`` head on Level 3
   ``relative_position``: questions batched slice by slice with the slice body encoded
   once (what ``train_head`` does) vs the same head re-encoding the slice per question.

Prints seconds and the re-encode / cache ratio. Random-init weights: timing only.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def prepare(
    work: Path, encoder: str, n_cases: int, samples: int
) -> tuple[Path, Path, float | None]:
    """Phantom -> shards -> cache under ``work`` (reused when there); also the caching seconds."""
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.clitools import run_cli
    from spar_bench.probes.cli import cli as probe_cli

    shards, cache = work / "shards", work / "cache" / "bench.h5"
    if not (shards / "manifest.json").is_file():
        assert (
            run_cli(
                build_cli,
                ["phantom", "--out", str(work / "ph"), "--n", str(n_cases), "--overwrite"],
            )
            == 0
        )
        args = ["--source", "phantom", "--root", str(work / "ph"), "--out", str(shards), "--no-hf",
                "--samples-per-case", str(samples), "--overwrite"]  # fmt: skip
        assert run_cli(build_cli, args) == 0
    t_cache = None
    if not cache.is_file():
        t0 = time.perf_counter()
        args = [
            "cache",
            "--encoder",
            encoder,
            "--random-init",
            "--data",
            str(shards),
            "--out",
            str(cache),
        ]
        assert run_cli(probe_cli, args) == 0
        t_cache = time.perf_counter() - t0
    return shards, cache, t_cache


def train_from_cache(cache_path: Path, epochs: int, seed: int = 0) -> float:
    import torch

    from spar_bench.builder.shards import Build
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    t0 = time.perf_counter()
    from spar_bench.probes.features import FeatureCache

    cache = FeatureCache(cache_path)
    build = Build(cache.meta["dataset_dir"])
    task = get_probe("level1.localisation")
    feats = np.asarray(cache.pooled("level1", "train"), np.float32)
    t = load_targets(build, task, "train", cache.keys("level1", "train"))
    torch.manual_seed(seed)
    head = build_head("mlp", task, feats.shape[1])
    _fit_epochs(head, task, epochs, lambda idx: torch.from_numpy(feats[t.rows[idx]]), t)
    return time.perf_counter() - t0


def train_reencoding(
    cache_path: Path, encoder_name: str, epochs: int, measured: int, seed: int = 0
) -> tuple[float, int]:
    """Seconds for ``epochs`` epochs re-encoding images each batch (``measured`` run, rest extrapolated)."""
    import torch

    from spar_bench.builder.shards import Build
    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    t0 = time.perf_counter()
    cache = FeatureCache(cache_path)
    build = Build(cache.meta["dataset_dir"])
    task = get_probe("level1.localisation")
    t = load_targets(build, task, "train", cache.keys("level1", "train"))
    enc = load_encoder(encoder_name, random_init=True)
    dim = int(np.asarray(cache.pooled("level1", "train")[:1]).shape[1])

    def encode(idx: np.ndarray):
        images = build.images("level1", "train", t.rows[idx])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ((_, pooled),) = enc(
                torch.from_numpy(np.ascontiguousarray(images)), layers=(-1,)
            ).values()
        return pooled.float()

    torch.manual_seed(seed)
    head = build_head("mlp", task, dim)
    run = min(measured, epochs)
    _fit_epochs(head, task, run, encode, t)
    elapsed = time.perf_counter() - t0
    return elapsed * epochs / run, run


def _fit_epochs(head, task, epochs: int, features, t, batch: int = 64) -> None:
    import torch

    from spar_bench.probes.train import batch_tensors, loss_fn

    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    dummy = np.zeros((len(t), 1), np.float32)
    for _ in range(epochs):
        order = torch.randperm(len(t), generator=gen).numpy()
        for s in range(0, len(t), batch):
            idx = np.sort(order[s : s + batch])
            _, q, y = batch_tensors(dummy, t.subset(np.arange(len(t))), idx)
            loss = loss_fn(task, head(features(idx), q), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def time_level3_transformer(cache_path: Path, epochs: int) -> tuple[float, float, int, int]:
    """Seconds per epoch: shared slice body vs one body per question; questions, slices."""
    import torch

    from spar_bench.builder.shards import Build
    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.fit import load_features
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.train import epoch_order, group_batch, loss_fn

    cache = FeatureCache(cache_path)
    task = get_probe("level3.relative_position")
    t = load_targets(Build(cache.meta["dataset_dir"]), task, "train", cache.keys("level3", "train"))
    raw = load_features(cache, "tokens", "level3", "train", -1)
    torch.manual_seed(0)
    head = build_head("transformer", task, raw.shape[-1], raw.shape[1])
    head.fit_projection(raw.reshape(-1, raw.shape[-1])[::7])
    feats = head.preproject(raw)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    seconds = []
    for shared in (True, False):
        t0 = time.perf_counter()
        for _ in range(epochs):
            order = epoch_order(head, t, gen)
            for s in range(0, len(t), 256):
                x, index, q, y = group_batch(feats, t, order[s : s + 256])
                out = head(x, q, index) if shared else head(x[index], q)
                loss = loss_fn(task, out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        seconds.append((time.perf_counter() - t0) / epochs)
    return seconds[0], seconds[1], len(t), int(np.unique(t.rows).size)


def time_sweep(
    cache_path: Path, heads: list[str], jobs: int, out: Path, max_epochs: int
) -> tuple[float, int]:
    from spar_bench.probes.fit import parse_probes
    from spar_bench.probes.sweep import make_jobs, run_sweep

    js = make_jobs(str(cache_path), heads, parse_probes("all"), [0], {"max_epochs": max_epochs, "batch_size": 64},
                   [{}], str(out), n_boot=200)  # fmt: skip
    t0 = time.perf_counter()
    results = run_sweep(js, jobs)
    bad = [r for r in results if r.error]
    if bad:
        raise SystemExit(f"sweep failed: {bad[0].error}")
    return time.perf_counter() - t0, len(results)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", type=Path, default=None, help="working folder (default: a temp dir)")
    ap.add_argument("--encoder", default="timm:resnet18")
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--encode-epochs", type=int, default=2, help="re-encode epochs actually run")
    ap.add_argument("--heads", default="mlp", help="heads of the timed sweep")
    ap.add_argument("--sweep-epochs", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--level3-epochs", type=int, default=3, help="timed Level 3 transformer epochs")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        _, cache, t_build = prepare(work, args.encoder, args.cases, args.samples)
        t_cache = train_from_cache(cache, args.epochs)
        t_enc, ran = train_reencoding(cache, args.encoder, args.epochs, args.encode_epochs)
        sweep_out = work / f"sweep-{time.time_ns()}"
        t_sweep, n_runs = time_sweep(
            cache, args.heads.split(","), args.jobs, sweep_out, args.sweep_epochs
        )
        l3 = time_level3_transformer(cache, args.level3_epochs)

    print(
        f"\nencoder {args.encoder} (random init), Level 1 train, mlp head, {args.epochs} epochs, 1 torch thread"
    )
    if t_build is not None:
        print(f"  build the cache (once, every level and split): {t_build:8.2f} s")
    print(f"  train from cache       : {t_cache:8.2f} s")
    print(
        f"  re-encode every epoch  : {t_enc:8.2f} s  ({ran} epoch(s) measured, rest extrapolated)"
    )
    print(f"  ratio re-encode / cache: {t_enc / t_cache:8.1f} x")
    print(f"  full sweep from one cache ({args.heads} x 8 probes x 1 seed, {args.jobs} jobs, "
          f"{args.sweep_epochs} max epochs, blind controls): {t_sweep:.1f} s for {n_runs} runs "
          f"({t_sweep / max(n_runs, 1):.1f} s/run; one re-encoded head ~ {t_enc / max(t_sweep / max(n_runs, 1), 1e-9):.0f} cached runs)")  # fmt: skip
    print(f"  Level 3 transformer, relative_position train ({l3[2]} questions on {l3[3]} slices): "
          f"{l3[0]:.2f} s/epoch with one body per slice, {l3[1]:.2f} s/epoch with one per "
          f"question ({l3[1] / max(l3[0], 1e-9):.1f} x)")  # fmt: skip


if __name__ == "__main__":
    main()
