"""``spar-probe finetune``: train an encoder and a probe head end to end on a build's images.

One run = one (encoder, init, build, probe, head + options, seed). Its folder
``OUT/<encoder>-<finetuned|scratch>-<build>/<probe>/<head>[,<options>]/seed<k>/`` (the
options that differ from their defaults, as ``fit``'s; a finished run is kept: rerun with
the same options it is skipped, with others refused, replaced only with ``--overwrite``) holds what a
``spar-probe fit`` run holds (``config.json``, ``head.pt``, ``metrics.json`` with the same
metrics, controls and patient-bootstrap intervals, so ``spar-probe report`` shows frozen,
finetuned and from-scratch runs side by side) plus ``encoder.safetensors``: the trained
encoder, its spec and how it was trained in the file's metadata, ready for
``spar-probe cache --encoder SPEC --weights RUN/encoder.safetensors``.

The targets, the held-out validation rule, the scoring and the controls (chance,
majority, the prior, blind baseline: the same head trained on the question alone,
with ``fit``'s head-training defaults) are ``fit``'s own functions; after training, the
test images are encoded once by the trained encoder and scored exactly as cached features.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.provenance import protocol_versions

from ..runs.inputs import build_splits
from ..runs.store import (
    finished_with,
    fresh_run_dir,
    run_folder,
    save_head,
    variant_text,
    write_config,
    write_metrics,
)
from .config import NOT_NAMED, FinetuneConfig, FinetuneSpec
from .loop import BEST, CHECKPOINT, Split, Trainer, load_saved, run_key
from .model import EXPORT_FILE, export_encoder, freeze_blocks, load_trainable
from .predictor import FinetunedEncoder

TIMING_FILE = "timing.json"  # the measured training throughput (a time: never in metrics.json)
RUN_FILES = frozenset({"config.json", "head.pt", "metrics.json", "metrics.json.tmp", TIMING_FILE, EXPORT_FILE,
                       EXPORT_FILE + ".tmp", CHECKPOINT, CHECKPOINT + ".tmp", BEST, BEST + ".tmp"})
MODES = {"weights": "finetuned", "scratch": "scratch"}
#: ``config.json`` fields that, with the head's and the training options, identify a run.
IDENTITY = ("encoder", "init", "weights", "model_args", "dataset_fingerprint", "probe", "head", "seed",
            "head_input", "compute_dtype", "train_mirrors", "controls", "n_bootstrap")


def run_slug(encoder: str, init: str, build_root: str | Path) -> str:
    """Run-folder name of a trained encoder: ``timm-resnet18-scratch-shards-canonical``
    (``encoder`` as published: :func:`published_encoder`)."""
    import re

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{encoder}-{MODES[init]}-{Path(build_root).resolve().name}")
    return name.strip("-")


def published_encoder(encoder: str, spec) -> str:
    """The encoder name a run records: as given, or, for a model loaded from a local path,
    the spec's portable name (``hf:tiny@1a2b3c4d``: base name + content hash, no path)."""
    from ..encoders.base import is_local_name

    return spec.name if is_local_name(spec.name) else encoder


def training_record(init: str, build, weights_record: dict) -> dict[str, Any]:
    """How an encoder was trained (in metrics, config, the export and every cache of it)."""
    name = Path(build.root).resolve().name
    what = "trained from scratch" if init == "scratch" else "finetuned"
    return {"mode": MODES[init], "build": name, "build_fingerprint": build.fingerprint,
            "label": f"{what} on build {name}",
            "init_weights": {k: v for k, v in weights_record.items() if k != "path"}}


def owned_finetune_run(rd: Path) -> set[str] | None:
    """The files of a finetune run (finished or not) in ``rd``, or None. A run stopped before
    its first checkpoint (killed, or a full disk between a save and its rename) leaves only
    ``best.pt``, ``best.pt.tmp`` or ``checkpoint.pt.tmp``: that is a run too."""
    rd = Path(rd)
    names = {p.name for p in rd.iterdir()} if rd.is_dir() else set()
    first_saves = {BEST, BEST + ".tmp", CHECKPOINT + ".tmp"}
    if (rd / CHECKPOINT).is_file() or (rd / "config.json").is_file() or (names and names <= first_saves):
        return set(RUN_FILES) | {p.name for p in rd.glob("eval-*.json")}
    return None


def new_head(encoding, head: str, spec, kind: str, seed: int, head_cfg: dict, tr: Split,
              scratch: bool = False):
    """A seeded head sized by one encoded image; token heads fit their fixed PCA projection
    on the initial encoder's tokens of a seeded sample of training images (as ``fit``).

    ``scratch``: the initial encoder is random, its tokens carry nothing worth a PCA, and
    whitening them scales near-constant directions by up to 1e6, which swamps the head's
    position embeddings and, through gradient clipping, stalls the encoder. A token head
    then reads the encoder's tokens unprojected (identity, full width; recorded as its
    ``proj_dim``)."""
    from spar_bench.seeding import derive_seed

    from ..heads import build_head
    from ..train import seeded

    rows = np.unique(tr.targets.rows)
    first = encoding.features(tr.level, tr.split, rows[:1], kind="tokens")
    in_dim, n_tokens = int(first.shape[-1]), (int(first.shape[1]) if kind == "tokens" else 1)
    if scratch and kind == "tokens":
        head_cfg = {**head_cfg, "proj_dim": in_dim}
    grid = volume_token_grid(encoding.enc.spec, encoding.cfg.layer) if kind == "tokens" else None
    if grid is not None:  # a 3-D encoder: 3-D position embeddings (heads.positions)
        head_cfg = {**head_cfg, "token_grid": grid}
    model = seeded(lambda: build_head(head, spec, in_dim, n_tokens, **head_cfg), seed)
    if kind == "tokens" and not scratch:
        rng = np.random.default_rng(derive_seed(seed, "projection", spec.name))
        pick = np.sort(rng.choice(rows, size=min(rows.size, max(1, 50000 // n_tokens)), replace=False))
        sample = encoding.features(tr.level, tr.split, pick, kind="tokens")
        model.fit_projection(sample.reshape(-1, in_dim))
    return model.to(encoding.dev), in_dim, n_tokens


def volume_token_grid(spec, layer: int) -> list[int] | None:
    """``[n_prefix, D', H', W']`` of a 3-D encoder's ``layer`` (what a cache records), else None."""
    if not spec.volumetric:
        return None
    return [int(spec.n_prefix), *(int(g) for g in spec.layer_grid(layer))]


def check_encoder_reads(spec, probe, data) -> None:
    """A 3-D encoder trains on Level 4 (volume) probes only, a 2-D one on the others: one line."""
    from spar_bench.builder.schema import LEVEL_SPECS

    from ..targets import ProbeUnavailable

    if LEVEL_SPECS[probe.level].volume != spec.volumetric:  # `--probe all` skips it (one line)
        kind, other = ("3-D", "volumes (Level 4)") if spec.volumetric else ("2-D", "images (Levels 1-3)")
        raise ProbeUnavailable(f"{data}: encoder {spec.name} is {kind}: it encodes {other} only, not "
                          f"{probe.level} (probe {probe.name})")


def load_encoding(encoder: str, build, seed: int, cfg: FinetuneConfig, *, weights, init, model_kwargs,
              revision=None):
    """The trainable encoder on its device (channels-last for CNNs), and its precision."""
    try:
        enc = load_trainable(encoder, weights=weights, init=init, seed=seed, model_kwargs=model_kwargs,
                             revision=revision)
    except TypeError as e:  # the model's constructor refuses a key of --model-args
        if not model_kwargs or "keyword argument" not in str(e):
            raise
        raise ConfigError(f"--model-args {json.dumps(model_kwargs)}: {encoder} refuses them ({e}); check "
                          "the keys' spelling against the model's constructor") from None  # fmt: skip
    freeze_blocks(enc, cfg.freeze_blocks)
    return encoding_of(enc, build, cfg)


def finetune_variant(cfg: FinetuneConfig, head: str, head_cfg: dict, train_mirrors: bool) -> str:
    """The run folder's suffix (as ``fit``'s :meth:`~..runspec.RunSpec.variant`): the training
    and head options that differ from their defaults, ``encoder_lr=0.01,max_epochs=2``."""
    from ..heads import head_defaults

    changed = {**cfg.changed(), **{k: v for k, v in head_cfg.items() if head_defaults(head).get(k) != v}}
    return variant_text({**changed, **({"train_mirrors": True} if train_mirrors else {})})


def run_identity(config: dict) -> dict:
    """What makes two finetune runs the same run, from a ``config.json``: :data:`IDENTITY`, the
    head's options and the training options (not where it ran: ``config.NOT_NAMED``)."""
    named = {k: v for k, v in (config.get("finetune_config") or {}).items() if k not in NOT_NAMED}
    return {**{k: config.get(k) for k in IDENTITY}, **(config.get("head_config") or {}), **named}


def _check_finished(rd: Path, config: dict) -> None:
    """``rd`` holds a finished run: refuse it (one line) unless it is this run, same options."""
    from spar_bench.provenance import json_safe

    want = json.loads(json.dumps(json_safe(run_identity(config)), default=str))
    finished_with(rd, run_identity, want, "pass --overwrite")


def _prepare_run_dir(rd: Path, config: dict, resume: bool, overwrite: bool) -> bool:
    """A fresh run folder, or the checkpointed one with ``resume``; never a foreign folder.
    True: ``rd`` holds this run, finished with the same options (nothing to train).

    A finished run is replaced only with ``--overwrite``: one with other options is refused,
    naming what differs; an interrupted one is continued with ``--resume``.
    """
    from spar_bench.outputs import check_target

    check_target(rd)
    if (rd / "metrics.json").is_file() and not overwrite:
        _check_finished(rd, config)
        return True
    started = (rd / CHECKPOINT).is_file() and not (rd / "metrics.json").is_file()
    if started and resume:
        return False
    if started and not overwrite:
        raise ConfigError(f"{rd}: holds an interrupted run; pass --resume to continue it, or --overwrite")
    fresh_run_dir(rd, owned_finetune_run, "finetune run folder")
    return False


def run_finetune(fs: FinetuneSpec, out: str | Path, *, resume: bool = False, overwrite: bool = False,
                 progress: bool = True) -> Path:
    """Train ``fs.encoder`` + ``fs.head`` on ``fs.probe`` of build ``fs.data``; score; write the run folder."""
    from spar_bench.builder.shards import Build

    from ..encoders import check_encoder_name
    from ..heads import head_input
    from ..runs.evaluate import evaluate, run_metrics

    check_encoder_name(fs.encoder)  # names first: a typo is named before any file is read
    hrun, kind = fs.head_run(), head_input(fs.head)  # the head's run: the build's images are its features
    build = Build(fs.data)
    splits = build_splits(build, hrun)
    encoding, precision = load_encoding(fs.encoder, build, fs.seed, fs.cfg, weights=fs.weights, init=fs.init,
                                        model_kwargs=fs.model_kwargs, revision=fs.revision)  # fmt: skip
    check_encoder_reads(encoding.enc.spec, hrun.spec, fs.data)
    encoder = published_encoder(fs.encoder, encoding.enc.spec)  # no local path in the folder name or any record
    variant = finetune_variant(fs.cfg, fs.head, fs.head_cfg, fs.train_mirrors)
    rd = run_folder(out, run_slug(encoder, fs.init, fs.data), fs.probe, fs.head, variant, fs.seed)
    model, in_dim, n_tokens = new_head(encoding, fs.head, hrun.spec, kind, fs.seed, fs.head_cfg,
                                       Split(splits.tr, hrun.spec.level, "train"), fs.init == "scratch")  # fmt: skip
    training = training_record(fs.init, build, encoding.enc.spec.weights)
    config = _config(fs, encoder, encoding.enc.spec, build, kind, model, (in_dim, n_tokens), precision, training)
    config.update(variant=variant, run={**hrun.to_dict(), "features": Path(str(fs.data)).name})  # names only, as fit's
    if _prepare_run_dir(rd, config, resume, overwrite):
        click.echo(f"{rd}: finished earlier with these options; kept (--overwrite trains it again)", err=True)
        return rd
    key = run_key(encoder=encoder, weights=encoding.enc.spec.weights, init=fs.init, model_kwargs=fs.model_kwargs,
                  build=build.fingerprint, probe=fs.probe, head=fs.head, head_cfg=fs.head_cfg, seed=fs.seed,
                  cfg=fs.cfg.to_dict(), compute=precision.dtype, train_mirrors=fs.train_mirrors)  # fmt: skip
    trainer = Trainer(encoding, model, kind, fs.seed, rd, key, progress)
    predictor = FinetunedEncoder(hrun, encoding, model, kind, (in_dim, n_tokens), trainer, splits.val_split, resume)
    result = predictor.fit(splits.tr, splits.va)
    prior = hrun.spec.fit_prior(splits.tr)
    scored = evaluate(hrun, predictor, splits, prior)
    metrics = run_metrics(hrun, splits, scored, encoder=rd.parent.parent.parent.name, variant=variant,
                          layer=fs.cfg.layer, train=_train_record(result, fs.cfg.patience), training=training,
                          manifest=build.manifest)  # fmt: skip
    timing = {"images": result.images, "seconds": result.seconds,
              "images_per_s": result.images / max(result.seconds, 1e-9)}
    _write(rd, encoding.enc, model, config, metrics, prior, timing)
    return rd


def _train_record(result, patience: int) -> dict[str, Any]:
    """``metrics.json``'s ``train`` of a finetune run: the head runs' fields, the loss curves,
    and optimizer steps (the measured throughput is in ``timing.json``: a time differs between any
    two runs, and metrics.json is byte-identical for the same inputs and seed)."""
    from ..train import stopped_by

    epochs = len(result.hist_tr)
    return {"epochs_run": epochs, "best_epoch": result.best_epoch, "best_val_loss": result.best_val,
            "stopped_by": stopped_by(epochs, result.best_epoch, patience), "train_loss": result.hist_tr,
            "val_loss": result.hist_va, "optimizer_steps": result.opt_steps}


def _config(fs: FinetuneSpec, encoder: str, enc_spec, build, kind: str, model, dims: tuple[int, int],
            precision, training: dict) -> dict:
    """What a finetune run's ``config.json`` records (no local path)."""
    from spar_bench.provenance import CACHE_PACKAGES, package_versions
    from spar_bench.seeding import derive_seed

    from ..encoders.base import published_weights

    seed = fs.seed
    return {
        "command": "finetune", "probe": fs.probe, "head": fs.head, "seed": seed,
        "seeds": {"torch": seed, "init": seed if fs.init == "scratch" else None,
                  "bootstrap": [derive_seed(seed, "bootstrap", fs.probe, fs.head, "test")]},
        "layer": fs.cfg.layer, "encoder": encoder, "init": fs.init, "weights": published_weights(enc_spec.weights),
        "model_args": fs.model_kwargs or {}, "random_init": False,
        "encoder_config": {**enc_spec.to_dict(), "weights": published_weights(enc_spec.weights)},
        "training": training, "dataset_dir": Path(build.root).resolve().name,
        "dataset_fingerprint": build.fingerprint, "head_input": kind,
        "head_config": getattr(model, "cfg", {}), "in_dim": dims[0], "n_tokens": dims[1],
        "finetune_config": fs.cfg.to_dict(), "compute_dtype": precision.dtype,
        "compute_reason": precision.reason, "train_config": fs.cfg.train_config().to_dict(),
        "train_mirrors": fs.train_mirrors, "controls": fs.controls, "n_bootstrap": fs.n_boot,
        **protocol_versions(build.manifest), "versions": package_versions(CACHE_PACKAGES),
    }  # fmt: skip


def _write(rd: Path, enc, model, config: dict, metrics: dict, prior: dict | None, timing: dict) -> None:
    """encoder.safetensors, head.pt, config.json, then metrics.json last (it marks a finished
    run); the checkpoints go once the run is complete."""
    meta = {"encoder": config["encoder"], "encoder_config": config["encoder_config"],
            "model_args": config["model_args"], "training": config["training"],
            "run": {"probe": config["probe"], "head": config["head"], "seed": config["seed"]}}
    export_encoder(enc, rd / EXPORT_FILE, meta)
    save_head(rd, model, config, prior)
    write_config(rd, config)
    (rd / TIMING_FILE).write_text(json.dumps(timing, indent=2) + "\n")
    write_metrics(rd, metrics)
    for name in (CHECKPOINT, BEST):
        (rd / name).unlink(missing_ok=True)


def parse_model_args(text: str | None) -> dict[str, Any] | None:
    """``--model-args '{"depth": 4}'`` (JSON object) for ``timm.create_model``."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--model-args must be a JSON object, e.g. '{{\"depth\": 4}}': {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--model-args must be a JSON object, got {text!r}")
    return value


def load_run_encoder(rd: Path, config: dict, encoder: str | None = None):
    """The trained encoder of run ``rd``: what ``spar-probe cache --encoder SPEC --weights
    RUN/encoder.safetensors`` loads (the architecture rebuilt, the export loaded over it).

    A run of a model loaded from a local path records it by name and content hash only;
    ``encoder`` gives the path again (``hf:DIR``), and must be that same model.
    """
    from ..encoders import load_encoder
    from ..encoders.base import is_local_name

    recorded = config["encoder"]
    if encoder is None and is_local_name(recorded):
        raise ConfigError(
            f"{rd}: its encoder {recorded} was loaded from a local path, which runs do not record; "
            f"pass it again with --encoder {recorded.rpartition(':')[0]}:PATH"
        )
    kw = {"model_kwargs": config["model_args"]} if config.get("model_args") else {}
    enc = load_encoder(encoder or recorded, weights=str(rd / EXPORT_FILE), **kw)
    if encoder is not None and is_local_name(recorded) and enc.spec.name != recorded:
        raise ConfigError(
            f"--encoder {encoder} is {enc.spec.name} (its content differs), but run {rd} trained "
            f"{recorded}; pass the folder or file the run was trained from"
        )
    return enc


def run_eval_reencoded(run: str | Path, data: str | Path, n_boot: int = 1000, device: str = "auto",
                       compute: str = "auto", encoder: str | None = None, overwrite: bool = False) -> Path:
    """Score a finetune run on another build, re-encoding its images with the run's encoder.

    Writes ``RUN/eval-<build>.json`` (the layout of ``spar-probe eval``'s output; kept when it
    holds this evaluation, refused when another, unless ``overwrite``). ``encoder``: the path
    of a local model again (:func:`load_run_encoder`).
    """
    from spar_bench.builder.shards import Build

    from ..heads import build_head
    from ..runs.evaluate import transfer
    from ..runs.inputs import BuildKeys
    from ..runs.store import kept_eval, run_path, write_eval
    from ..targets import concat, load_targets
    from ..tasks import get_probe
    from ..train import predict
    from .data import remap

    rd = Path(run)
    if not (rd / EXPORT_FILE).is_file() or not (rd / "metrics.json").is_file():
        raise ConfigError(f"{rd}: not a finished finetune run (needs {EXPORT_FILE} and metrics.json)")
    saved = load_saved(rd / "head.pt", "head", "train the run again (finetune --overwrite)")
    c = saved["config"]
    spec = get_probe(c["probe"])
    head = build_head(c["head"], spec, c["in_dim"], c["n_tokens"], **c["head_config"])
    head.load_state_dict(saved["state_dict"])
    build = Build(data)
    name = Path(build.root).resolve().name
    out = rd / f"eval-{name}.json"
    inputs = {"features": f"{name} (re-encoded)", "dataset_fingerprint": build.fingerprint, "n_bootstrap": n_boot}
    if kept_eval(out, inputs, overwrite):
        return out
    cfg = FinetuneConfig(**{**c["finetune_config"], "device": device, "compute": compute})
    enc = load_run_encoder(rd, c, encoder)
    encoding, _ = encoding_of(enc, build, cfg)
    head.to(encoding.dev)
    level = spec.level
    splits = ["test"] if "test" in build.splits(level) else build.splits(level)
    run_metrics = json.loads((rd / "metrics.json").read_text())
    majority = (run_metrics.get("controls") or {}).get("majority_class")
    preds, tests = [], []
    for split in splits:
        t = load_targets(build, spec, split, BuildKeys(build).keys(level, split))
        rows = np.unique(t.rows)
        feats = encoding.features(level, split, rows, head, c["head_input"])
        preds.append(predict(head, feats, remap(t, rows)))
        tests.append(t)
    scored = transfer(concat(tests), np.concatenate(preds), c["seed"], n_boot, saved.get("prior"), majority)
    result = {"run": run_path(rd), "features": f"{name} (re-encoded)", "data": name,
              "dataset_fingerprint": build.fingerprint, "encoder": rd.parent.parent.parent.name,
              "random_init": False, "training": run_metrics.get("training"), "splits": splits,
              "probe": spec.name, "head": c["head"], "seed": c["seed"], "n_bootstrap": n_boot, **scored}
    return write_eval(out, result)


def encoding_of(enc, build, cfg: FinetuneConfig):
    """``enc`` on the configured device (channels-last for CNNs) with its autocast precision."""
    from ..hardware import pick_compute, pick_device
    from .loop import Encoding

    dev = pick_device(cfg.device)
    precision = pick_compute(cfg.compute, dev)
    enc.prefer_channels_last().to(dev)
    return Encoding(enc, build, dev, precision.dtype, cfg), precision
