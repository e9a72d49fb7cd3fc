"""What a run reads: its feature cache and build (checked against each other and the
manifest), its targets split by patient, and its features.

:func:`open_run` opens and checks a run's cache and build; :func:`split_targets` applies the
validation rule (the cache's ``val`` split, or a seeded 15 % of training patients);
:func:`load_features` reads pooled features or tokens, refusing non-finite values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from spar_bench.errors import ConfigError, IntegrityError

from ..targets import ProbeUnavailable, holdout_patients, load_targets, missing_level, no_lesions


def open_cache(path: str | Path):
    """Open a feature cache (``spar_bench.probes.features.FeatureCache``) with a clear error."""
    from ..features import FeatureCache

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: feature cache not found; make one with `spar-probe cache`")
    return FeatureCache(p)


def resolve_build(cache, data: str | Path | None):
    """The build the targets come from: ``--data`` or the cache's ``meta["dataset_dir"]``
    (relative to the cache file's folder).

    Raises :class:`ConfigError` when it is missing or its fingerprint differs from the
    one the cache was made from.
    """
    from spar_bench.builder.shards import Build

    root = data if data is not None else cache.meta.get("dataset_dir")
    if not root:
        raise ConfigError(f"{cache.path}: cache records no dataset_dir; pass --data BUILD_DIR")
    if data is None:  # recorded relative to the cache file's folder (absolute in older caches)
        root = Path(cache.path).parent / root
    if not (Path(root) / "manifest.json").is_file():
        raise ConfigError(
            f"{root}: no manifest.json (build recorded by cache {cache.path}); pass --data BUILD_DIR"
        )
    build = Build(root)
    if build.fingerprint != cache.fingerprint:
        raise ConfigError(
            f"{cache.path}: cache fingerprint {str(cache.fingerprint)[:12]} differs from build "
            f"{root} fingerprint {build.fingerprint[:12]}; the shards changed since caching - "
            "re-run `spar-probe cache` or pass the matching --data"
        )
    cache.check_matches(build)
    return build


def check_shards(build, level: str) -> None:
    """Re-hash the shards of ``level`` against the build's manifest (targets are read from them).

    The fingerprint the cache checks covers the manifest, not the bytes on disk: a shard
    edited after the build (answers changed, say) is caught here.
    """
    from spar_bench.hashing import sha256_file

    for entries in build.manifest["shards"].get(level, {}).values():
        for e in entries:
            p = Path(build.root) / e["path"]
            if p.is_file() and sha256_file(p) != e["sha256"]:
                raise IntegrityError(
                    f"{p}: sha256 differs from {Path(build.root) / 'manifest.json'}; the shard was "
                    "changed after the build - rebuild it (`spar-build verify` lists every change)"
                )


def cache_identity(cache) -> dict[str, Any]:
    """What makes two caches of one encoder slug and build give other features: the storage
    and compute dtypes and the encoder's configuration (a digest of its recorded
    ``encoder_config``: model args, preprocessing). A run's ``config.json`` records it, and a
    finished run is kept only for a cache of the same identity (:func:`~.store.finished_run`)."""
    from spar_bench.hashing import sha256_json

    meta = cache.meta
    return {"dtype": meta.get("dtype"), "compute_dtype": meta.get("compute_dtype"),
            "encoder_config_sha256": sha256_json(meta.get("encoder_config"), default=str)[:16]}


def encoder_slug(cache) -> str:
    """Run-directory name of a cache's encoder (``-random-init`` appended when so); a local
    path recorded by an older cache is replaced by its base name + hash (``published_name``).

    Weights from a local file or folder add their hash (``timm:resnet50 --weights a.pt`` and
    ``--weights b.pt`` are two encoders: their runs never share a folder). A cache whose
    Levels 1-2 were encoded tile by tile (``cache --tile-encoding per-tile``) adds ``-per-tile``,
    and one whose tokens were reduced (``--token-grid/--token-proj/--token-int8``) adds
    :meth:`TokenStorage.slug`.
    """
    from ..encoders.base import published_name
    from ..token_storage import TokenStorage

    weights = cache.meta.get("weights")
    name = published_name(str(cache.meta.get("encoder") or Path(cache.path).stem), weights)
    sha = weights.get("sha256") if isinstance(weights, dict) and weights.get("kind") in ("file", "dir") else None
    if isinstance(sha, str) and sha and "@" not in name:
        name += f"@{sha[:8]}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "encoder"
    training = weights.get("training") if isinstance(weights, dict) else None
    if isinstance(training, dict):  # an encoder trained by `spar-probe finetune`, probed frozen
        trained = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{training.get('mode')}-{training.get('build')}")
        slug += f"-{trained}-frozen"
    if getattr(cache, "tile_encoding", "mosaic") == "per-tile":  # other features: other runs
        slug += "-per-tile"
    slug += TokenStorage.from_dict(cache.meta.get("token_storage")).slug()  # reduced tokens: likewise
    return slug + ("-random-init" if cache.random_init else "")


def finite(x: np.ndarray, cache, level: str, split: str, layer: int) -> np.ndarray:
    """``x``, or a one-line error naming the cache, level, split and layer if any value is NaN/inf."""
    bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
    if bad:
        raise ConfigError(
            f"{cache.path}: {level}/{split} layer {layer} holds {bad} non-finite feature value(s) "
            "(NaN/inf); the cache is corrupt or the encoder diverged - re-run `spar-probe cache`"
        )
    return x


def load_features(
    cache, input_kind: str, level: str, split: str, layer: int, head=None
) -> np.ndarray:
    """Pooled ``(N, D)`` float32, or tokens ``(N, T, k)`` pre-projected by ``head``; finite."""
    if input_kind == "pooled":
        x = np.asarray(cache.pooled(level, split, layer=layer), dtype=np.float32)
        return finite(x, cache, level, split, layer)
    n = len(cache.keys(level, split))
    parts = []
    for s in range(0, n, 1024):
        tok = cache.tokens(level, split, layer=layer, rows=np.arange(s, min(s + 1024, n)))
        tok = finite(np.asarray(tok, np.float32), cache, level, split, layer)
        parts.append(head.preproject(tok) if head is not None else tok)
    if not parts:
        raise ConfigError(f"{cache.path}: {level}/{split} has no rows")
    return np.concatenate(parts)


class Splits(NamedTuple):
    """The targets of one run and where its validation items came from."""

    tr: Any
    va: Any
    te: Any
    te_mirror: Any
    val_source: str
    val_split: str  # the cache split the validation features are read from
    #: the flipped counterfactual test items (Level 4), or None when the level has none (Levels 1-3)
    te_flipped: Any = None


def split_targets(build, cache, run) -> Splits:
    """Train / validation / test targets aligned to the cache.

    Without a val split, a patient-grouped fraction of train is held out (seeded);
    mirrored samples are evaluated separately and trained on only with ``train_mirrors``;
    flipped ones (Level 4) are evaluated separately and never trained on.
    """
    from spar_bench.seeding import derive_seed

    spec, cfg = run.spec, run.train
    level = spec.level
    tr_all = load_targets(build, spec, "train", cache.keys(level, "train"))
    if tr_all.is_flipped is None:  # Levels 1-3
        tr = tr_all if run.train_mirrors else tr_all.subset(~tr_all.is_mirror)
    else:
        tr = tr_all.subset(~tr_all.flipped if run.train_mirrors else tr_all.original)
    if "val" in cache.splits(level):
        va = load_targets(build, spec, "val", cache.keys(level, "val"))
        va = va.subset(va.original)
        val_source, val_split = "val split", "val"
    else:
        rng = np.random.default_rng(derive_seed(run.seed, "holdout", spec.name))
        hold = holdout_patients(tr.patient, cfg.val_fraction, rng)
        va, tr = tr.subset(hold), tr.subset(~hold)
        val_source = f"held-out {cfg.val_fraction:.0%} of train patients (no val split)"
        val_split = "train"
    te_all = load_targets(build, spec, "test", cache.keys(level, "test"))
    te, te_mirror = te_all.subset(te_all.original), te_all.subset(te_all.is_mirror)
    te_flipped = None if te_all.is_flipped is None else te_all.subset(te_all.flipped)
    if len(tr) == 0 or len(te) == 0:
        why = no_lesions(build.manifest, spec.name)
        raise ProbeUnavailable(f"{run.features}: {spec.name}: {why}; build {build.root}" if why else
                               f"{run.features}: {spec.name} has no train or no test items in build {build.root}")
    return Splits(tr, va, te, te_mirror, val_source, val_split, te_flipped)


def open_run(run):
    """The cache and build of ``run``, checked: the level, its splits and its shards' bytes."""
    cache = open_cache(run.features)
    cache.check_probe(run.spec.name)
    build = resolve_build(cache, run.data)
    level = run.spec.level
    if level not in cache.levels():
        raise missing_level(f"{run.features}: cache", level, cache.levels())
    splits = cache.splits(level)
    if "train" not in splits or "test" not in splits:
        raise ConfigError(f"{run.features}: {level} needs train and test splits, cache has {splits}")
    check_shards(build, level)
    return cache, build


class BuildKeys:
    """A build seen through the two methods of a feature cache that target loading uses.

    ``load_targets(build, spec, split, BuildKeys(build).keys(level, split))`` maps every
    item to its row of the split: image rows instead of cache rows.
    """

    def __init__(self, build):
        self.build = build

    def splits(self, level: str) -> list[str]:
        return self.build.splits(level)

    def keys(self, level: str, split: str) -> np.ndarray:
        return self.build.read(level, split, ["key"])["key"]


def build_splits(build, run) -> Splits:
    """:func:`split_targets` on a build's image rows (a run that reads images, not a cache:
    finetuning, an MLLM, a reference predictor); the level and its splits checked first."""
    level = run.spec.level
    if level not in build.levels():
        raise missing_level(f"{build.root}: build", level, build.levels())
    if not {"train", "test"} <= set(build.splits(level)):
        raise ConfigError(f"{build.root}: {level} needs train and test splits, has {build.splits(level)}")
    return split_targets(build, BuildKeys(build), run)
