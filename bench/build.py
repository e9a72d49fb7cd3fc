"""Benchmark the builder against its floor: decompressing and reading the input files.

    python bench/build.py                                   # every data set below, workers 1,2
    python bench/build.py --only ts,ts-ct --workers 1 --profile
    python bench/build.py --only word --n-cases 4 --repeats 3

Data sets (``--only``, comma list):

* ``ts``: the real TotalSegmentator sample (``../shared/data/totalsegmentator-sample``,
  122x101x30 CT at 3 mm + per-class masks, R,A,S);
* ``ts-ct``: the same case made real-CT-sized by this bench in a temporary
  TotalSegmentator-layout folder: resampled to 512x512x200 voxels declared as
  0.8 x 0.8 x 2.5 mm (in-plane to 0.8 mm and padded with air to 512; the 30 slices
  stretched to 200, a stand-in for a longer scan), CT linear + Gaussian noise (sd 20 HU,
  seed 0) so that it compresses like a real CT, masks nearest; only the mapped classes'
  mask files are written (the builder reads no others);
* ``word``: the first ``--n-cases`` real WORD label maps, built with ``--images
  synthesize`` (pseudo-CT) and thresholds fitted on ``test``;
* ``phantom``: ``--phantom-n`` phantom cases (image + mask files).

Per data set and worker count, each measurement runs in a fresh process (imports done
before the clock starts and reported as ``start s``), ``--repeats`` times alternately;
the table shows the fastest of each:

* ``read s``: the bare read, the floor: every input file the build reads (image, mask;
  for TotalSegmentator the CT and the mapped class masks) loaded with nibabel
  ``np.asanyarray(nib.load(f).dataobj)``, with the same worker count (spawned processes);
* ``rd* s``: the same files through the builder's own reader
  (``spar_bench.builder.readers.read_volume``: bytes read and hashed once, gunzipped in
  one call, voxels a view of those bytes): what reading costs inside the build;
* ``build s``: ``spar_bench.builder.build.build`` end to end, as ``spar-build`` runs it
  (find, read, canonicalise, pseudo-CT, samples, spill, thresholds, HDF5 shards, the
  Hugging Face Parquet folder, manifest);
* ``ct s``: of that, pseudo-CT rendering (timed inside the build at 1 worker; at more
  workers estimated as the 1-worker time / min(workers, cases), marked ``~``);
* ``hf s``: of that, writing the Hugging Face folder (``OUT/hf``: PNG encoding and
  Parquet; ``--no-hf`` skips it), timed inside the build;
* ``proper s`` = build - ct (the HF folder included); ``ratio`` = proper / read (1.0:
  the builder costs no more than reading its input with nibabel; the target is 1.5);
  ``no-hf`` = (proper - hf) / read; ``x all`` = build / read;
* ``rss MB``: peak resident memory of the build's process and of its largest worker.

``--profile`` prints the top functions by cumulative time of one 1-worker build.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing
import pstats
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
DATASETS = ("ts", "ts-ct", "word", "phantom")


@dataclass(frozen=True)
class DataSet:
    label: str
    source: str
    root: Path
    images: str
    fit_on: str | None


# -- the floor -------------------------------------------------------------------------
def read_one(path: str) -> int:
    """Decompress and read one NIfTI the cheap way; return its byte count."""
    import nibabel as nib

    return int(np.asanyarray(nib.load(path).dataobj).nbytes)


def read_one_builder(path: str) -> int:
    """Read one NIfTI with the builder's reader; return its byte count."""
    from spar_bench.builder.readers import read_volume

    return int(read_volume(path, case_id="bench")[0].nbytes)


def time_read(files: list[str], workers: int, reader=read_one) -> float:
    t0 = time.perf_counter()
    if workers == 1:
        for f in files:
            reader(f)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            list(pool.map(reader, files))
    return time.perf_counter() - t0


def input_files(ds: DataSet) -> list[str]:
    """Every file the build reads: images, masks; TotalSegmentator: CT + mapped class masks."""
    from spar_bench.builder.sources import SOURCES

    src = SOURCES.get(ds.source)(ds.root, images=ds.images)
    out = []
    for ref in src.find():
        for role, p in sorted(ref.files.items()):
            if role in ("image", "mask"):
                out.append(str(p))
            elif role == "segmentations" and Path(p).is_dir():
                for cls in sorted(src.label_map()["classes"]):
                    out += [str(f) for f in (Path(p) / f"{cls}.nii.gz", Path(p) / f"{cls}.nii") if f.exists()]
            elif role == "segmentations":
                out.append(str(p))
    return out


def n_cases(ds: DataSet) -> int:
    from spar_bench.builder.sources import SOURCES

    return len(SOURCES.get(ds.source)(ds.root, images=ds.images).find())


# -- the build -------------------------------------------------------------------------
class FunctionTimer:
    """Wraps ``module.name`` in this process and sums its wall time (module looked up at call time)."""

    def __init__(self, module, name: str) -> None:
        self.module, self.name, self.original, self.seconds = module, name, getattr(module, name), 0.0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(module, name, timed)

    def close(self) -> None:
        setattr(self.module, self.name, self.original)


def run_build(ds: DataSet, out: Path, workers: int, profile: bool) -> dict:
    """{"seconds": build s, "render": pseudo-CT s in this process, "hf": HF folder s, "profile": text}."""
    from spar_bench.builder.build import BuildConfig, build
    from spar_bench.builder.synth import render
    from spar_bench.builder.writers import hf

    cfg = BuildConfig(sources=(ds.source,), roots=(str(ds.root),), out=str(out), workers=workers,
                      images=ds.images, fit_thresholds_on=ds.fit_on, overwrite=True)
    timers = {"render": FunctionTimer(render, "render_pseudo_ct"), "hf": FunctionTimer(hf, "write_hf")}
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    try:
        if prof:
            prof.enable()
        build(cfg, quiet=True)
        if prof:
            prof.disable()
    finally:
        for t in timers.values():
            t.close()
    rec = {"seconds": time.perf_counter() - t0, **{k: t.seconds for k, t in timers.items()}, "profile": ""}
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
        rec["profile"] = buf.getvalue()
    return rec


def measure(task: str, ds: DataSet, workers: int, out: str, profile: bool = False) -> dict:
    """One measurement in this (fresh) process: imports first, then the timed task."""
    t0 = time.perf_counter()
    import nibabel  # noqa: F401

    import spar_bench.builder.build  # noqa: F401
    import spar_bench.builder.samples  # noqa: F401
    import spar_bench.builder.sources  # noqa: F401
    import spar_bench.builder.writers.hf  # noqa: F401

    if task == "build":
        import datasets  # noqa: F401
        import h5py  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    start = time.perf_counter() - t0
    files = input_files(ds)
    rec = {"start": start, "files": len(files), "mb": sum(Path(f).stat().st_size for f in files) / 1e6}
    if task == "read":
        rec["seconds"] = time_read(files, workers)
    elif task == "read-builder":
        rec["seconds"] = time_read(files, workers, read_one_builder)
    else:
        rec.update(run_build(ds, Path(out), workers, profile))
    rec["rss_self"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rec["rss_child"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return rec


def fresh(task: str, ds: DataSet, workers: int, out: Path, profile: bool = False) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(measure, task, ds, workers, str(out), profile).result()


# -- data sets -------------------------------------------------------------------------
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


def ct_sized_case(src: Path, dest: Path, shape=(512, 512, 200), spacing=(0.8, 0.8, 2.5)) -> Path:
    """The TotalSegmentator sample case resampled to a real CT's size (see the module doc)."""
    import nibabel as nib
    from scipy import ndimage

    from spar_bench.builder.sources import SOURCES

    ref = SOURCES.get("totalsegmentator")(src).find()[0]
    ct = nib.load(str(ref.files["image"]))
    data = np.asanyarray(ct.dataobj)
    old = np.sqrt((ct.affine[:3, :3] ** 2).sum(axis=0))
    inplane = [min(shape[a], round(data.shape[a] * old[a] / spacing[a])) for a in (0, 1)]
    zoom = (inplane[0] / data.shape[0], inplane[1] / data.shape[1], shape[2] / data.shape[2])
    pad = [((shape[a] - inplane[a]) // 2, shape[a] - inplane[a] - (shape[a] - inplane[a]) // 2) for a in (0, 1)]
    affine = ct.affine.copy()
    affine[:3, :3] = ct.affine[:3, :3] / old * np.asarray(spacing)
    rng = np.random.default_rng(0)
    hu = ndimage.zoom(data.astype(np.float32), zoom, order=1)
    hu = np.pad(hu, pad + [(0, 0)], constant_values=-1024)
    hu += rng.normal(0, 20, hu.shape).astype(np.float32)
    case = dest / ref.case_id
    (case / "segmentations").mkdir(parents=True)
    nib.save(nib.Nifti1Image(np.clip(np.rint(hu), -1024, 3071).astype(np.int16), affine), str(case / "ct.nii.gz"))
    idx = [np.minimum((np.arange(n) / z).astype(np.int64), m - 1)
           for n, z, m in zip((inplane[0], inplane[1], shape[2]), zoom, data.shape, strict=True)]
    seg = Path(ref.files["segmentations"])
    for cls in SOURCES.get("totalsegmentator")(src).label_map()["classes"]:
        f = seg / f"{cls}.nii.gz"
        if not f.exists():
            continue
        m = np.asanyarray(nib.load(str(f)).dataobj).astype(np.uint8)
        big = np.pad(m[idx[0]][:, idx[1]][:, :, idx[2]], pad + [(0, 0)])
        nib.save(nib.Nifti1Image(big, affine), str(case / "segmentations" / f.name))
    (dest / "meta.csv").write_text(f"image_id;split\n{ref.case_id};test\n", encoding="utf-8")
    return dest


def make_datasets(args, tmp: Path) -> list[DataSet]:
    out = []
    for name in args.only.split(","):
        if name not in DATASETS:
            raise SystemExit(f"--only: unknown data set {name!r}; choose from {', '.join(DATASETS)}")
        if name in ("ts", "ts-ct"):
            if not args.ts_root.is_dir():
                print(f"skipping {name}: {args.ts_root} not found (pass --ts-root)")
                continue
            root = args.ts_root
            if name == "ts-ct":
                root = tmp / "ts-ct"
                if not (root / "meta.csv").is_file():
                    ct_sized_case(args.ts_root, root)
            out.append(DataSet(name, "totalsegmentator", root, "auto", "test"))
        elif name == "word":
            if not args.word_root.is_dir():
                print(f"skipping word: {args.word_root} not found (pass --word-root)")
                continue
            word = tmp / "word" if (tmp / "word").is_dir() else word_subset(args.word_root, args.n_cases, tmp)
            out.append(DataSet("word", "word", word, "synthesize", "test"))
        elif args.phantom_n:
            from spar_bench.builder.phantom.generate import PhantomOptions, write_phantom_dataset

            if not (tmp / "phantom").is_dir():
                write_phantom_dataset(tmp / "phantom", args.phantom_n, PhantomOptions(size=args.phantom_size),
                                      progress=False)
            out.append(DataSet("phantom", "phantom", tmp / "phantom", "auto", None))
    return out


# -- main ------------------------------------------------------------------------------
def run(ds: DataSet, workers: int, repeats: int, tmp: Path, profile: bool) -> dict:
    runs: dict[str, list[dict]] = {"read": [], "read-builder": [], "build": []}
    for _ in range(repeats):
        for task, got in runs.items():
            got.append(fresh(task, ds, workers, tmp / f"out-{ds.label}-{workers}"))
    best = {task: min(got, key=lambda d: d["seconds"]) for task, got in runs.items()}
    if profile and workers == 1:
        text = fresh("build", ds, 1, tmp / f"out-{ds.label}-prof", profile=True)["profile"]
        print(f"\n== cProfile, {ds.label}, 1 worker ==\n{text}")
    return best


HEADER = (f"{'data':8} {'files':>5} {'MB':>7} {'wk':>3} {'read s':>7} {'rd* s':>6} {'build s':>8} "
          f"{'ct s':>7} {'hf s':>6} {'proper s':>8} {'ratio':>6} {'no-hf':>6} {'x all':>6} {'start s':>7} "
          f"{'rss MB':>11}")
LEGEND = """
read s: bare nibabel read of the build's input files (the floor); rd* s: the same files through
the builder's reader. build s: spar-build end to end (HDF5 shards + Hugging Face folder +
manifest); ct s: pseudo-CT rendering in it (~: estimated from 1 worker); hf s: the Hugging Face
folder in it. proper s = build - ct; ratio = proper / read (target <= 1.5); no-hf = (proper - hf)
/ read; x all = build / read. rss = peak of the build's process / its largest worker (MB).
Times: fastest of --repeats, each in a fresh process."""


def table_row(label: str, res: dict, w: int, render: float, mark: str) -> str:
    r, b = res["read"], res["build"]
    proper = b["seconds"] - render
    rss = f"{b['rss_self']:.0f}/{b['rss_child']:.0f}"
    return (f"{label:8} {r['files']:>5} {r['mb']:>7.1f} {w:>3} {r['seconds']:>7.2f} "
            f"{res['read-builder']['seconds']:>6.2f} {b['seconds']:>8.2f} {mark}{render:>6.2f} {b['hf']:>6.2f} "
            f"{proper:>8.2f} {proper / r['seconds']:>6.2f} {(proper - b['hf']) / r['seconds']:>6.2f} "
            f"{b['seconds'] / r['seconds']:>6.2f} {b['start']:>7.2f} {rss:>11}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(DATASETS), help="comma list of data sets")
    ap.add_argument("--ts-root", type=Path, default=SHARED / "totalsegmentator-sample")
    ap.add_argument("--word-root", type=Path, default=SHARED / "word-labels")
    ap.add_argument("--n-cases", type=int, default=4, help="WORD cases to use (first N)")
    ap.add_argument("--phantom-n", type=int, default=4, help="phantom cases")
    ap.add_argument("--phantom-size", default="small", choices=["small", "medium", "large"])
    ap.add_argument("--workers", default="1,2", help="comma list of worker counts")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each measurement (fastest shown)")
    ap.add_argument("--profile", action="store_true", help="cProfile one 1-worker build per data set")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="keep the data sets made here and reuse them (default: a temporary folder)")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="spar-bench-build-") as tmp_:
        tmp = Path(tmp_)
        data = args.data_dir or tmp
        data.mkdir(parents=True, exist_ok=True)
        for ds in make_datasets(args, data):
            render_1 = None
            for w in workers:
                res = run(ds, w, args.repeats, tmp, args.profile)
                b = res["build"]
                if w == 1:
                    render_1 = b["render"]
                    render, mark = b["render"], " "
                else:
                    render = (render_1 or 0.0) / min(w, n_cases(ds)) if render_1 is not None else float("nan")
                    mark = "~"
                rows.append((ds.label, res, w, render, mark))
    print("\n" + HEADER)
    for row in rows:
        print(table_row(*row))
    print(LEGEND)


if __name__ == "__main__":
    main()
