"""A finetune run's encoder: loading it trainable, naming its runs, sizing its head, and re-encoding
a build with a finished run's encoder (transfer evaluation).

The run itself is :class:`.predictor.FinetuneJob` (kind ``finetune``); what follows describes it.

``spar-probe finetune``: train an encoder and a probe head end to end on a build's images.

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
import re
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError
from spar_bench.seeding import derive_seed

from ..encoders import load_encoder
from ..encoders.base import is_local_name
from ..hardware import pick_compute, pick_device
from ..heads import build_head
from ..runs.evaluate import transfer
from ..runs.inputs import BuildKeys
from ..runs.record import RunRecord
from ..runs.store import TransferEval, kept_eval, run_path, write_eval
from ..targets import ProbeUnavailable, concat, load_targets
from ..tasks import get_probe
from ..train import predict, seeded
from .config import FinetuneConfig
from .data import remap
from .loop import Encoding, Split, load_saved
from .model import EXPORT_FILE, freeze_blocks, load_trainable

MODES = {"weights": "finetuned", "scratch": "scratch"}


def run_slug(encoder: str, init: str, build_root: str | Path) -> str:
    """Run-folder name of a trained encoder: ``timm-resnet18-scratch-shards-canonical``
    (``encoder`` as published: :func:`published_encoder`)."""

    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{encoder}-{MODES[init]}-{Path(build_root).resolve().name}")
    return name.strip("-")


def published_encoder(encoder: str, spec) -> str:
    """The encoder name a run records: as given, or, for a model loaded from a local path,
    the spec's portable name (``hf:tiny@1a2b3c4d``: base name + content hash, no path)."""

    return spec.name if is_local_name(spec.name) else encoder


def training_record(init: str, build, weights_record: dict) -> dict[str, Any]:
    """How an encoder was trained (in metrics, config, the export and every cache of it)."""
    name = Path(build.root).resolve().name
    what = "trained from scratch" if init == "scratch" else "finetuned"
    return {"mode": MODES[init], "build": name, "build_fingerprint": build.fingerprint,
            "label": f"{what} on build {name}",
            "init_weights": {k: v for k, v in weights_record.items() if k != "path"}}


def new_head(encoding, head: str, spec, kind: str, seed: int, head_cfg: dict, tr: Split,
              scratch: bool = False):
    """A seeded head sized by one encoded image; token heads fit their fixed PCA projection
    on the initial encoder's tokens of a seeded sample of training images (as ``fit``).

    ``scratch``: the initial encoder is random, its tokens carry nothing worth a PCA, and
    whitening them scales near-constant directions by up to 1e6, which swamps the head's
    position embeddings and, through gradient clipping, stalls the encoder. A token head
    then reads the encoder's tokens unprojected (identity, full width; recorded as its
    ``proj_dim``)."""

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

    rd = Path(run)
    if not (rd / EXPORT_FILE).is_file() or not (rd / "metrics.json").is_file():
        raise ConfigError(f"{rd}: not a finished finetune run (needs {EXPORT_FILE} and metrics.json)")
    build = Build(data)
    name = Path(build.root).resolve().name
    out = rd / f"eval-{name}.json"
    inputs = {"features": f"{name} (re-encoded)", "dataset_fingerprint": build.fingerprint, "n_bootstrap": n_boot}
    if kept_eval(out, inputs, overwrite):
        return out
    c, head, encoding, saved = load_finetuned(rd, build, device, compute, encoder)
    spec = get_probe(c["probe"])
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
    evaluation = TransferEval(run=run_path(rd), features=f"{name} (re-encoded)", data=name,
                              dataset_fingerprint=build.fingerprint, encoder=rd.parent.parent.parent.name,
                              random_init=False, training=run_metrics.get("training"), splits=splits,
                              probe=spec.name, head=c["head"], variant=RunRecord.read(rd).variant, seed=c["seed"],
                              n_bootstrap=n_boot)  # fmt: skip
    return write_eval(out, evaluation, scored)


def load_finetuned(rd: Path, build, device: str = "auto", compute: str = "auto", encoder: str | None = None):
    """``(config view, head, encoding, saved head.pt)`` of finetune run ``rd``: its trained head
    (eval-ready, on the encoding's device) and its trained encoder reading ``build``'s images
    (:func:`encoding_of` on ``device``/``compute``). ``encoder``: see :func:`load_run_encoder`."""

    saved = load_saved(Path(rd) / "head.pt", "head", "train the run again (finetune --overwrite)")
    c = config_view(RunRecord.from_saved(saved["config"], Path(rd) / "head.pt"))
    head = build_head(c["head"], get_probe(c["probe"]), c["in_dim"], c["n_tokens"], **c["head_config"])
    head.load_state_dict(saved["state_dict"])
    cfg = FinetuneConfig(**{**c["finetune_config"], "device": device, "compute": compute})
    encoding, _ = encoding_of(load_run_encoder(Path(rd), c, encoder), build, cfg)
    head.to(encoding.dev)
    return c, head, encoding, saved


def config_view(rec) -> dict[str, Any]:
    """A finetune run's record as the flat fields its encoder and head are rebuilt from
    (``encoder``, ``model_args``, ``probe``, ``head``, ``seed``, ``head_input``, ``in_dim``,
    ``n_tokens``, ``head_config``, ``finetune_config``), for a record or an older config."""
    model_args = rec.inputs.get("model_args", rec.extra.get("model_args"))
    return {**rec.extra, "encoder": rec.model, "model_args": model_args or {}, "probe": rec.probe,
            "head": rec.head, "seed": rec.seed}


def encoding_of(enc, build, cfg: FinetuneConfig):
    """``enc`` on the configured device (channels-last for CNNs) with its autocast precision."""

    dev = pick_device(cfg.device)
    precision = pick_compute(cfg.compute, dev)
    enc.prefer_channels_last().to(dev)
    return Encoding(enc, build, dev, precision.dtype, cfg), precision
