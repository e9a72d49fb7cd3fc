"""Benchmark the feature cache: bare encoder throughput vs ``spar-probe cache`` end to end.

    python bench/cache.py                                   # CPU, resnet50 + ViT-B/32, own build
    python bench/cache.py --device cuda --batch 128 --n 2048
    python bench/cache.py --data shards/ --encoders timm:resnet50 --levels level1
    python bench/cache.py --synthetic 20000 --device cuda --batch 256 --workers 8   # bare GPU box

Per encoder (random init: throughput does not depend on the weights) it prints:
* bare img/s: ``Encoder.forward`` (preprocessing included) on random uint8 batches already
  on the device, same autocast as the cache;
* cache img/s: ``write_cache`` end to end on real shards (reading, H2D, compute, D2H,
  HDF5 writes), and the ratio cache/bare (aim > 0.9);
* bytes per sample on disk, and random 256-minibatch token reads from the finished cache;
* storage and compute precision: max abs / relative error of pooled vectors stored in fp16
  (vs fp32), and of bf16 autocast (vs fp32 compute) on one batch.

* start-up: seconds from the call to the first batch written, and its share of the run;
* where the time goes: one more cache run with a :class:`spar_bench.probes.stopwatch.Stopwatch`
  (read + decompression and collation in the reader workers, waiting for data, host-to-device
  copy, forward, writes in the writer thread and waiting for them), seconds and shares of its
  wall time, beside the untimed ratio; on CUDA every stage is synchronised, so that run is
  slower than the untimed ones (``--no-breakdown`` skips it);
* the writer thread on vs off: each repeat also caches with ``async_writes=False`` (HDF5
  writes in the encoding loop; the same file), interleaved, and gives both img/s, the median
  paired ratio on/off and each one's peak RSS (and peak CUDA memory), reset before each run
  (``--no-compare-writer`` skips those runs);
* the process's peak RSS (and peak CUDA memory).

On a GPU machine (issue 25's rows; on CUDA the uploads and downloads also run on side
streams, :mod:`spar_bench.probes.streams`):

    python bench/cache.py --synthetic 20000 --device cuda --batch 256 --workers 8 --json cache-gpu.json

``--synthetic N`` writes a build of N synthetic images with numpy and h5py only
(:mod:`spar_bench.builder.synthetic`, gzip shards: no hdf5plugin, nibabel or datasets needed),
so a bare GPU machine makes its own large build. Without ``--data`` or ``--synthetic`` it
makes a small build with the phantom pipeline, falling back to a synthetic one (said in
the output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_build(tmp: Path, n: int) -> tuple[Path, str]:
    """A small build: the phantom pipeline if it works here, else synthetic shards."""
    phantom, out = tmp / "phantom", tmp / "build"
    n_cases = max(2, n // 4)
    cmds = [
        ["spar-build", "phantom", "--out", str(phantom), "--n", str(n_cases), "--layout", "canonical"],
        ["spar-build", "--source", "phantom", "--root", str(phantom), "--out", str(out),
         "--samples-per-case", "4", "--levels", "level1", "--no-hf", "--images", "synthesize"],
    ]
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True, text=True, timeout=1800)
        return out, f"phantom pipeline ({n_cases} cases, level1, 4 samples per case)"
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired) as e:
        why = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[-1:] or ["?"]
        return synthetic_build(tmp, n, "gzip", f"; phantom pipeline unavailable: {why[0]}")


def synthetic_build(tmp: Path, n: int, compression: str, note: str = "") -> tuple[Path, str]:
    from spar_bench.builder.synthetic import write_synthetic_build

    t0 = time.perf_counter()
    out = write_synthetic_build(tmp / "synthetic", n, compression=compression)
    return out, (f"synthetic build ({n} images, {compression} shards, written in "
                 f"{time.perf_counter() - t0:.1f} s{note})")


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bare_throughput(enc, device, compute: str, batch: int, iters: int) -> float:
    import torch

    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, 224, 224), generator=g, dtype=torch.uint8).to(device)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        for _ in range(4):  # CPU bf16 kernels (oneDNN) run at half speed for their first few calls
            enc(x)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            res = enc(x)
            res[-1][0].float().cpu()  # the cache also brings tokens back to the host
        _sync(device)
    return batch * iters / (time.perf_counter() - t0)


def precision(enc, build, device, batch: int) -> dict[str, float]:
    """Errors of fp16 storage and of bf16 autocast, on one batch of real shards."""
    import torch

    from spar_bench.builder.shards import Build

    b = Build(build)
    lv = b.levels()[0]
    _, imgs = next(b.iter_images(lv, b.splits(lv)[0], batch))
    x = torch.from_numpy(imgs).to(device)
    ref = enc(x)[-1][1].float().cpu().numpy()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        bf = enc(x)[-1][1].float().cpu().numpy()
    f16 = ref.astype(np.float16).astype(np.float32)
    scale = float(np.abs(ref).max()) or 1.0
    rel = lambda a: float(np.linalg.norm(a - ref) / (np.linalg.norm(ref) or 1.0))  # noqa: E731
    return {"fp16_storage_max_abs": float(np.abs(f16 - ref).max()), "fp16_storage_rel_l2": rel(f16),
            "bf16_compute_max_abs": float(np.abs(bf - ref).max()), "bf16_compute_rel_l2": rel(bf),
            "pooled_abs_max": scale}


def read_throughput(cache: Path, level: str, split: str, batch: int = 256, reps: int = 5) -> dict[str, float]:
    from spar_bench.probes.features import FeatureCache

    rng = np.random.default_rng(0)
    with FeatureCache(cache) as fc:
        n = fc.count(level, split)
        t0 = time.perf_counter()
        for _ in range(reps):
            fc.tokens(level, split, rows=rng.choice(n, size=min(batch, n), replace=False))
        dt = (time.perf_counter() - t0) / reps
        t1 = time.perf_counter()
        fc.pooled(level, split)
        dp = time.perf_counter() - t1
    return {"random_batch": min(batch, n), "ms_per_random_batch": 1000 * dt,
            "samples_per_s": min(batch, n) / dt, "pooled_full_read_ms": 1000 * dp}


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoders", default="timm:resnet50,timm:vit_base_patch32_224")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--data", default=None, help="a build folder (default: make a small one)")
    ap.add_argument("--levels", default=None, help="levels to cache (default: all)")
    ap.add_argument("--n", type=int, default=256, help="images of the default small build")
    ap.add_argument("--synthetic", type=int, default=None, metavar="N",
                    help="make a synthetic build of N images (numpy + h5py only)")
    ap.add_argument("--compression", default="gzip", choices=["blosc", "gzip", "lzf", "none"],
                    help="shard compression of the --synthetic build")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=4, help="batches timed for the bare forward")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (best is kept)")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--compute", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip the timed run that says where the time goes")
    ap.add_argument("--no-compare-writer", dest="compare_writer", action="store_false",
                    help="skip the cache runs with the writer thread off (async_writes=False)")
    return ap.parse_args(argv)


def measure_encoder(name: str, a, data: Path, levels: list[str], device, compute: str, tmp: Path) -> dict:
    """Bare forward vs caching of one random-init encoder over ``data``, interleaved ``a.repeats``
    times: throughputs are the best of each, the ratio the median of the paired ratios (robust
    on a shared, noisy machine); start-up is the time to the first flushed batch."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.encoders import load_encoder
    from spar_bench.probes.finetune.encoding import published_encoder
    from spar_bench.probes.stopwatch import peak_memory, reset_peak_memory

    b = Build(data)
    n_rows = sum(b.count(lv, s) for lv in levels for s in b.splits(lv))
    enc = load_encoder(name, random_init=True).prefer_channels_last().to(device)
    out = tmp / f"{name.replace(':', '_')}.h5"
    bares, e2es, startups, syncs, peaks = [], [], [], [], {True: {}, False: {}}
    for _ in range(a.repeats):
        bares.append(bare_throughput(enc, device, compute, a.batch, a.iters))
        for background in (True, False) if a.compare_writer else (True,):
            first: list[float] = []
            reset_peak_memory(device)
            t0 = time.perf_counter()
            write_cache(name, data, out, CacheOptions(levels=levels, device=str(device), batch_size=a.batch,
                                                      dtype=a.dtype, compute=compute, loader_workers=a.workers,
                                                      overwrite=True, async_writes=background),
                        encoder_obj=enc, progress=False,
                        on_batch=lambda *_, f=first: f or f.append(time.perf_counter()))
            total = time.perf_counter() - t0
            for k, v in peak_memory(device).items():
                peaks[background][k] = max(peaks[background].get(k, 0.0), v)
            if not background:
                syncs.append(n_rows / total)
                continue
            e2es.append(n_rows / total)
            startups.append(((first[0] - t0) if first else total, total))
    breakdown = timed_breakdown(name, a, data, levels, device, compute, enc, out) if a.breakdown else None
    lv = levels[0]
    r = {"encoder": published_encoder(name, enc.spec), "tokens": enc.spec.n_tokens, "dim": enc.spec.dim,
         "bare_img_s": max(bares), "cache_img_s": max(e2es), "bare_all": bares, "cache_all": e2es,
         "startup_s": min(st for st, _ in startups),
         "startup_share": min(st / tot for st, tot in startups),
         "ratio": float(np.median([c / b for b, c in zip(bares, e2es, strict=True)])),
         "bytes_per_sample": out.stat().st_size / n_rows,
         "token_bytes_per_sample": enc.spec.n_tokens * enc.spec.dim * (2 if a.dtype == "fp16" else 4),
         **read_throughput(out, lv, b.splits(lv)[0]),
         **precision(enc, data, device, min(a.batch, 32))}
    r["peak_memory_mib"] = peaks[True]
    if syncs:  # the same runs with the writer thread off, interleaved: what the thread gives
        r.update(cache_sync_img_s=max(syncs), cache_sync_all=syncs, peak_memory_sync_mib=peaks[False],
                 writer_speedup=float(np.median([w / s for w, s in zip(e2es, syncs, strict=True)])))
    if breakdown is not None:
        r["breakdown"] = breakdown
    out.unlink()
    return r


def timed_breakdown(name: str, a, data: Path, levels: list[str], device, compute: str, enc, out: Path) -> dict:
    """One more cache run with a Stopwatch: ``{"wall_s", "stages": [[stage, where, s, share]], "table"}``."""
    from spar_bench.probes.cache import CacheOptions, write_cache
    from spar_bench.probes.stopwatch import Stopwatch

    sw = Stopwatch(device)
    t0 = time.perf_counter()
    write_cache(name, data, out, CacheOptions(levels=levels, device=str(device), batch_size=a.batch, dtype=a.dtype,
                                              compute=compute, loader_workers=a.workers, overwrite=True),
                encoder_obj=enc, progress=False, stopwatch=sw)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "stages": [list(r) for r in sw.rows(wall)], "table": sw.table(wall, name)}


def print_table(results: list[dict]) -> None:
    print()
    print(f"{'encoder':28s} {'bare img/s':>10s} {'cache img/s':>11s} {'ratio':>6s} {'KB/sample':>9s} "
          f"{'ms/rand256':>10s} {'fp16 rel':>9s} {'bf16 rel':>9s} {'start s':>7s} {'start %':>7s}")
    for r in results:
        print(f"{r['encoder']:28s} {r['bare_img_s']:10.1f} {r['cache_img_s']:11.1f} {r['ratio']:6.2f} "
              f"{r['bytes_per_sample'] / 1024:9.1f} {r['ms_per_random_batch']:10.1f} "
              f"{r['fp16_storage_rel_l2']:9.2e} {r['bf16_compute_rel_l2']:9.2e} "
              f"{r['startup_s']:7.2f} {100 * r['startup_share']:6.1f}%")
    print(f"peak RSS {peak_rss_mib():.0f} MiB")
    for r in (r for r in results if "writer_speedup" in r):
        mem = lambda d: ", ".join(f"{k} {v:.0f} MiB" for k, v in d.items())  # noqa: E731
        print(f"\n{r['encoder']}: writer thread on vs off (the same runs, interleaved): "
              f"{r['cache_img_s']:.1f} vs {r['cache_sync_img_s']:.1f} img/s, x{r['writer_speedup']:.2f}; "
              f"peak on: {mem(r['peak_memory_mib'])}; off: {mem(r['peak_memory_sync_mib'])}")
    for r in results:
        if "breakdown" in r:
            print(f"\n{r['encoder']}: where the time goes (a timed run; untimed ratio cache/bare {r['ratio']:.2f})")
            print(r["breakdown"]["table"])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)

    import torch

    from spar_bench.builder.shards import Build
    from spar_bench.probes.hardware import pick_compute, pick_device

    device = pick_device(a.device)
    compute = pick_compute(a.compute, device).dtype
    results = []
    with tempfile.TemporaryDirectory(prefix="spar-bench-cache-") as tmp:
        tmp = Path(tmp)
        if a.data:
            data, what = Path(a.data), f"build {Path(a.data).resolve().name}"  # no local path in results
        elif a.synthetic:
            data, what = synthetic_build(tmp, a.synthetic, a.compression)
        else:
            data, what = make_build(tmp, a.n)
        b = Build(data)
        levels = a.levels.split(",") if a.levels else b.levels()
        n_rows = sum(b.count(lv, s) for lv in levels for s in b.splits(lv))
        print(f"data: {what}; {n_rows} images; device {device}"
              f" ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'});"
              f" compute {compute}; storage {a.dtype}; batch {a.batch}", flush=True)
        for name in a.encoders.split(","):
            results.append(measure_encoder(name, a, data, levels, device, compute, tmp))
            print(json.dumps(results[-1], indent=None), flush=True)
    print_table(results)
    if a.json:
        Path(a.json).write_text(json.dumps({"data": what, "device": str(device), "compute": compute,
                                            "dtype": a.dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
