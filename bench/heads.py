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
   once (what ``train_head`` does) vs the same head re-encoding the slice per question;
5. ``layer``    - one training step of the Levels 1-2 transformer's encoder layer (65 tokens,
   width 128, batch 256) computed by ``heads.transformer.encoder_layer`` vs by the
   ``nn.TransformerEncoderLayer`` module itself (the same function), side by side;
6. ``batched``  - ``--batch-seeds`` seeds of one probe x head trained one at a time
   (``train_head``) vs as one batch (``ensemble.train_heads``), the same epochs for both;
   and a 2 x 2 grid (lr x weight decay) as one batch against one configuration alone;
7. ``prune``    - a 2 x 2 lr x wd grid over ``--batch-seeds`` seeds at the run defaults
   (max epochs, early stopping), Level 3 mlp and Levels 1-2 transformer: one configuration
   (each seed alone, ``train_head``) vs the full grid point by point (``train_head``, what
   ``sweep`` does on the CPU) vs as one batch (stopped members leave the stack) vs ``sweep --grid-prune K`` for each ``--prune-k``; per seed, the point chosen
   on validation (full grid: the lowest best validation loss; pruned: the survivor), whether
   the pruned grid chose the same, and the chosen points' mean test metric.
   ``--grid-only`` runs just this section.

``--sweep-cache CACHE`` times the sweep on an existing cache (e.g. a WORD-sized build's)
instead of the bench's small phantom, with the default epochs unless ``--sweep-epochs``.
Prints seconds, ratios measured side by side, the sweep's seconds per kind of run, and
peak RSS (this process, and the largest sweep worker). Random-init weights: timing only.
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

    from spar_bench.probes.heads import build_head
    from spar_bench.probes.runs.inputs import resolve_build
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    t0 = time.perf_counter()
    from spar_bench.probes.features import FeatureCache

    cache = FeatureCache(cache_path)
    build = resolve_build(cache, None)
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

    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.runs.inputs import resolve_build
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe

    t0 = time.perf_counter()
    cache = FeatureCache(cache_path)
    build = resolve_build(cache, None)
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

    from spar_bench.probes.train import batch_tensors

    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    dummy = np.zeros((len(t), 1), np.float32)
    for _ in range(epochs):
        order = torch.randperm(len(t), generator=gen).numpy()
        for s in range(0, len(t), batch):
            idx = np.sort(order[s : s + batch])
            _, q, y = batch_tensors(dummy, t.subset(np.arange(len(t))), idx)
            loss = task.loss_value(head(features(idx), q), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def time_level3_transformer(cache_path: Path, epochs: int) -> tuple[float, float, int, int]:
    """Seconds per epoch: shared slice body vs one body per question; questions, slices."""
    import torch

    from spar_bench.probes.features import FeatureCache
    from spar_bench.probes.heads import build_head
    from spar_bench.probes.runs.inputs import load_features, resolve_build
    from spar_bench.probes.targets import load_targets
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.train import epoch_order, group_batch

    cache = FeatureCache(cache_path)
    task = get_probe("level3.relative_position")
    t = load_targets(resolve_build(cache, None), task, "train", cache.keys("level3", "train"))
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
                loss = task.loss_value(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        seconds.append((time.perf_counter() - t0) / epochs)
    return seconds[0], seconds[1], len(t), int(np.unique(t.rows).size)


def time_sweep(cache_path: Path, heads: list[str], seeds: list[int], jobs: int, out: Path,
               max_epochs: int | None, small: bool) -> tuple[float, list]:  # fmt: skip
    """Seconds of a full sweep (all probes x ``heads`` x ``seeds``) and its per-run results."""
    from spar_bench.probes.cli.options import parse_probes
    from spar_bench.probes.runs.sweep import make_jobs, run_sweep

    options = {"max_epochs": max_epochs, "batch_size": 64 if small else None}
    js = make_jobs(str(cache_path), heads, parse_probes("all"), seeds, options, [{}], str(out),
                   n_boot=200 if small else 1000)  # fmt: skip
    t0 = time.perf_counter()
    results = run_sweep(js, jobs)
    bad = [r for r in results if r.error]
    if bad:
        raise SystemExit(f"sweep failed: {bad[0].error}")
    return time.perf_counter() - t0, results


def sweep_breakdown(results: list) -> dict[str, tuple[int, float]]:
    """Runs and summed worker seconds per kind (Levels 1-2 / Level 3 x head)."""
    kinds: dict[str, tuple[int, float]] = {}
    for r in results:
        if r.unavailable:
            continue
        j = r.job.run
        kind = f"{'Levels 1-2' if j.spec.level in ('level1', 'level2') else 'Level 3'} {j.head}"
        n, sec = kinds.get(kind, (0, 0.0))
        kinds[kind] = (n + 1, sec + r.seconds)
    return kinds


def time_layer(steps: int = 3) -> tuple[float, float]:
    """Seconds per training step: the transformer's encoder layer as the module vs ``encoder_layer``."""
    import torch

    from spar_bench.probes.heads.transformer import encoder_layer

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, 0.1, "gelu", batch_first=True, norm_first=True)
    x = torch.randn(256, 65, 128)
    out = []
    for fn in (layer, lambda v: encoder_layer(layer, v)):
        fn(x).pow(2).mean().backward()  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            fn(x).pow(2).mean().backward()
        out.append((time.perf_counter() - t0) / steps)
    return out[0], out[1]


def time_batched(cache_path: Path, probe: str, head: str, seeds: list[int], epochs: int,
                 grid: list[tuple[float, float]] | None = None) -> tuple[float, float]:  # fmt: skip
    """Seconds to train the members one at a time vs as one batch (``epochs`` each, no early stop).

    Members are ``seeds`` (same lr and weight decay), or with ``grid`` the (lr, wd) points of
    seed ``seeds[0]``; then "one at a time" times the FIRST point only (one configuration).
    """
    from spar_bench.probes.ensemble import train_heads
    from spar_bench.probes.runs.session import prepare_run
    from spar_bench.probes.runs.spec import make_run
    from spar_bench.probes.train import train_head

    points = [(seeds[0], lr, wd) for lr, wd in grid] if grid else [(s, 1e-3, 0.01) for s in seeds]
    runs = [make_run(str(cache_path), probe, head, s, {"max_epochs": epochs, "patience": epochs + 1,
                                                       "lr": lr, "weight_decay": wd}) for s, lr, wd in points]  # fmt: skip
    prepared = [prepare_run(r) for r in runs]
    sp = prepared[0].splits
    t0 = time.perf_counter()
    for r, p in zip(runs[:1] if grid else runs, prepared, strict=False):
        train_head(p.head.model, (p.head.feats["train"], sp.tr), (p.head.feats[sp.val_split], sp.va), r.train, r.seed)
    alone = time.perf_counter() - t0
    fresh = [prepare_run(r) for r in runs]  # untrained heads again
    t0 = time.perf_counter()
    train_heads([p.head.model for p in fresh], ([p.head.feats["train"] for p in fresh], sp.tr),
                ([p.head.feats[sp.val_split] for p in fresh], sp.va), [r.train for r in runs], [r.seed for r in runs])  # fmt: skip
    return alone, time.perf_counter() - t0


def time_grid_prune(cache_path: Path, probe: str, head: str, seeds: list[int],
                    grid: list[tuple[float, float]], ks: list[int]) -> dict:  # fmt: skip
    """Seconds, each seed's chosen point and its test headline: ``one`` (grid[0] per seed alone),
    ``alone`` (every grid point alone), ``0`` (the full grid as one batch) and each K of ``ks`` (the grid pruned after epoch K)."""
    from spar_bench.probes.ensemble import Prune, train_heads
    from spar_bench.probes.runs.evaluate import score
    from spar_bench.probes.runs.report import select_on_validation
    from spar_bench.probes.runs.session import prepare_run
    from spar_bench.probes.runs.spec import make_run
    from spar_bench.probes.train import train_head

    runs = [make_run(str(cache_path), probe, head, s, {"lr": lr, "weight_decay": wd}) for s in seeds for lr, wd in grid]
    one = [prepare_run(r) for r in runs[:: len(grid)]]
    sp = one[0].splits
    t0 = time.perf_counter()
    for r, p in zip(runs[:: len(grid)], one, strict=True):
        train_head(p.head.model, (p.head.feats["train"], sp.tr), (p.head.feats[sp.val_split], sp.va), r.train, r.seed)
    out: dict = {"one": (time.perf_counter() - t0, None, None)}
    alone = [prepare_run(r) for r in runs]
    t0 = time.perf_counter()
    for r, p in zip(runs, alone, strict=True):
        train_head(p.head.model, (p.head.feats["train"], sp.tr), (p.head.feats[sp.val_split], sp.va), r.train, r.seed)
    out["alone"] = (time.perf_counter() - t0, None, None)
    for k in [0, *ks]:
        ps = [prepare_run(r) for r in runs]
        t0 = time.perf_counter()
        res = train_heads([p.head.model for p in ps], ([p.head.feats["train"] for p in ps], sp.tr),
                          ([p.head.feats[sp.val_split] for p in ps], sp.va), [r.train for r in runs],
                          [r.seed for r in runs], prune=Prune(k, tuple(r.seed for r in runs)) if k else None)  # fmt: skip
        sec = time.perf_counter() - t0
        # the report's rule, on these results: per seed the lowest validation loss, pruned runs out
        ms = [{"seed": r.seed, "variant": r.variant(), "i": i,
               "train": {"best_val_loss": res[i].best_val_loss, "pruned_at": res[i].pruned_at}}
              for i, r in enumerate(runs)]  # fmt: skip
        chosen = [m["i"] for m in select_on_validation(ms)]
        test = [score(sp.te, _predict(ps[i], sp.te), None, 0)[sp.te.spec.headline] for i in chosen]
        out[k] = (sec, [grid[i % len(grid)] for i in chosen], float(np.mean(test)))
    return out


def _predict(p, t):
    from spar_bench.probes.train import predict

    return predict(p.head.model, p.head.feats["test"], t)


def peak_rss_mib() -> tuple[float, float]:
    """Peak RSS of this process and of its largest (finished) child process, MiB."""
    import resource

    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)  # fmt: skip


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
    ap.add_argument("--heads", default="mlp,transformer", help="heads of the timed sweep")
    ap.add_argument("--sweep-seeds", default="0", help="seeds of the timed sweep, e.g. 0,1,2")
    ap.add_argument("--sweep-epochs", type=int, default=None,
                    help="max epochs of the timed sweep (default: 10 on the bench's phantom, the "
                         "run defaults with --sweep-cache)")  # fmt: skip
    ap.add_argument("--sweep-cache", type=Path, default=None,
                    help="time the sweep on this cache (e.g. a WORD-sized build's) instead")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--level3-epochs", type=int, default=3, help="timed Level 3 transformer epochs")
    ap.add_argument("--batch-seeds", default="0,1,2", help="seeds of the batched-vs-alone timing")
    ap.add_argument("--batch-epochs", type=int, default=5)
    ap.add_argument("--prune-k", default="2,4", help="epochs K of the timed --grid-prune")
    ap.add_argument("--grid-only", action="store_true", help="time only the grid / --grid-prune section")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        _, cache, t_build = prepare(work, args.encoder, args.cases, args.samples)
        seeds = [int(v) for v in args.batch_seeds.split(",")]
        pruned = {(p, h): time_grid_prune(cache, p, h, seeds, PRUNE_GRID, [int(k) for k in args.prune_k.split(",")])
                  for p, h in (("level3.relative_position", "mlp"), ("level1.localisation", "transformer"))}  # fmt: skip
        if args.grid_only:
            _print_prune(args, pruned)
            return
        t_cache = train_from_cache(cache, args.epochs)
        t_enc, ran = train_reencoding(cache, args.encoder, args.epochs, args.encode_epochs)
        batched = {(p, h): time_batched(cache, p, h, seeds, args.batch_epochs)
                   for p, h in (("level3.relative_position", "mlp"), ("level1.localisation", "transformer"))}  # fmt: skip
        grid = time_batched(cache, "level3.relative_position", "mlp", seeds, args.batch_epochs,
                            grid=[(1e-3, 0.0), (1e-3, 0.01), (3e-4, 0.0), (3e-4, 0.01)])  # fmt: skip
        layer = time_layer()
        l3 = time_level3_transformer(cache, args.level3_epochs)
        sweep_cache = args.sweep_cache or cache
        epochs = args.sweep_epochs if (args.sweep_epochs or args.sweep_cache) else 10
        sweep_seeds = [int(v) for v in args.sweep_seeds.split(",")]
        t_sweep, results = time_sweep(sweep_cache, args.heads.split(","), sweep_seeds, args.jobs,
                                      work / f"sweep-{time.time_ns()}", epochs, small=args.sweep_cache is None)  # fmt: skip
    _print(args, t_build, t_cache, (t_enc, ran), batched, grid, layer, l3, (t_sweep, results, epochs))
    _print_prune(args, pruned)


PRUNE_GRID = [(1e-3, 0.01), (1e-3, 0.0), (3e-4, 0.01), (3e-4, 0.0)]  # the first: the run defaults


def _print_prune(args, pruned: dict) -> None:
    from spar_bench.probes.tasks import get_probe

    print(f"\n2 x 2 grid lr x wd {PRUNE_GRID}, seeds {args.batch_seeds}, run-default max epochs and early "
          "stopping, 1 torch thread; x = seconds / one configuration (the defaults, each seed alone)")  # fmt: skip
    for (probe, head), res in pruned.items():
        one, alone, (full, full_pts, full_test) = res["one"][0], res["alone"][0], res[0]
        metric = get_probe(probe).headline
        print(f"  {probe} {head}: one configuration {one:.1f} s; full grid point by point {alone:.1f} s "
              f"({alone / one:.2f} x); full grid as one batch {full:.1f} s ({full / one:.2f} x), chosen per "
              f"seed {full_pts}, test {metric} {full_test:.4f}")  # fmt: skip
        for k in (k for k in res if k not in ("one", "alone", 0)):
            sec, pts, test = res[k]
            agree = sum(a == b for a, b in zip(pts, full_pts, strict=True))
            print(f"    --grid-prune {k}: {sec:.1f} s ({sec / one:.2f} x), chosen {pts}, same point as the "
                  f"full grid for {agree}/{len(pts)} seeds, test {test:.4f}")  # fmt: skip
    rss_self, _ = peak_rss_mib()
    print(f"  peak RSS: this process {rss_self:.0f} MiB")


def _print(args, t_build, t_cache, enc, batched, grid, layer, l3, sweep) -> None:
    t_enc, ran = enc
    print(f"\nencoder {args.encoder} (random init), Level 1 train, mlp head, {args.epochs} epochs, 1 torch thread")
    if t_build is not None:
        print(f"  build the cache (once, every level and split): {t_build:8.2f} s")
    print(f"  train from cache       : {t_cache:8.2f} s")
    print(f"  re-encode every epoch  : {t_enc:8.2f} s  ({ran} epoch(s) measured, rest extrapolated)")
    print(f"  ratio re-encode / cache: {t_enc / t_cache:8.1f} x")
    print(f"  Level 3 transformer, relative_position train ({l3[2]} questions on {l3[3]} slices): "
          f"{l3[0]:.2f} s/epoch with one body per slice, {l3[1]:.2f} s/epoch with one per "
          f"question ({l3[1] / max(l3[0], 1e-9):.1f} x)")  # fmt: skip
    print(f"  transformer encoder layer, one training step (256 x 65 tokens x 128): module "
          f"{layer[0]:.3f} s, encoder_layer {layer[1]:.3f} s ({layer[0] / layer[1]:.2f} x)")  # fmt: skip
    for (probe, head), (alone, together) in batched.items():
        print(f"  {probe} {head}, {args.batch_seeds} seeds x {args.batch_epochs} epochs: one at a time "
              f"{alone:.1f} s, as one batch {together:.1f} s ({alone / together:.2f} x)")  # fmt: skip
    print(f"  grid lr x wd (2 x 2), level3.relative_position mlp: one configuration {grid[0]:.1f} s, "
          f"the 4 as one batch {grid[1]:.1f} s ({grid[1] / grid[0]:.2f} x one configuration)")  # fmt: skip
    t_sweep, results, epochs = sweep
    n = sum(1 for r in results if not r.unavailable)
    where = args.sweep_cache.name if args.sweep_cache else "the bench phantom"
    print(f"  full sweep on {where} ({args.heads} x 8 probes x seeds {args.sweep_seeds}, {args.jobs} jobs, "
          f"{'default' if epochs is None else epochs} max epochs, blind controls): {t_sweep:.1f} s "
          f"({t_sweep / 60:.1f} min) for {n} runs")  # fmt: skip
    for kind, (k, sec) in sorted(sweep_breakdown(results).items()):
        print(f"    {kind:24s} {k:3d} runs  {sec:8.1f} worker-s  ({sec / max(k, 1):.1f} s/run)")
    rss_self, rss_child = peak_rss_mib()
    print(f"  peak RSS: this process {rss_self:.0f} MiB, largest sweep worker {rss_child:.0f} MiB")


if __name__ == "__main__":
    main()
