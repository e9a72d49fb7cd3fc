"""Benchmark the 3-D feature cache (Level 4 volumes): bare 3-D forward vs ``spar-probe cache``.

    python bench/cache3d.py                                   # CPU, small: 12 volumes of 32^3
    python bench/cache3d.py --size 128 --n 64 --batch 8 --device cuda
    python bench/cache3d.py --encoders monai:swinunetr --model-args '{"feature_size": 24}'

It writes its own data: a synthetic build of ``--n`` volumes of ``--size``^3
(:mod:`spar_bench.builder.synthetic`, numpy + h5py, no download). Per encoder (random init,
``input_size`` = ``--size``; ``--model-args`` go to every ``monai:`` encoder), interleaved
``--repeats`` times, side by side in one run:

* bare vol/s: ``Encoder.forward`` (preprocessing included) on random uint8 volumes already on
  the device, the cache's autocast, the tokens brought back to the host;
* cache vol/s: ``write_cache`` end to end over the build's Level 4 (reading the shards, H2D,
  forward, D2H, HDF5 writes), and the ratio cache/bare (the median of the paired ratios);
* peak memory of each: the process's resident set sampled every 5 ms during that part (the
  JSON also has what it was when the part began) and, on CUDA,
  ``torch.cuda.max_memory_allocated``, so the two can be compared;
* bytes per volume in the cache, tokens and width of the cached layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_ENCODERS = "monai:resnet18,monai:vit,monai:swinunetr"
#: small enough for a CPU at the default size (the ViT is ViT-B/16: width 768, 12 blocks)
SMALL_SWIN = {"feature_size": 24}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextmanager
def peak_memory(device, into: dict, key: str):
    """Record in ``into[key]`` the peak resident set (MiB) during the block, sampled every 5 ms
    (``into[key + "_start"]``: the resident set when it began), and on CUDA the peak allocated
    device memory (``into[key + "_cuda"]``)."""
    import torch

    peak, stop = [_rss_mib()], threading.Event()
    into[key + "_start"] = peak[0]

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss_mib())

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        into[key] = max(peak[0], _rss_mib())
        if device.type == "cuda":
            into[key + "_cuda"] = torch.cuda.max_memory_allocated(device) / 2**20


def bare_throughput(enc, device, compute: str, batch: int, iters: int) -> float:
    """Volumes per second of the bare forward (warm-up first; tokens back to the host)."""
    import torch

    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute)
    g = torch.Generator().manual_seed(0)
    s = enc.spec.input_size[0]
    x = torch.randint(0, 256, (batch, s, s, s), generator=g, dtype=torch.uint8).to(device)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        for _ in range(4):  # warm-up: CPU bf16 kernels (oneDNN) run at half speed for their first few calls
            enc(x)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            res = enc(x)
            res[-1][0].float().cpu()
        _sync(device)
    return batch * iters / (time.perf_counter() - t0)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoders", default=DEFAULT_ENCODERS, help="comma-separated 3-D encoders (random init)")
    ap.add_argument("--model-args", default=None, help="JSON for every monai: encoder (input_size is --size)")
    ap.add_argument("--size", type=int, default=32, help="side S of the volumes (and the encoders' input)")
    ap.add_argument("--n", type=int, default=12, help="volumes in the synthetic build")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=None,
                    help="batches timed for the bare forward (default: as many volumes as the build's)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (best throughputs kept)")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--compute", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args(argv)


def load(name: str, a):
    from spar_bench.probes.encoders import load_encoder

    if not name.startswith("monai:"):
        return load_encoder(name, random_init=not name.startswith("torchscript:"))
    args = {**(SMALL_SWIN if name == "monai:swinunetr" else {}), **json.loads(a.model_args or "{}"),
            "input_size": a.size}
    return load_encoder(name, random_init=True, model_kwargs=args)


def measure_encoder(name: str, a, data: Path, device, compute: str, tmp: Path) -> dict:
    """Bare forward vs the cache of one encoder, interleaved ``a.repeats`` times."""
    from spar_bench.probes.cache import CacheOptions, write_cache

    enc = load(name, a).to(device)
    n = a.n
    out = tmp / f"{name.replace(':', '_')}.h5"
    bares, caches, mem = [], [], {}
    opts = CacheOptions(levels=["level4"], device=str(device), batch_size=a.batch, dtype=a.dtype,
                        compute=compute, loader_workers=a.workers, overwrite=True)
    for _ in range(a.repeats):
        with peak_memory(device, mem, "bare_peak_mib"):
            bares.append(bare_throughput(enc, device, compute, a.batch, a.iters or -(-n // a.batch)))
        t0 = time.perf_counter()
        with peak_memory(device, mem, "cache_peak_mib"):
            write_cache(name, data, out, opts, encoder_obj=enc, progress=False)
        caches.append(n / (time.perf_counter() - t0))
    spec = enc.spec
    return {"encoder": spec.name, "input": list(spec.input_size), "tokens": spec.n_tokens, "dim": spec.dim,
            "grid": list(spec.grid), "bare_vol_s": max(bares), "cache_vol_s": max(caches),
            "bare_all": bares, "cache_all": caches,
            "ratio": float(np.median([c / b for b, c in zip(bares, caches, strict=True)])),
            "bytes_per_volume": out.stat().st_size / n, **mem}


def print_table(results: list[dict], device) -> None:
    cuda = device.type == "cuda"
    print()
    print(f"{'encoder':18s} {'tokens':>6s} {'dim':>5s} {'bare vol/s':>10s} {'cache vol/s':>11s} {'ratio':>6s} "
          f"{'peak MiB bare':>13s} {'peak MiB cache':>14s}" + (f" {'CUDA MiB bare/cache':>20s}" if cuda else "")
          + f" {'KB/vol':>8s}")
    for r in results:
        line = (f"{r['encoder']:18s} {r['tokens']:6d} {r['dim']:5d} {r['bare_vol_s']:10.2f} {r['cache_vol_s']:11.2f} "
                f"{r['ratio']:6.2f} {r['bare_peak_mib']:13.0f} {r['cache_peak_mib']:14.0f}")
        # the peaks are of the whole process: what it held before each part is in the JSON (*_start)
        if cuda:
            line += f" {r['bare_peak_mib_cuda']:9.0f}/{r['cache_peak_mib_cuda']:<10.0f}"
        print(line + f" {r['bytes_per_volume'] / 1024:8.1f}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)

    import torch

    from spar_bench.builder.synthetic import write_synthetic_build
    from spar_bench.probes.hardware import pick_compute, pick_device

    device = pick_device(a.device)
    compute = pick_compute(a.compute, device).dtype
    results = []
    with tempfile.TemporaryDirectory(prefix="spar-bench-cache3d-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        data = write_synthetic_build(tmp / "b", 0, levels=("level4",), n_volumes=a.n, volume_size=a.size)
        what = f"synthetic build of {a.n} volumes of {a.size}^3 (written in {time.perf_counter() - t0:.1f} s)"
        dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
        print(f"data: {what}; device {device} ({dev}); compute {compute}; storage {a.dtype}; batch {a.batch}",
              flush=True)
        for name in a.encoders.split(","):
            results.append(measure_encoder(name, a, data, device, compute, tmp))
            print(json.dumps(results[-1]), flush=True)
    print_table(results, device)
    if a.json:
        Path(a.json).write_text(json.dumps({"data": what, "device": str(device), "compute": compute,
                                            "dtype": a.dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
