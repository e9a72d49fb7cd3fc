"""``spar-probe fit`` and ``spar-probe eval``: train probe heads on cached features, score them.

One run = one (cache, probe, head, seed). Its directory
``OUT/<encoder>[-random-init]/<probe>/<head>/seed<k>/`` holds:

* ``config.json``  - the options, train config, head config, seeds, package versions,
  cache file name + fingerprint, build folder name + fingerprint (never an absolute
  path), layer, ``random_init``;
* ``metrics.json`` - test metrics on ORIGINAL samples with 95 % patient-bootstrap CIs,
  controls (chance, majority, the prior, blind baseline), metrics on the mirrored
  counterfactual test samples (when the build has them), training curve summary;
* ``head.pt``      - the trained head (``state_dict`` + what is needed to rebuild it).

Heads train on original (non-mirrored) samples by default; validation is the cache's
``val`` split, or, when it has none, a seeded 15 % of training patients (recorded as
``val_source``). The blind baseline is the same head trained on the question alone:
image features replaced by zeros (one zero token for token heads).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import RUN_PACKAGES, json_safe, package_versions

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


def encoder_slug(cache) -> str:
    """Run-directory name of a cache's encoder (``-random-init`` appended when so)."""
    name = str(cache.meta.get("encoder") or Path(cache.path).stem)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "encoder"
    weights = cache.meta.get("weights")
    training = weights.get("training") if isinstance(weights, dict) else None
    if isinstance(training, dict):  # an encoder trained by `spar-probe finetune`, probed frozen
        trained = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{training.get('mode')}-{training.get('build')}")
        slug += f"-{trained}-frozen"
    return slug + ("-random-init" if cache.random_init else "")


def load_features(
    cache, input_kind: str, level: str, split: str, layer: int, head=None
) -> np.ndarray:
    """Pooled ``(N, D)`` float32, or tokens ``(N, T, k)`` pre-projected by ``head``."""
    if input_kind == "pooled":
        return np.asarray(cache.pooled(level, split, layer=layer), dtype=np.float32)
    n = len(cache.keys(level, split))
    parts = []
    for s in range(0, n, 1024):
        tok = cache.tokens(level, split, layer=layer, rows=np.arange(s, min(s + 1024, n)))
        parts.append(head.preproject(tok) if head is not None else np.asarray(tok, np.float32))
    if not parts:
        raise ConfigError(f"{cache.path}: {level}/{split} has no rows")
    return np.concatenate(parts)


# --------------------------------------------------------------------------- scoring
def score(t, pred: np.ndarray, rng: np.random.Generator | None, n_boot: int) -> dict:
    """Every metric the probe declares, of ``pred`` on ``t``; CIs (over patients) when ``rng``."""
    return t.spec.score(t, pred, rng, n_boot)


class ProbeUnavailable(ConfigError):
    """The build has no items of this probe (e.g. counting without lesion masks)."""


def _blind(t):
    """The same items with every feature row pointing at a single all-zero row."""
    b = t.subset(np.arange(len(t)))
    b.rows = np.zeros(len(t), dtype=np.int64)
    return b


# --------------------------------------------------------------------------- one run
def run_dir(out: str | Path, cache, probe: str, head: str, seed: int) -> Path:
    return Path(out) / encoder_slug(cache) / probe / head / f"seed{seed}"


def _split_targets(build, cache, spec, features, seed: int, cfg, train_mirrors: bool):
    """Train / validation / test targets aligned to the cache, and where validation came from.

    Returns ``(tr, va, te, te_mirror, val_source, val_split)``. Without a val split, a
    patient-grouped fraction of train is held out (seeded); mirrored samples are evaluated
    separately and trained on only with ``train_mirrors``.
    """
    from spar_bench.seeding import derive_seed

    from .targets import holdout_patients, load_targets

    level, probe = spec.level, spec.name
    splits = cache.splits(level)
    tr_all = load_targets(build, spec, "train", cache.keys(level, "train"))
    tr = tr_all if train_mirrors else tr_all.subset(~tr_all.is_mirror)
    if "val" in splits:
        va = load_targets(build, spec, "val", cache.keys(level, "val"))
        va = va.subset(~va.is_mirror)
        val_source, val_split = "val split", "val"
    else:
        hold = holdout_patients(
            tr.patient, cfg.val_fraction, np.random.default_rng(derive_seed(seed, "holdout", probe))
        )
        va, tr = tr.subset(hold), tr.subset(~hold)
        val_source = f"held-out {cfg.val_fraction:.0%} of train patients (no val split)"
        val_split = "train"
    te_all = load_targets(build, spec, "test", cache.keys(level, "test"))
    te, te_mirror = te_all.subset(~te_all.is_mirror), te_all.subset(te_all.is_mirror)
    if len(tr) == 0 or len(te) == 0:
        raise ProbeUnavailable(
            f"{features}: {probe} has no train or no test items in build {build.root}"
        )
    return tr, va, te, te_mirror, val_source, val_split


def _new_head(cache, head: str, spec, kind: str, layer: int, seed: int, head_cfg: dict):
    """A seeded head sized from the cache; token heads get their fixed PCA projection."""
    from spar_bench.seeding import derive_seed

    from .heads import build_head
    from .train import seeded

    level = spec.level
    first = (
        np.asarray(cache.pooled(level, "train", layer=layer)[:1])
        if kind == "pooled"
        else np.asarray(cache.tokens(level, "train", layer=layer, rows=np.arange(1)))
    )
    in_dim, n_tokens = int(first.shape[-1]), (int(first.shape[1]) if kind == "tokens" else 1)
    model = seeded(lambda: build_head(head, spec, in_dim, n_tokens, **head_cfg), seed)
    if kind == "tokens":
        rng = np.random.default_rng(derive_seed(seed, "projection", spec.name))
        n = len(cache.keys(level, "train"))
        rows = np.sort(rng.choice(n, size=min(n, max(1, 50000 // n_tokens)), replace=False))
        sample = np.asarray(cache.tokens(level, "train", layer=layer, rows=rows), np.float32)
        model.fit_projection(sample.reshape(-1, in_dim))
    return model, in_dim, n_tokens


def _controls(spec, head: str, kind: str, model, dims: tuple[int, int], head_cfg: dict,
              data: tuple, cfg, seed: int, n_boot: int, boot, controls: bool) -> dict:
    """Chance, majority, the prior (input-free optimum) and the blind baseline (same head, no image)."""
    from .heads import build_head
    from .train import predict, seeded, train_head

    tr, va, te, te_mirror = data
    majority = spec.majority(tr)
    ctrl: dict[str, Any] = {"chance": spec.chance(te)}
    if majority is not None:
        ctrl["majority_class"] = majority
        ctrl["majority"] = spec.majority_rate(majority, te)
    prior = spec.fit_prior(tr)
    ctrl["prior"] = score(te, spec.prior_predict(prior, te), boot("prior"), n_boot)
    if len(te_mirror):
        ctrl["prior_mirror"] = score(te_mirror, spec.prior_predict(prior, te_mirror), boot("prior-mirror"), n_boot)
    if not controls:
        return ctrl
    in_dim, n_tokens = dims
    zero = np.zeros((1, in_dim) if kind == "pooled" else (1, 1, model.proj_dim), np.float32)
    blind = seeded(lambda: build_head(head, spec, in_dim, n_tokens, **head_cfg), seed)
    if kind == "tokens":  # the same fixed projection as the real head
        proj = {k: v for k, v in model.state_dict().items() if k.startswith("proj_")}
        blind.load_state_dict({**blind.state_dict(), **proj})
    train_head(blind, (zero, _blind(tr)), (zero, _blind(va)), cfg, seed, progress=False)
    ctrl["blind"] = score(te, predict(blind, zero, _blind(te)), boot("blind"), n_boot)
    if len(te_mirror):
        ctrl["blind_mirror"] = score(
            te_mirror, predict(blind, zero, _blind(te_mirror)), boot("blind-mirror"), n_boot
        )
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


def _write_run(rd: Path, config: dict, metrics: dict, model) -> None:
    """config.json, head.pt, then metrics.json last: its presence marks a finished run."""
    import torch

    from spar_bench.outputs import check_target, claim, remove

    check_target(rd)
    if claim(rd, overwrite=True, owned=owned_run, what="run folder"):
        remove(rd)  # an earlier run of the same probe, head and seed is replaced whole
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "config.json").write_text(json.dumps(json_safe(config), indent=2, default=str) + "\n")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "config": config}, rd / "head.pt")
    tmp = rd / (METRICS_FILE + ".tmp")
    tmp.write_text(json.dumps(json_safe(metrics), indent=2) + "\n")
    tmp.replace(rd / METRICS_FILE)


def run_fit(
    features: str | Path,
    head: str,
    probe: str,
    seed: int,
    out: str | Path,
    layer: int = -1,
    data: str | Path | None = None,
    cfg=None,
    head_cfg: dict[str, Any] | None = None,
    n_boot: int = 1000,
    controls: bool = True,
    train_mirrors: bool = False,
    progress: bool = True,
) -> Path:
    """Train and score one head; write the run directory; return its path."""
    from spar_bench.seeding import derive_seed

    from .heads import head_input
    from .train import TrainConfig, predict, train_head

    cfg = cfg or TrainConfig()
    head_cfg = dict(head_cfg or {})
    spec = get_probe(probe)
    kind = head_input(head)
    cache = open_cache(features)
    build = resolve_build(cache, data)
    level = spec.level
    if level not in cache.levels():
        raise ConfigError(f"{features}: cache has no {level}; levels: {', '.join(cache.levels())}")
    splits = cache.splits(level)
    if "train" not in splits or "test" not in splits:
        raise ConfigError(f"{features}: {level} needs train and test splits, cache has {splits}")

    tr, va, te, te_mirror, val_source, val_split = _split_targets(
        build, cache, spec, features, seed, cfg, train_mirrors
    )
    model, in_dim, n_tokens = _new_head(cache, head, spec, kind, layer, seed, head_cfg)
    f_train = load_features(cache, kind, level, "train", layer, model)
    f_val = (
        f_train if val_split == "train" else load_features(cache, kind, level, "val", layer, model)
    )
    f_test = load_features(cache, kind, level, "test", layer, model)
    result = train_head(model, (f_train, tr), (f_val, va), cfg, seed, progress=progress)

    boot = lambda tag: np.random.default_rng(derive_seed(seed, "bootstrap", probe, head, tag))  # noqa: E731
    test = score(te, predict(model, f_test, te), boot("test"), n_boot)
    mirror = (
        score(te_mirror, predict(model, f_test, te_mirror), boot("mirror"), n_boot)
        if len(te_mirror)
        else None
    )
    metrics: dict[str, Any] = {
        "probe": probe,
        "head": head,
        "seed": seed,
        "encoder": encoder_slug(cache),
        "random_init": bool(cache.random_init),
        "layer": layer,
        "headline": spec.headline,
        "val_source": val_source,
        "n_items": {"train": len(tr), "val": len(va), "test": len(te), "test_mirror": len(te_mirror)},
        "n_patients": {
            "train": int(np.unique(tr.patient).size),
            "test": int(np.unique(te.patient).size),
        },
        "train": {k: getattr(result, k) for k in ("epochs_run", "best_epoch", "best_val_loss")},
        "test": test,
        "mirror": mirror,
        "controls": _controls(
            spec, head, kind, model, (in_dim, n_tokens), head_cfg,
            (tr, va, te, te_mirror), cfg, seed, n_boot, boot, controls,
        ),  # fmt: skip
        "training": (cache.meta.get("weights") or {}).get("training")
        if isinstance(cache.meta.get("weights"), dict) else None,  # a `finetune` export probed frozen
    }
    config = {
        "probe": probe,
        "head": head,
        "seed": seed,
        "seeds": {
            "torch": seed,
            "bootstrap": [derive_seed(seed, "bootstrap", probe, head, "test")],
        },
        "layer": layer,
        # names + fingerprints, never absolute paths (eval and report need neither path)
        "features": Path(features).name,
        "cache_fingerprint": cache.fingerprint,
        "dataset_dir": Path(build.root).resolve().name,
        "dataset_fingerprint": build.fingerprint,
        "encoder": cache.meta.get("encoder"),
        "random_init": bool(cache.random_init),
        "head_input": kind,
        "head_config": model.cfg if hasattr(model, "cfg") else {},
        "in_dim": in_dim,
        "n_tokens": n_tokens,
        "train_config": cfg.to_dict(),
        "train_mirrors": train_mirrors,
        "controls": controls,
        "n_bootstrap": n_boot,
        "versions": package_versions(RUN_PACKAGES),
    }
    rd = run_dir(out, cache, probe, head, seed)
    _write_run(rd, config, metrics, model)
    return rd


# --------------------------------------------------------------------------- eval (transfer)
def run_eval(
    run: str | Path, features: str | Path, data: str | Path | None = None, n_boot: int = 1000
) -> Path:
    """Score a trained run on another cache without retraining; write ``eval-<cache>.json``."""
    import torch

    from spar_bench.seeding import derive_seed

    from .heads import build_head
    from .targets import concat, load_targets
    from .train import predict

    rd = Path(run)
    if not (rd / "head.pt").is_file() or not (rd / METRICS_FILE).is_file():
        raise ConfigError(f"{rd}: not a finished run directory (needs head.pt and metrics.json)")
    saved = torch.load(rd / "head.pt", map_location="cpu", weights_only=False)
    c = saved["config"]
    spec = get_probe(c["probe"])
    model = build_head(c["head"], spec, c["in_dim"], c["n_tokens"], **c["head_config"])
    model.load_state_dict(saved["state_dict"])
    trained = json.loads((rd / METRICS_FILE).read_text())
    majority = (trained.get("controls") or {}).get("majority_class")
    cache = open_cache(features)
    build = resolve_build(cache, data)
    level = spec.level
    if level not in cache.levels():
        raise ConfigError(f"{features}: cache has no {level}; levels: {', '.join(cache.levels())}")
    splits = ["test"] if "test" in cache.splits(level) else cache.splits(level)
    result: dict[str, Any] = {
        "run": "/".join(rd.resolve().parts[-4:]),  # <encoder>/<probe>/<head>/seed<k>
        "features": Path(features).name,
        "cache_fingerprint": cache.fingerprint,
        "encoder": encoder_slug(cache),
        "random_init": bool(cache.random_init),
        "splits": splits,
        "probe": spec.name,
        "head": c["head"],
        "seed": c["seed"],
    }
    tests, preds = [], []
    for split in splits:
        t = load_targets(build, spec, split, cache.keys(level, split))
        f = load_features(cache, c["head_input"], level, split, c["layer"], model)
        if f.shape[-1] != (model.proj_dim if c["head_input"] == "tokens" else c["in_dim"]):
            raise ConfigError(
                f"{features}: feature width {f.shape[-1]} does not match run {rd} ({c['in_dim']})"
            )
        tests.append(t)
        preds.append(predict(model, f, t))
    t = concat(tests)
    p = np.concatenate(preds)
    rng = lambda tag: np.random.default_rng(derive_seed(c["seed"], "bootstrap", "eval", tag))  # noqa: E731
    orig, mir = ~t.is_mirror, t.is_mirror
    result["test"] = score(t.subset(orig), p[orig], rng("test"), n_boot)
    result["mirror"] = score(t.subset(mir), p[mir], rng("mirror"), n_boot) if mir.any() else None
    result["controls"] = {"chance": spec.chance(t.subset(orig)),
                          "majority": spec.majority_rate(majority, t.subset(orig))}  # fmt: skip
    out = rd / f"eval-{Path(features).stem}.json"
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


def train_config_from(max_epochs: int | None, batch_size: int, lr: float, device: str = "cpu"):
    from .train import TrainConfig

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is visible; use --device cpu")
    elif device != "cpu":
        raise ConfigError(f"--device must be cpu or cuda[:N], got {device!r}")
    return TrainConfig(max_epochs=max_epochs, batch_size=batch_size, lr=lr, device=device)


@click.command("fit")
@click.option(
    "--features", required=True, type=click.Path(dir_okay=False), help="Feature cache (.h5)."
)
@click.option(
    "--head", default="mlp", show_default=True, help="linear, mlp, attnpool or transformer."
)
@click.option(
    "--probe",
    "probe",
    multiple=True,
    default=("all",),
    show_default=True,
    help="Probe name(s) or 'all'.",
)
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds.")
@click.option("--layer", default=-1, show_default=True, type=int, help="Cached layer to read.")
@click.option(
    "--data",
    default=None,
    type=click.Path(file_okay=False),
    help="Build dir (default: the cache's dataset_dir).",
)
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--max-epochs", default=None, type=int, help="Default: 100 pooled heads, 40 token heads."
)
@click.option("--batch-size", default=256, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option(
    "--bootstrap", "n_boot", default=1000, show_default=True, type=int, help="Bootstrap replicates."
)
@click.option("--no-controls", is_flag=True, help="Skip the blind baseline (faster).")
@click.option(
    "--train-mirrors", is_flag=True, help="Also train on mirrored counterfactual samples."
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where heads train: cpu, or cuda[:N] (heads are light; the Level 1-2 transformer gains most).",
)
@click.option(
    "--threads",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="torch CPU threads (1, as in sweep workers: the same metrics either way you run).",
)
def fit_command(
    features,
    head,
    probe,
    seeds,
    layer,
    data,
    out,
    max_epochs,
    batch_size,
    lr,
    n_boot,
    no_controls,
    train_mirrors,
    device,
    threads,
):
    """Train a probe head on cached features and score it (one run per probe x seed)."""
    import torch

    from .heads import HEADS

    HEADS.check(head)  # names first: an unknown head is named before any file is read
    probes = parse_probes(probe)
    torch.set_num_threads(threads)
    cfg = train_config_from(max_epochs, batch_size, lr, device)
    explicit = all(p.strip() != "all" for item in probe for p in item.split(","))
    for p in probes:
        for s in parse_seeds(seeds):
            try:
                rd = run_fit(
                    features, head, p, s, out, layer, data, cfg, None, n_boot,
                    not no_controls, train_mirrors,
                )  # fmt: skip
            except ProbeUnavailable as e:
                if explicit:
                    raise
                click.echo(f"{p}: not available on this build ({e}); skipped", err=True)
                break
            m = json.loads((rd / METRICS_FILE).read_text())
            key = m["headline"]
            click.echo(f"{p} {head} seed{s}: {key}={_fmt(m['test'].get(key))} -> {rd}")


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
@click.option("--bootstrap", "n_boot", default=1000, show_default=True, type=int)
def eval_command(run, features, data, n_boot):
    """Score a trained head on another cache (transfer), without retraining.

    A ``spar-probe finetune`` run given ``--data`` and no ``--features`` re-encodes that
    build's images with its own trained encoder.
    """
    if features is None:
        from .finetune.run import EXPORT_FILE, run_eval_reencoded

        if data is None or not (Path(run) / EXPORT_FILE).is_file():
            raise ConfigError(
                "--features is required (re-encoding with --data alone needs a `spar-probe finetune` "
                f"run holding {EXPORT_FILE})"
            )
        out = run_eval_reencoded(run, data, n_boot)
        m = json.loads(out.read_text())
        key = get_probe(m["probe"]).headline
        click.echo(f"{m['probe']} {m['head']} on {m['data']} (re-encoded): {key}={_fmt(m['test'].get(key))} -> {out}")
        return
    out = run_eval(run, features, data, n_boot)
    m = json.loads(out.read_text())
    key = get_probe(m["probe"]).headline
    click.echo(
        f"{m['probe']} {m['head']} on {Path(features).name}: {key}={_fmt(m['test'].get(key))} -> {out}"
    )


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"
