"""Benchmark the builder against the floor: just decompressing and reading its input files.

    python bench/build.py                                  # WORD masks (../shared/data) + phantom
    python bench/build.py --root ../shared/data/word-labels --n-cases 4 --workers 1,2
    python bench/build.py --skip-word --phantom-n 6 --profile

For the same cases in one run and per worker count it prints:
* read s: every input file (mask, and image where one exists) loaded with nibabel
  ``np.asanyarray(img.dataobj)`` (the same worker count, processes, spawn);
* build s: ``spar_bench.builder.build.build`` end to end (find, load + canonicalise, pseudo-CT
  when ``--images synthesize``, samples, spill, thresholds, HDF5, Parquet, manifest);
* ratio = build / read (1.0 would mean the builder costs no more than reading its input).

``--profile`` runs the one-worker build under cProfile and prints the top functions by
cumulative time, to show where the time beyond reading goes.
WORD label maps are masks only: they are built with ``--images synthesize`` and, as all
20 are in ``labelsTs`` (test split), thresholds are fitted on ``test``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing
import pstats
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def read_one(path: str) -> int:
    """Decompress and read one NIfTI the cheap way; return its byte count."""
    import nibabel as nib

    return int(np.asanyarray(nib.load(path).dataobj).nbytes)


def time_read(files: list[str], workers: int) -> float:
    t0 = time.perf_counter()
    if workers == 1:
        for f in files:
            read_one(f)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            list(pool.map(read_one, files))
    return time.perf_counter() - t0


def input_files(source: str, root: Path, images: str) -> list[str]:
    from spar_bench.builder.sources import SOURCES

    refs = SOURCES.get(source)(root, images=images).find()
    return [str(p) for r in refs for role, p in sorted(r.files.items()) if role in ("image", "mask")]


def time_build(source: str, root: Path, out: Path, workers: int, images: str, fit_on: str | None,
               profile: bool = False) -> tuple[float, str]:
    from spar_bench.builder.build import BuildConfig, build

    cfg = BuildConfig(sources=(source,), roots=(str(root),), out=str(out), workers=workers,
                      images=images, fit_thresholds_on=fit_on, overwrite=True)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    build(cfg, quiet=True)
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    text = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
        text = buf.getvalue()
    return dt, text


def word_subset(src: Path, n: int, tmp: Path) -> Path:
    """A WORD-layout folder of symlinks to the first ``n`` label maps of ``src``."""
    dest = tmp / "word"
    for sub in ("labelsTr", "labelsVal", "labelsTs"):
        if not (src / sub).is_dir():
            continue
        files = sorted((src / sub).glob("*.nii*"))[:n]
        (dest / sub).mkdir(parents=True, exist_ok=True)
        for f in files:
            (dest / sub / f.name).symlink_to(f.resolve())
    return dest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT.parent / "shared" / "data" / "word-labels",
                    help="WORD label maps (masks only)")
    ap.add_argument("--n-cases", type=int, default=4, help="WORD cases to use (first N)")
    ap.add_argument("--phantom-n", type=int, default=4, help="phantom cases (0: skip)")
    ap.add_argument("--phantom-size", default="small", choices=["small", "medium", "large"])
    ap.add_argument("--workers", default="1,2", help="comma list of worker counts")
    ap.add_argument("--skip-word", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the 1-worker builds")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="spar-bench-build-") as tmp_:
        tmp = Path(tmp_)
        datasets: list[tuple[str, str, Path, str, str | None]] = []
        if not args.skip_word:
            if args.root.is_dir():
                datasets.append(("word-masks", "word", word_subset(args.root, args.n_cases, tmp),
                                 "synthesize", "test"))
            else:
                print(f"skipping WORD: {args.root} not found (pass --root)")
        if args.phantom_n:
            from spar_bench.builder.phantom.generate import write_phantom_dataset

            write_phantom_dataset(tmp / "phantom", args.phantom_n, size=args.phantom_size, seed=0,
                                  progress=False)
            datasets.append(("phantom", "phantom", tmp / "phantom", "auto", None))
        for label, source, root, images, fit_on in datasets:
            files = input_files(source, root, images)
            mb = sum(Path(f).stat().st_size for f in files) / 1e6
            for w in workers:
                t_read = time_read(files, w)
                t_build, prof = time_build(source, root, tmp / f"out-{label}-{w}", w, images, fit_on,
                                           profile=args.profile and w == 1)
                rows.append((label, len(files), mb, w, t_read, t_build))
                if prof:
                    print(f"\n== cProfile, {label}, 1 worker ==\n{prof}")
    print(f"\n{'data':12} {'files':>5} {'MB':>7} {'workers':>7} {'read s':>8} {'build s':>8} {'ratio':>7}")
    for label, nf, mb, w, tr, tb in rows:
        print(f"{label:12} {nf:>5} {mb:>7.1f} {w:>7} {tr:>8.2f} {tb:>8.2f} {tb / tr:>7.1f}")


if __name__ == "__main__":
    main()
