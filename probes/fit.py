"""``spar-probe fit`` and ``spar-probe eval``: train probe heads on cached features, score them.

One run = one :class:`~spar_bench.probes.runspec.RunSpec` (cache, probe, head and its
options, train config, seed). Its directory
``OUT/<encoder>[-random-init]/<probe>/<head>[,<options>]/seed<k>/`` holds:

* ``config.json``  - the run spec (``"run"``), the resolved head and train configs, seeds,
  package versions, cache file name + fingerprint, build folder name + fingerprint
  (never an absolute path), ``random_init``;
* ``metrics.json`` - every metric the probe spec declares, on ORIGINAL test samples with
  95 % patient-bootstrap CIs, controls (chance, majority, the prior, the blind baseline),
  the same metrics on the mirrored counterfactual test samples (when the build has them),
  training curve summary;
* ``head.pt``      - the trained head (``state_dict`` + config + the fitted prior).

Heads train on original (non-mirrored) samples by default; validation is the cache's
``val`` split, or, when it has none, a seeded 15 % of training patients (recorded as
``val_source``). The blind baseline is the same head trained on the question alone:
image features replaced by zeros (one zero token for token heads).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import click
import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import RUN_PACKAGES, json_safe, package_versions, protocol_versions

from .runspec import OPTIONS, RunSpec, check_device, differences, make_run
from .tasks import get_probe, probe_names

METRICS_FILE = "metrics.json"


# --------------------------------------------------------------------------- inputs
def open_cache(path: str | Path):
    """Open a feature cache (``spar_bench.probes.features.FeatureCache``) with a clear error."""
    from .features import FeatureCache

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
    if hasattr(cache, "check_matches"):
        cache.check_matches(build)
    return build


def check_shards(build, level: str) -> None:
    """Re-hash the shards of ``level`` against the build's manifest (targets are read from them).

    The fingerprint the cache checks covers the manifest, not the bytes on disk: a shard
    edited after the build (answers changed, say) is caught here.
    """
    from spar_bench.errors import IntegrityError
    from spar_bench.hashing import sha256_file

    for entries in build.manifest["shards"].get(level, {}).values():
        for e in entries:
            p = Path(build.root) / e["path"]
            if p.is_file() and sha256_file(p) != e["sha256"]:
                raise IntegrityError(
                    f"{p}: sha256 differs from {Path(build.root) / 'manifest.json'}; the shard was "
                    "changed after the build - rebuild it (`spar-build verify` lists every change)"
                )


def encoder_slug(cache) -> str:
    """Run-directory name of a cache's encoder (``-random-init`` appended when so); a local
    path recorded by an older cache is replaced by its base name + hash (``published_name``).

    Weights from a local file or folder add their hash (``timm:resnet50 --weights a.pt`` and
    ``--weights b.pt`` are two encoders: their runs never share a folder). A cache whose
    Levels 1-2 were encoded tile by tile (``cache --tile-encoding per-tile``) adds ``-per-tile``,
    and one whose tokens were reduced (``--token-grid/--token-proj/--token-int8``) adds
    :meth:`TokenStorage.slug`.
    """
    from .encoders.base import published_name
    from .token_storage import TokenStorage

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


def _finite(x: np.ndarray, cache, level: str, split: str, layer: int) -> np.ndarray:
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
        return _finite(x, cache, level, split, layer)
    n = len(cache.keys(level, split))
    parts = []
    for s in range(0, n, 1024):
        tok = cache.tokens(level, split, layer=layer, rows=np.arange(s, min(s + 1024, n)))
        tok = _finite(np.asarray(tok, np.float32), cache, level, split, layer)
        parts.append(head.preproject(tok) if head is not None else tok)
    if not parts:
        raise ConfigError(f"{cache.path}: {level}/{split} has no rows")
    return np.concatenate(parts)


# --------------------------------------------------------------------------- scoring
def score(t, pred: np.ndarray, rng: np.random.Generator | None, n_boot: int, prior: dict | None = None) -> dict:
    """Every metric the probe declares, of ``pred`` on ``t``; CIs (over patients) when ``rng``.

    With the run's ``prior`` (fitted on train), a Level 3 score also holds ``conflict``: the
    same ``pred`` on the items whose answer differs from the prior's (``ProbeSpec.conflict``).
    """
    out = t.spec.score(t, pred, rng, n_boot)
    conflict = t.spec.conflict(prior, t, pred, rng, n_boot) if len(t) else None
    if conflict is not None:
        out["conflict"] = conflict
    return out


class ProbeUnavailable(ConfigError):
    """The build has no items of this probe (e.g. counting without lesion masks)."""


def _blind(t):
    """The same items with every feature row pointing at a single all-zero row."""
    b = t.subset(np.arange(len(t)))
    b.rows = np.zeros(len(t), dtype=np.int64)
    return b


# --------------------------------------------------------------------------- one run
class Splits(NamedTuple):
    """The targets of one run and where its validation items came from."""

    tr: Any
    va: Any
    te: Any
    te_mirror: Any
    val_source: str
    val_split: str  # the cache split the validation features are read from


def _split_targets(build, cache, run: RunSpec) -> Splits:
    """Train / validation / test targets aligned to the cache.

    Without a val split, a patient-grouped fraction of train is held out (seeded);
    mirrored samples are evaluated separately and trained on only with ``train_mirrors``.
    """
    from spar_bench.seeding import derive_seed

    from .targets import holdout_patients, load_targets

    spec, cfg = run.spec, run.train
    level = spec.level
    tr_all = load_targets(build, spec, "train", cache.keys(level, "train"))
    tr = tr_all if run.train_mirrors else tr_all.subset(~tr_all.is_mirror)
    if "val" in cache.splits(level):
        va = load_targets(build, spec, "val", cache.keys(level, "val"))
        va = va.subset(~va.is_mirror)
        val_source, val_split = "val split", "val"
    else:
        rng = np.random.default_rng(derive_seed(run.seed, "holdout", spec.name))
        hold = holdout_patients(tr.patient, cfg.val_fraction, rng)
        va, tr = tr.subset(hold), tr.subset(~hold)
        val_source = f"held-out {cfg.val_fraction:.0%} of train patients (no val split)"
        val_split = "train"
    te_all = load_targets(build, spec, "test", cache.keys(level, "test"))
    te, te_mirror = te_all.subset(~te_all.is_mirror), te_all.subset(te_all.is_mirror)
    if len(tr) == 0 or len(te) == 0:
        raise ProbeUnavailable(
            f"{run.features}: {spec.name} has no train or no test items in build {build.root}"
        )
    return Splits(tr, va, te, te_mirror, val_source, val_split)


def _new_head(cache, run: RunSpec, kind: str):
    """A seeded head sized from the cache; token heads get their fixed PCA projection."""
    from spar_bench.seeding import derive_seed

    from .heads import build_head
    from .train import seeded

    level, layer, seed = run.spec.level, run.layer, run.seed
    first = (
        np.asarray(cache.pooled(level, "train", layer=layer)[:1])
        if kind == "pooled"
        else np.asarray(cache.tokens(level, "train", layer=layer, rows=np.arange(1)))
    )
    in_dim, n_tokens = int(first.shape[-1]), (int(first.shape[1]) if kind == "tokens" else 1)
    model = seeded(lambda: build_head(run.head, run.spec, in_dim, n_tokens, **run.head_config), seed)
    if kind == "tokens":
        rng = np.random.default_rng(derive_seed(seed, "projection", run.probe))
        n = len(cache.keys(level, "train"))
        rows = np.sort(rng.choice(n, size=min(n, max(1, 50000 // n_tokens)), replace=False))
        sample = np.asarray(cache.tokens(level, "train", layer=layer, rows=rows), np.float32)
        model.fit_projection(_finite(sample, cache, level, "train", layer).reshape(-1, in_dim))
    return model, in_dim, n_tokens


def _controls(run: RunSpec, model, dims: tuple[int, int], s: Splits, prior: dict, boot, blind=None) -> dict:
    """Chance, majority, the prior (input-free optimum) and the blind baseline (same head, no image).

    ``blind``: the blind head already trained (a batch trains them together), or None.
    """
    from .train import predict, train_head

    spec, n_boot = run.spec, run.n_boot
    majority = spec.majority(s.tr)
    ctrl: dict[str, Any] = {"chance": spec.chance(s.te)}
    if majority is not None:
        ctrl["majority_class"] = majority
        ctrl["majority"] = spec.majority_rate(majority, s.te)
    ctrl["prior"] = score(s.te, spec.prior_predict(prior, s.te), boot("prior"), n_boot, prior)
    if len(s.te_mirror):
        pred = spec.prior_predict(prior, s.te_mirror)
        ctrl["prior_mirror"] = score(s.te_mirror, pred, boot("prior-mirror"), n_boot, prior)
    if not run.controls:
        return ctrl
    zero = blind_inputs(run, model, dims)
    if blind is None:
        blind = new_blind(run, model, dims)
        train_head(blind, (zero, _blind(s.tr)), (zero, _blind(s.va)), run.train, run.seed, progress=False)
    ctrl["blind"] = score(s.te, predict(blind, zero, _blind(s.te)), boot("blind"), n_boot, prior)
    if len(s.te_mirror):
        pred = predict(blind, zero, _blind(s.te_mirror))
        ctrl["blind_mirror"] = score(s.te_mirror, pred, boot("blind-mirror"), n_boot, prior)
    return ctrl


RUN_FILES = frozenset({"config.json", "head.pt", METRICS_FILE, METRICS_FILE + ".tmp"})


def owned_run(rd: Path) -> set[str] | None:
    """The files of an earlier run in ``rd``, or None if ``rd`` is not a run folder."""
    try:
        config = json.loads((Path(rd) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not {"probe", "head", "seed"} <= set(config):
        return None
    return set(RUN_FILES) | {p.name for p in Path(rd).glob("eval-*.json")}


def finished_run(run: RunSpec, rd: Path, cache_fingerprint: str, grid_prune: int = 0,
                 replace: str = "delete that folder") -> bool:
    """Whether ``rd`` holds a finished run of ``run`` on a cache of the build ``cache_fingerprint``; one
    finished with other options (``--bootstrap`` and ``--no-controls`` included), or on another
    cache, is an error (``replace``: how the command replaces it); so is a run pruned by
    ``--grid-prune K`` when the sweep asks for another ``grid_prune`` (0: a full run).

    A folder's name holds only the options that differ from their defaults, so a run
    finished under other defaults (an older spar-bench) sits where ``run`` would write; so
    does the same encoder's run on another build. Skipping it would report the old run as
    this one.
    """
    from .heads import head_defaults

    if not (rd / METRICS_FILE).is_file():
        return False
    try:
        cfg = json.loads((rd / "config.json").read_text(encoding="utf-8"))
        had = {**cfg["head_config"], **cfg["run"]["train"], **{k: cfg["run"].get(k) for k in ("controls", "n_boot")}}
        old_cache = cfg["cache_fingerprint"]
        pruned = json.loads((rd / METRICS_FILE).read_text(encoding="utf-8"))["train"].get("pruned_at")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{rd}: a finished run with an unreadable config.json or metrics.json ({e}); delete the folder to rerun it") from None
    if old_cache != cache_fingerprint:
        raise ConfigError(f"{rd}: finished on a feature cache of another build ({cfg.get('features')}, build "
                          f"fingerprint {str(old_cache)[:12]}; this cache's {cache_fingerprint[:12]}); "
                          f"write to a new --out, or {replace} to rerun it")  # fmt: skip
    if pruned is not None and pruned != grid_prune:
        asked = f"--grid-prune {grid_prune}" if grid_prune else "a full run"
        raise ConfigError(f"{rd}: pruned after epoch {pruned} (--grid-prune {pruned}) and this sweep asks for "
                          f"{asked}; rerun with --grid-prune {pruned}, or delete the folder to train it")  # fmt: skip
    want = json.loads(json.dumps(json_safe({**head_defaults(run.head), **run.head_config, **run.train.to_dict(),
                                            "controls": run.controls, "n_boot": run.n_boot})))
    diff = differences({k: v for k, v in had.items() if k != "device"}, {k: v for k, v in want.items() if k != "device"})
    if diff:
        raise ConfigError(f"{rd}: finished with {', '.join(diff)} (other options, or defaults changed since); "
                          f"write to a new --out, or {replace} to rerun it")  # fmt: skip
    return True


def _write_run(rd: Path, config: dict, metrics: dict, model, prior: dict | None = None) -> None:
    """config.json, head.pt, then metrics.json last: its presence marks a finished run."""
    from spar_bench.outputs import check_target, claim, remove, save_torch, write_bytes

    check_target(rd)
    if claim(rd, overwrite=True, owned=owned_run, what="run folder"):
        remove(rd)  # an earlier run of the same spec is replaced whole
    rd.mkdir(parents=True, exist_ok=True)
    write_bytes(rd / "config.json", json.dumps(json_safe(config), indent=2, default=str) + "\n")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    save_torch({"state_dict": state, "config": config, "prior": prior}, rd / "head.pt")
    tmp = rd / (METRICS_FILE + ".tmp")
    tmp.write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    tmp.replace(rd / METRICS_FILE)


def _open_run(run: RunSpec):
    """The cache and build of ``run``, checked: the level, its splits and its shards' bytes."""
    cache = open_cache(run.features)
    build = resolve_build(cache, run.data)
    level = run.spec.level
    if level not in cache.levels():
        raise ConfigError(f"{run.features}: cache has no {level}; levels: {', '.join(cache.levels())}")
    splits = cache.splits(level)
    if "train" not in splits or "test" not in splits:
        raise ConfigError(f"{run.features}: {level} needs train and test splits, cache has {splits}")
    check_shards(build, level)
    return cache, build


class Prepared(NamedTuple):
    """What a run trains on: its cache and build, targets, seeded head and features per split."""

    cache: Any
    build: Any
    splits: Splits
    model: Any
    dims: tuple[int, int]
    feats: dict[str, np.ndarray]


def prepare_run(run: RunSpec) -> Prepared:
    """Open and check the run's cache and build; its targets, seeded head and features."""
    from .heads import head_input

    kind = head_input(run.head)
    cache, build = _open_run(run)
    s = _split_targets(build, cache, run)
    model, in_dim, n_tokens = _new_head(cache, run, kind)
    feats = {sp: load_features(cache, kind, run.spec.level, sp, run.layer, model)
             for sp in dict.fromkeys(("train", s.val_split, "test"))}  # fmt: skip
    return Prepared(cache, build, s, model, (in_dim, n_tokens), feats)


def run_fit(run: RunSpec, out: str | Path, progress: bool = True, overwrite: bool = False) -> Path:
    """Train and score the head of ``run``; write the run directory; return its path.

    A run finished with the same spec is kept (nothing is trained), one with other options is
    refused (:func:`finished_run`); ``overwrite`` trains it again and replaces it.
    """
    from .train import train_head

    if not overwrite:
        with open_cache(run.features) as cache:
            rd = run.run_dir(out, encoder_slug(cache))
            if finished_run(run, rd, cache.fingerprint, replace="pass --overwrite"):
                click.echo(f"{rd}: finished earlier with these options; kept (--overwrite trains it again)", err=True)
                return rd
    p = prepare_run(run)
    s = p.splits
    result = train_head(p.model, (p.feats["train"], s.tr), (p.feats[s.val_split], s.va), run.train,
                        run.seed, progress=progress)  # fmt: skip
    return finish_run(run, p, result, out)


def finish_run(run: RunSpec, p: Prepared, result, out: str | Path, blind=None, batch: dict | None = None) -> Path:
    """Score a trained run (test, mirrored, controls) and write its folder.

    ``blind``: the run's blind-baseline head, already trained (a batch trains them
    together); None trains it here. ``batch`` records the runs it was trained with.
    """
    from spar_bench.seeding import derive_seed

    from .train import predict

    spec, cache, s, model, feats = run.spec, p.cache, p.splits, p.model, p.feats
    boot = lambda tag: np.random.default_rng(derive_seed(run.seed, "bootstrap", run.probe, run.head, tag))  # noqa: E731
    prior = spec.fit_prior(s.tr)
    metrics: dict[str, Any] = {
        "probe": run.probe, "head": run.head, "variant": run.variant(), "seed": run.seed,
        "encoder": encoder_slug(cache), "random_init": bool(cache.random_init), "layer": run.layer,
        "headline": spec.headline, "higher_is_better": spec.higher_is_better,
        "val_source": s.val_source,
        "n_items": {"train": len(s.tr), "val": len(s.va), "test": len(s.te), "test_mirror": len(s.te_mirror)},
        "n_patients": {"train": int(np.unique(s.tr.patient).size), "test": int(np.unique(s.te.patient).size)},
        "train": {**{k: getattr(result, k) for k in ("epochs_run", "best_epoch", "best_val_loss")},
                  "stopped_by": result.stopped_by(run.train.patience),
                  **getattr(result, "pruned", {})},  # pruned_at: stopped by `sweep --grid-prune`
        "test": score(s.te, predict(model, feats["test"], s.te), boot("test"), run.n_boot, prior),
        "mirror": score(s.te_mirror, predict(model, feats["test"], s.te_mirror), boot("mirror"), run.n_boot,
                        prior) if len(s.te_mirror) else None,
        "controls": _controls(run, model, p.dims, s, prior, boot, blind),
        "training": (cache.meta.get("weights") or {}).get("training")
        if isinstance(cache.meta.get("weights"), dict) else None,  # a `finetune` export probed frozen
        **protocol_versions(p.build.manifest),
    }  # fmt: skip
    config = _run_config(run, cache, p.build, model, p.dims)
    if batch is not None:
        metrics["batch"] = config["batch"] = batch
    rd = run.run_dir(out, encoder_slug(cache))
    _write_run(rd, config, metrics, model, prior)
    return rd


def new_blind(run: RunSpec, model, dims: tuple[int, int]):
    """The blind-baseline head of a run: its seeded head, with the real head's fixed projection."""
    from .heads import build_head, head_input
    from .train import seeded

    blind = seeded(lambda: build_head(run.head, run.spec, *dims, **run.head_config), run.seed)
    if head_input(run.head) == "tokens":  # the same fixed projection as the real head
        proj = {k: v for k, v in model.state_dict().items() if k.startswith("proj_")}
        blind.load_state_dict({**blind.state_dict(), **proj})
    return blind


def blind_inputs(run: RunSpec, model, dims: tuple[int, int]) -> np.ndarray:
    """The one all-zero feature row every blind item reads."""
    from .heads import head_input

    pooled = head_input(run.head) == "pooled"
    return np.zeros((1, dims[0]) if pooled else (1, 1, model.proj_dim), np.float32)


def _run_config(run: RunSpec, cache, build, model, dims: tuple[int, int]) -> dict[str, Any]:
    """What ``config.json`` records: the run spec, then what it resolved to and ran with."""
    from spar_bench.seeding import derive_seed

    from .encoders.base import published_name
    from .heads import head_input

    return {
        "probe": run.probe,
        "head": run.head,
        "seed": run.seed,
        # paths by name only (no local path in anything publishable; eval needs neither)
        "run": {**run.to_dict(), "features": Path(run.features).name,
                "data": Path(run.data).name if run.data else None},
        "variant": run.variant(),
        "probe_spec": run.spec.describe(),
        "seeds": {"torch": run.seed, "bootstrap": [derive_seed(run.seed, "bootstrap", run.probe, run.head, "test")]},
        # names + fingerprints, never absolute paths (eval and report need neither path)
        "features": Path(run.features).name,
        "cache_fingerprint": cache.fingerprint,
        "dataset_dir": Path(build.root).resolve().name,
        "dataset_fingerprint": build.fingerprint,
        "encoder": published_name(str(cache.meta["encoder"]), cache.meta.get("weights"))
        if cache.meta.get("encoder") else None,
        "random_init": bool(cache.random_init),
        "head_input": head_input(run.head),
        "head_config": model.cfg if hasattr(model, "cfg") else {},
        "in_dim": dims[0],
        "n_tokens": dims[1],
        "train_config": run.train.to_dict(),
        **protocol_versions(build.manifest),
        "versions": package_versions(RUN_PACKAGES),
    }  # fmt: skip


# --------------------------------------------------------------------------- eval (transfer)
def load_run(rd: Path):
    """``(run spec, head config dict, prior, model)`` of a finished run directory; one-line errors."""
    import torch

    from .heads import build_head

    if not (rd / "head.pt").is_file() or not (rd / METRICS_FILE).is_file():
        raise ConfigError(f"{rd}: not a finished run directory (needs head.pt and metrics.json)")
    try:
        saved = torch.load(rd / "head.pt", map_location="cpu", weights_only=False)
        c = saved["config"]
        run = RunSpec.from_dict(c["run"])
        model = build_head(run.head, run.spec, c["in_dim"], c["n_tokens"], **c["head_config"])
        model.load_state_dict(saved["state_dict"])
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable or foreign head.pt is one line
        raise ConfigError(
            f"{rd / 'head.pt'}: unreadable trained head ({type(e).__name__}: {str(e)[:120]}); "
            "re-run `spar-probe fit` for this run"
        ) from None
    return run, c, saved.get("prior"), model


def kept_eval(out: Path, inputs: dict[str, Any], overwrite: bool) -> bool:
    """True when ``out`` (an ``eval-*.json``) holds this evaluation already: the same ``inputs``
    (kept as it is). One of other inputs is refused in one line unless ``overwrite``."""
    if overwrite or not out.is_file():
        return False
    try:
        had = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        had = None
    diff = differences({k: had.get(k) for k in inputs} if isinstance(had, dict) else {}, inputs)
    if diff:
        raise ConfigError(f"{out}: an evaluation of other inputs ({', '.join(diff)}); pass --overwrite "
                          "to replace it")  # fmt: skip
    click.echo(f"{out}: evaluated earlier with these inputs; kept (--overwrite evaluates it again)", err=True)
    return True


def run_eval(
    run: str | Path, features: str | Path, data: str | Path | None = None, n_boot: int = 1000,
    overwrite: bool = False,
) -> Path:
    """Score a trained run on another cache without retraining; write ``eval-<cache>.json``
    (kept when it holds this evaluation, refused when another, unless ``overwrite``)."""
    from spar_bench.seeding import derive_seed

    from .targets import concat, load_targets
    from .train import predict

    rd = Path(run)
    spec_run, c, prior, model = load_run(rd)
    spec = spec_run.spec
    trained = json.loads((rd / METRICS_FILE).read_text())
    majority = (trained.get("controls") or {}).get("majority_class")
    cache = open_cache(features)
    out = rd / f"eval-{Path(features).stem}.json"
    inputs = {"features": Path(features).name, "cache_fingerprint": cache.fingerprint,
              "encoder": encoder_slug(cache), "n_bootstrap": n_boot}  # fmt: skip
    if kept_eval(out, inputs, overwrite):
        return out
    build = resolve_build(cache, data)
    level = spec.level
    if level not in cache.levels():
        raise ConfigError(f"{features}: cache has no {level}; levels: {', '.join(cache.levels())}")
    check_shards(build, level)
    splits = ["test"] if "test" in cache.splits(level) else cache.splits(level)
    tests, preds = [], []
    for split in splits:
        t = load_targets(build, spec, split, cache.keys(level, split))
        f = load_features(cache, c["head_input"], level, split, spec_run.layer, model)
        if f.shape[-1] != (model.proj_dim if c["head_input"] == "tokens" else c["in_dim"]):
            raise ConfigError(
                f"{features}: feature width {f.shape[-1]} does not match run {rd} ({c['in_dim']})"
            )
        if c["head_input"] == "tokens" and f.shape[1] != c.get("n_tokens", f.shape[1]):  # e.g. per-tile vs mosaic
            raise ConfigError(f"{features}: {f.shape[1]} tokens per item (tile encoding "
                              f"{cache.tile_encoding}) but run {rd} was trained on {c['n_tokens']}")
        tests.append(t)
        preds.append(predict(model, f, t))
    t, p = concat(tests), np.concatenate(preds)
    rng = lambda tag: np.random.default_rng(derive_seed(spec_run.seed, "bootstrap", "eval", tag))  # noqa: E731
    orig, mir = t.subset(~t.is_mirror), t.subset(t.is_mirror)
    result: dict[str, Any] = {
        "run": "/".join(rd.resolve().parts[-4:]),  # <encoder>/<probe>/<head>/seed<k>
        "features": Path(features).name, "cache_fingerprint": cache.fingerprint,
        "encoder": encoder_slug(cache), "random_init": bool(cache.random_init), "splits": splits,
        "probe": spec.name, "head": spec_run.head, "variant": spec_run.variant(), "seed": spec_run.seed,
        "n_bootstrap": n_boot,
        "test": score(orig, p[~t.is_mirror], rng("test"), n_boot, prior),
        "mirror": score(mir, p[t.is_mirror], rng("mirror"), n_boot, prior) if len(mir) else None,
        "controls": {"chance": spec.chance(orig), "majority": spec.majority_rate(majority, orig)},
    }  # fmt: skip
    if prior is not None:
        result["controls"]["prior"] = score(orig, spec.prior_predict(prior, orig), rng("prior"), n_boot, prior)
    out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    return out


# --------------------------------------------------------------------------- CLI
def parse_probes(text: tuple[str, ...] | str) -> list[str]:
    """``all``, or probe names (comma-separated or repeated); validated against the probe specs."""
    items = [text] if isinstance(text, str) else list(text)
    names = [p.strip() for item in items for p in item.split(",") if p.strip()]
    if not names or "all" in names:
        return probe_names()
    for n in names:
        get_probe(n)
    return names


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    return seeds


def run_options(f):
    """The options every run takes, shared by ``fit`` and ``sweep`` (one per :data:`OPTIONS`)."""
    from .runspec import option_help

    for opt in reversed(list(OPTIONS.values())):
        flag = f"--{opt.name.replace('_', '-')}"
        if opt.type is bool:
            f = click.option(flag, opt.name, is_flag=True, default=None, help=option_help(opt))(f)
        else:
            f = click.option(flag, opt.name, type=opt.type, default=None, help=option_help(opt))(f)
    f = click.option("--data", default=None, type=click.Path(file_okay=False),
                     help="Build dir (default: the cache's dataset_dir).")(f)  # fmt: skip
    f = click.option("--bootstrap", "n_boot", default=1000, show_default=True, type=int,
                     help="Bootstrap replicates.")(f)  # fmt: skip
    f = click.option("--no-controls", is_flag=True, help="Skip the blind baseline (faster).")(f)
    f = click.option("--preset", default=None, metavar="NAME",
                     help="Fill the options not given from a named preset: paper (docs/PROTOCOL.md "
                          "§12); explicit options win, and each run records both.")(f)  # fmt: skip
    f = click.option("--device", default="cpu", show_default=True,
                     help="Where heads train: cpu, or cuda[:N] (heads are light; the Level 1-2 "
                          "transformer gains most).")(f)  # fmt: skip
    return click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
                        help="torch CPU threads per run (the same metrics either way).")(f)  # fmt: skip


def apply_preset(params: dict[str, Any]) -> tuple[dict[str, Any], dict | None]:
    """``--preset`` (popped from ``params``): the command's parameters with the preset's values
    where none was given on the command line, and the preset's record (None without one)."""
    name = params.pop("preset", None)
    if not name:
        return params, None
    from spar_bench.presets import apply_probe_preset, explicit_options

    return apply_probe_preset(name, params, explicit_options(click.get_current_context()))


def with_preset(run: RunSpec, record: dict | None) -> RunSpec:
    """``run`` marked with the preset that filled its options (recorded in config.json's ``run``)."""
    if record is None:
        return run
    return run.replace(preset=record["name"], preset_overridden=tuple(record["overridden"]))


def pop_run_options(kw: dict) -> dict[str, Any]:
    """The :data:`OPTIONS` values among click's keyword arguments (removed from ``kw``)."""
    return {name: kw.pop(name) for name in OPTIONS}


@click.command("fit")
@click.option(
    "--features", required=True, type=click.Path(dir_okay=False), help="Feature cache (.h5)."
)
@click.option(
    "--head", default="mlp", show_default=True, help="linear, mlp, attnpool or transformer."
)
@click.option(
    "--probe", "probe", multiple=True, default=("all",), show_default=True, help="Probe name(s) or 'all'."
)
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds.")
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False))
@click.option("--overwrite", is_flag=True, help="Train a finished run again and replace it (else it is kept).")
@run_options
def fit_command(features, head, probe, seeds, out, overwrite, data, n_boot, no_controls, device, threads, **kw):
    """Train a probe head on cached features and score it (one run per probe x seed)."""
    import torch

    kw, preset = apply_preset({"seeds": seeds, **kw})
    seeds = kw.pop("seeds")
    options = pop_run_options(kw)
    check_device(device)
    probes = parse_probes(probe)
    runs = [[with_preset(make_run(features, p, head, s, options, data=data, controls=not no_controls,
                                  n_boot=n_boot, device=device), preset) for s in parse_seeds(seeds)]
            for p in probes]  # fmt: skip
    torch.set_num_threads(threads)
    explicit = all(p.strip() != "all" for item in probe for p in item.split(","))
    for per_probe in runs:
        for run in per_probe:
            try:
                rd = run_fit(run, out, overwrite=overwrite)
            except ProbeUnavailable as e:
                if explicit:
                    raise
                click.echo(f"{run.probe}: not available on this build ({e}); skipped", err=True)
                break
            m = json.loads((rd / METRICS_FILE).read_text())
            key = m["headline"]
            click.echo(f"{run.probe} {head} seed{run.seed}: {key}={_fmt(m['test'].get(key))} -> {rd}")


@click.command("eval")
@click.option(
    "--run",
    "run",
    required=True,
    type=click.Path(file_okay=False),
    help="A finished run directory.",
)
@click.option(
    "--features", default=None, type=click.Path(dir_okay=False),
    help="Another feature cache (a finetune run may instead re-encode --data's images).",
)
@click.option(
    "--data",
    default=None,
    type=click.Path(file_okay=False),
    help="Its build (default: cache's dataset_dir).",
)
@click.option("--bootstrap", "n_boot", default=1000, show_default=True, type=click.IntRange(1))
@click.option("--encoder", default=None,
              help="Re-encoding a finetune run of a local model: its path again (hf:DIR, open_clip:local-dir:DIR).")
@click.option("--overwrite", is_flag=True, help="Replace an evaluation of other inputs (else it is refused).")
def eval_command(run, features, data, n_boot, encoder, overwrite):
    """Score a trained head on another cache (transfer), without retraining.

    A ``spar-probe finetune`` run given ``--data`` and no ``--features`` re-encodes that
    build's images with its own trained encoder (a local model's path, which runs do not
    record, is given again with ``--encoder``).
    """
    if features is None:
        from .finetune.run import EXPORT_FILE, run_eval_reencoded

        if data is None or not (Path(run) / EXPORT_FILE).is_file():
            raise ConfigError(
                "--features is required (re-encoding with --data alone needs a `spar-probe finetune` "
                f"run holding {EXPORT_FILE})"
            )
        out = run_eval_reencoded(run, data, n_boot, encoder=encoder, overwrite=overwrite)
        m = json.loads(out.read_text())
        key = get_probe(m["probe"]).headline
        click.echo(f"{m['probe']} {m['head']} on {m['data']} (re-encoded): {key}={_fmt(m['test'].get(key))} -> {out}")
        return
    out = run_eval(run, features, data, n_boot, overwrite=overwrite)
    m = json.loads(out.read_text())
    key = get_probe(m["probe"]).headline
    click.echo(
        f"{m['probe']} {m['head']} on {Path(features).name}: {key}={_fmt(m['test'].get(key))} -> {out}"
    )


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"
