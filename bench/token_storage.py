"""What the token storage options cost and what they do to the probe scores.

    python bench/token_storage.py                        # own phantom build, random resnet18, CPU
    python bench/token_storage.py --data shards/ --encoder timm:resnet18 --weights r18.safetensors \
        --storages full,int8,pca:64,grid:4,grid:4+int8 --probes all --seeds 0,1,2
    # the table of docs/RESULTS.md: the recall-vs-computation encoder (issue 26) on a fresh random-layout build
    python bench/token_storage.py --cases 200 --layout random --intensities distinct --in-plane 96 \
        --slices 16 --phantom-seed 21 --samples 4 --l3-stride 2 --encoder timm:resnet10t \
        --model-args '{"channels": [16, 32, 64, 128], "stem_width": 16, "output_stride": 8,
                       "pretrained_cfg_overlay": {"input_size": [3, 64, 64]}}' --weights RUN/encoder.safetensors \
        --storages full,int8,grid:4,pca:32 --probes all --head attnpool --jobs 2 \
        -- --max-epochs 4 --patience 2 --bootstrap 200 --no-controls --batch-runs on

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


def own_build(tmp: Path, args) -> Path:
    """A phantom of ``args.cases`` cases (``--layout``, ``--intensities``, ``--in-plane``/``--slices``),
    built with Levels 1-3, ``--samples`` mosaics per case, Level 3 on every ``--l3-stride``-th
    slice, mirrored counterfactuals."""
    from spar_bench.builder.build import BuildConfig, build
    from spar_bench.builder.phantom.generate import PhantomOptions, write_phantom_dataset

    phantom, out = tmp / "phantom", tmp / "build"
    opts = PhantomOptions(layout=args.layout, seed=args.phantom_seed, intensities=args.intensities,
                          in_plane=args.in_plane, n_slices=args.slices)
    write_phantom_dataset(phantom, args.cases, opts, progress=False)
    sample = {"samples_per_case": args.samples, "counterfactual": "mirror", "l3_stride": args.l3_stride}
    build(BuildConfig(sources=("phantom",), roots=(str(phantom),), out=str(out), sample=sample, hf=False,
                      workers=1), quiet=True)
    return out


def headline_scores(runs: Path) -> dict[str, list[tuple[float, float, float]]]:
    """``{probe: [(headline, ci low, ci high) per seed]}`` of the sweep's finished runs under ``runs``."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for path in sorted(runs.rglob("metrics.json")):
        m = json.loads(path.read_text(encoding="utf-8"))
        t, h = m["test"], m["headline"]
        lo, hi = t.get("ci", {}).get(h, (np.nan, np.nan))
        out.setdefault(m["probe"], []).append((float(t[h]), float(lo), float(hi)))
    return out


def measure(args, data: Path, tmp: Path, name: str) -> dict:
    from spar_bench.probes.cache import CacheOptions, write_cache

    cache = tmp / f"{name.replace(':', '-').replace('+', '_')}.h5"
    t0 = time.perf_counter()
    write_cache(args.encoder, data, cache, CacheOptions(weights=args.weights, random_init=args.weights is None,
                                                       device=args.device, batch_size=args.batch,
                                                       token_storage=parse_storage(name),
                                                       model_args=args.model_args), progress=False)
    seconds = time.perf_counter() - t0
    runs = tmp / f"runs-{cache.stem}"
    t0 = time.perf_counter()
    subprocess.run(["spar-probe", "sweep", "--features", str(cache), "--data", str(data), "--out", str(runs),
                    "--head", args.head, "--probe", args.probes, "--seeds", args.seeds, "--device", args.device,
                    "--jobs", str(args.jobs), *args.fit_args], check=True, capture_output=True)
    return {"bytes": cache.stat().st_size, "seconds": seconds, "sweep_seconds": time.perf_counter() - t0,
            "scores": headline_scores(runs)}


def within(v: np.ndarray, base: np.ndarray) -> bool:
    """The storage's mean over seeds lies inside the full tokens' 95 % bootstrap interval
    (the per-seed interval bounds averaged over the seeds)."""
    return bool(base[:, 1].mean() <= v[:, 0].mean() <= base[:, 2].mean())


def print_table(results: dict[str, dict]) -> None:
    """One row per storage: bytes, write time and per probe ``mean +- sd [interval]``; ``*``
    marks a mean outside the first storage's (full tokens') interval."""
    base = results[next(iter(results))]
    probes = sorted(base["scores"])
    print("| storage | cache MB | x full | write s | x full | " + " | ".join(probes) + " | all within |")
    print("|---" * (6 + len(probes)) + "|")
    for name, r in results.items():
        cells, ok = [], True
        for p in probes:
            v, b = np.asarray(r["scores"].get(p, [(np.nan,) * 3])), np.asarray(base["scores"][p])
            inside = within(v, b)
            ok &= inside
            sd = v[:, 0].std(ddof=1) if len(v) > 1 else 0.0
            cells.append(f"{v[:, 0].mean():.3f} +- {sd:.3f} [{v[:, 1].mean():.3f}, {v[:, 2].mean():.3f}]"
                         f"{'' if inside else ' *'}")
        print(f"| {name} | {r['bytes'] / 1e6:.2f} | {r['bytes'] / base['bytes']:.2f} | {r['seconds']:.1f} | "
              f"{r['seconds'] / base['seconds']:.2f} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="a build (default: a phantom build made here)")
    ap.add_argument("--cases", type=int, default=12, help="phantom cases when no --data")
    ap.add_argument("--layout", default="canonical", help="phantom layout when no --data")
    ap.add_argument("--intensities", default="ct", help="phantom intensities (ct|distinct) when no --data")
    ap.add_argument("--in-plane", type=int, default=None, help="phantom in-plane voxels (default: 160)")
    ap.add_argument("--slices", type=int, default=None, help="phantom slices (default: 40-60)")
    ap.add_argument("--phantom-seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=8, help="Level 1-2 mosaics per case")
    ap.add_argument("--l3-stride", type=int, default=4, help="Level 3 on every Nth slice")
    ap.add_argument("--encoder", default="timm:resnet18")
    ap.add_argument("--model-args", type=json.loads, default=None, help="the encoder constructor's, JSON")
    ap.add_argument("--weights", default=None, help="weights (default: random init, said in the output)")
    ap.add_argument("--storages", default="full,int8,pca:64,grid:4,grid:4+int8")
    ap.add_argument("--probes", default="level2.arrangement,level3.size,level3.distance")
    ap.add_argument("--head", default="transformer")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("fit_args", nargs="*", help="after --: more spar-probe sweep options (--max-epochs 10)")
    args = ap.parse_args()
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spar-storage-") as t:
        tmp = Path(t)
        data = args.data or own_build(tmp, args)
        print(f"build {'given' if args.data else f'phantom, {args.cases} cases, {args.layout}, {args.intensities}'};"
              f" encoder {args.encoder}{'' if args.weights else ' (RANDOM init)'}; head {args.head};"
              f" seeds {args.seeds}; sweep options {' '.join(args.fit_args) or 'defaults'}", flush=True)
        results = {}
        for name in args.storages.split(","):
            results[name] = measure(args, data, tmp, name)
            print(f"  {name}: {results[name]['bytes']} bytes, write {results[name]['seconds']:.1f} s, "
                  f"sweep {results[name]['sweep_seconds']:.0f} s", flush=True)
            if args.json:  # after every storage: a long measurement stopped early keeps what it measured
                args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    print_table(results)
    print(f"wall {time.perf_counter() - t_all:.0f} s; peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
