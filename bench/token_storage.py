"""What the token storage options cost and what they do to the probe scores.

    python bench/token_storage.py                        # own phantom build, random resnet18, CPU
    python bench/token_storage.py --data shards/ --encoder timm:resnet18 --weights r18.safetensors \
        --storages full,int8,pca:64,grid:4,grid:4+int8 --probes all --seeds 0,1,2

For every storage (``full`` = tokens as the encoder gives them; ``int8``; ``pca:K`` /
``random:K``; ``grid:G``; combinations joined by ``+``) it writes the feature cache of the
same build with the same encoder and prints, side by side in one run:

* the cache's bytes on disk and their ratio to ``full``;
* the time to write it and its ratio to ``full`` (the reductions run on the device);
* per probe, the token head's headline score as mean +- sd over the seeds, and its change
  from ``full`` (a storage option is harmless where that change lies within the seeds' spread
  and the bootstrap intervals the report shows);
* the process's peak RSS.

The heads are trained with ``spar-probe sweep`` (defaults, early stopping), so the numbers
are the ones users get. Use an encoder whose features carry signal (trained weights, or the
recall-vs-computation encoder): on random features every storage scores at the blind
baseline and the comparison says nothing.
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

from cache import peak_rss_mib  # noqa: E402


def parse_storage(text: str):
    """``"grid:4+int8"`` -> TokenStorage(grid=4, int8=True); ``"full"`` -> the identity."""
    from spar_bench.probes.token_storage import TokenStorage

    grid, proj, int8 = None, None, False
    for part in filter(None, text.split("+")):
        if part == "full":
            continue
        if part == "int8":
            int8 = True
        elif part.startswith("grid:"):
            grid = int(part.split(":", 1)[1])
        else:
            proj = part
    return TokenStorage.parse(grid, proj, int8)


def own_build(tmp: Path, n_cases: int) -> Path:
    """The main job's build: a canonical phantom of ``n_cases`` cases, 8 samples per case, mirrors."""
    phantom, out = tmp / "phantom", tmp / "build"
    for cmd in (["spar-build", "phantom", "--out", str(phantom), "--n", str(n_cases)],
                ["spar-build", "--source", "phantom", "--root", str(phantom), "--out", str(out),
                 "--samples-per-case", "8", "--counterfactual", "mirror", "--no-hf"]):
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def headline_scores(runs: Path) -> dict[str, list[float]]:
    """``{probe: [headline per seed]}`` of the sweep's finished runs under ``runs``."""
    out: dict[str, list[float]] = {}
    for path in sorted(runs.rglob("metrics.json")):
        m = json.loads(path.read_text(encoding="utf-8"))
        out.setdefault(m["probe"], []).append(float(m["test"][m["headline"]]))
    return out


def measure(args, data: Path, tmp: Path, name: str) -> dict:
    from spar_bench.probes.cache import CacheOptions, write_cache

    cache = tmp / f"{name.replace(':', '-').replace('+', '_')}.h5"
    t0 = time.perf_counter()
    write_cache(args.encoder, data, cache, CacheOptions(weights=args.weights, random_init=args.weights is None,
                                                       device=args.device, batch_size=args.batch,
                                                       token_storage=parse_storage(name)), progress=False)
    seconds = time.perf_counter() - t0
    runs = tmp / f"runs-{cache.stem}"
    subprocess.run(["spar-probe", "sweep", "--features", str(cache), "--data", str(data), "--out", str(runs),
                    "--heads", args.head, "--probes", args.probes, "--seeds", args.seeds,
                    "--device", args.device, "--jobs", str(args.jobs)], check=True, capture_output=True)
    return {"bytes": cache.stat().st_size, "seconds": seconds, "scores": headline_scores(runs)}


def print_table(results: dict[str, dict]) -> None:
    base = results[next(iter(results))]
    probes = sorted(base["scores"])
    print("| storage | cache MB | x full | write s | x full | "
          + " | ".join(f"{p} (mean +- sd; vs first)" for p in probes) + " |")
    print("|---" * (5 + len(probes)) + "|")
    for name, r in results.items():
        cells = []
        for p in probes:
            v, b = np.asarray(r["scores"].get(p, [np.nan])), np.asarray(base["scores"][p])
            cells.append(f"{v.mean():.3f} +- {v.std(ddof=1) if v.size > 1 else 0:.3f} ({v.mean() - b.mean():+.3f})")
        print(f"| {name} | {r['bytes'] / 1e6:.1f} | {r['bytes'] / base['bytes']:.2f} | {r['seconds']:.1f} | "
              f"{r['seconds'] / base['seconds']:.2f} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="a build (default: a phantom build made here)")
    ap.add_argument("--cases", type=int, default=12, help="phantom cases when no --data")
    ap.add_argument("--encoder", default="timm:resnet18")
    ap.add_argument("--weights", default=None, help="weights (default: random init, said in the output)")
    ap.add_argument("--storages", default="full,int8,pca:64,grid:4,grid:4+int8")
    ap.add_argument("--probes", default="level2.arrangement,level3.size,level3.distance")
    ap.add_argument("--head", default="transformer")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spar-storage-") as t:
        tmp = Path(t)
        data = args.data or own_build(tmp, args.cases)
        print(f"build {'given' if args.data else f'phantom, {args.cases} cases'}; encoder {args.encoder}"
              f"{'' if args.weights else ' (RANDOM init)'}; head {args.head}; seeds {args.seeds}")
        results = {name: measure(args, data, tmp, name) for name in args.storages.split(",")}
    print_table(results)
    print(f"peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
