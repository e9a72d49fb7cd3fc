"""The finetuned encoder + head as a :class:`~spar_bench.probes.runs.predictors.Predictor`.

``fit`` trains the encoder and the head end to end (:class:`.loop.Trainer`, checkpointed and
resumable); ``predict`` encodes the items' images with the trained encoder once and runs the
head on them, so the run is scored by the same evaluation as a head on cached features.
Its blind baseline is ``fit``'s: the same head trained on the question alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError
from spar_bench.outputs import check_target
from spar_bench.provenance import CACHE_PACKAGES, package_versions, protocol_versions
from spar_bench.seeding import derive_seed

from ..encoders import check_encoder_name
from ..encoders.base import published_weights
from ..heads import head_defaults, head_input
from ..runs.evaluate import evaluate, run_metrics
from ..runs.inputs import build_splits
from ..runs.predictors import BlindHead
from ..runs.record import RunRecord
from ..runs.session import NEEDS_FEATURES, run_eval
from ..runs.store import HEAD_FILE, check_run_dir, fresh_run_dir, owned_run, save_head
from ..tasks import get_probe
from ..train import predict, stopped_by
from .config import NOT_NAMED
from .data import remap
from .encoding import (
    check_encoder_reads,
    load_encoding,
    load_finetuned,
    new_head,
    published_encoder,
    run_eval_reencoded,
    run_slug,
    training_record,
)
from .loop import BEST, CHECKPOINT, Split, Trainer, run_key
from .model import EXPORT_FILE


@dataclass
class FinetunedEncoder:
    """``encoding`` (the trainable encoder on its device) + ``model`` (the head) of run ``run``."""

    run: Any
    encoding: Any
    model: Any
    input_kind: str
    dims: tuple[int, int]
    trainer: Any = None
    val_split: str = "val"
    resume: bool = False
    kind: str = "finetune"

    @classmethod
    def from_run(cls, rd: Path, build, device: str = "auto", compute: str = "auto") -> FinetunedEncoder:
        """The trained encoder and head of finished run ``rd``, reading ``build``'s images (transfer:
        another build's items re-encoded by the run's own encoder). It predicts; it has no blind."""

        c, head, encoding, _ = load_finetuned(rd, build, device, compute)
        return cls(SimpleNamespace(spec=get_probe(c["probe"])), encoding, head, c["head_input"],
                   (c["in_dim"], c["n_tokens"]))

    def fit(self, train, val):
        """Train encoder and head (``trainer``); the training record (:class:`.loop.Trainer`'s)."""

        level = self.run.spec.level
        return self.trainer.fit(Split(train, level, "train"), Split(val, level, self.val_split), self.resume)

    def predict(self, t, split: str = "test") -> np.ndarray:
        rows = np.unique(t.rows)
        feats = self.encoding.features(self.run.spec.level, split, rows, self.model, self.input_kind)
        return predict(self.model, feats, remap(t, rows))

    def blind(self) -> BlindHead:
        return BlindHead.of(self.run, self.model, self.dims)


# --------------------------------------------------------------------------- the finetune run
TIMING_FILE = "timing.json"  # the measured training throughput (a time: never in metrics.json)


def finetune_files() -> frozenset[str]:
    """The files a finetune run declares beside its record and metrics, and those its training
    leaves while it runs (checkpoints; a run stopped before its first checkpoint is a run too)."""

    return frozenset({"head.pt", TIMING_FILE, EXPORT_FILE, EXPORT_FILE + ".tmp", CHECKPOINT, CHECKPOINT + ".tmp",
                      BEST, BEST + ".tmp"})  # fmt: skip


def finetune_record(fs, encoder: str, enc_spec, build, kind: str, precision, variant: str):
    """The :class:`~..runs.record.RunRecord` of finetune run ``fs`` as known before training."""

    named = {k: v for k, v in fs.cfg.to_dict().items() if k not in NOT_NAMED}
    inputs = {"init": fs.init, "weights": published_weights(enc_spec.weights), "model_args": fs.model_kwargs or {},
              "compute_dtype": precision.dtype}  # fmt: skip
    options = {"finetune_config": named, "head_input": kind, "head_options": dict(fs.head_cfg),
               "head_defaults": head_defaults(fs.head), "train_mirrors": fs.train_mirrors,
               "controls": fs.controls, "n_bootstrap": fs.n_boot}  # fmt: skip
    return RunRecord(kind="finetune", probe=fs.probe, head=fs.head, seed=fs.seed, variant=variant, model=encoder,
                     build=Path(build.root).resolve().name, build_fingerprint=build.fingerprint, inputs=inputs,
                     options=options, versions=package_versions(CACHE_PACKAGES),
                     protocol=protocol_versions(build.manifest))  # fmt: skip


def finetune_extra(fs, enc_spec, kind: str, model, dims: tuple[int, int], precision, training: dict) -> dict:
    """What a finetune run resolved (its record's ``extra``): seeds, the encoder's config, how it
    was trained, the head's resolved config and widths, the full training config."""

    seed = fs.seed
    return {
        "seeds": {"torch": seed, "init": seed if fs.init == "scratch" else None,
                  "bootstrap": [derive_seed(seed, "bootstrap", fs.probe, fs.head, "test")]},
        "layer": fs.cfg.layer, "random_init": False,
        "encoder_config": {**enc_spec.to_dict(), "weights": published_weights(enc_spec.weights)},
        "training": training, "head_input": kind, "head_config": getattr(model, "cfg", {}),
        "in_dim": dims[0], "n_tokens": dims[1], "finetune_config": fs.cfg.to_dict(),
        "compute_reason": precision.reason, "train_config": fs.cfg.train_config().to_dict(),
        "run": {**fs.head_run().to_dict(), "features": Path(str(fs.data)).name},  # names only, as fit's
    }  # fmt: skip


def train_record(result, patience: int) -> dict[str, Any]:
    """``metrics.json``'s ``train`` of a finetune run: the head runs' fields, the loss curves,
    and optimizer steps (the measured throughput is in ``timing.json``: a time differs between any
    two runs, and metrics.json is byte-identical for the same inputs and seed)."""

    epochs = len(result.hist_tr)
    return {"epochs_run": epochs, "best_epoch": result.best_epoch, "best_val_loss": result.best_val,
            "stopped_by": stopped_by(epochs, result.best_epoch, patience), "train_loss": result.hist_tr,
            "val_loss": result.hist_va, "optimizer_steps": result.opt_steps}


@dataclass
class FinetuneJob:
    """Kind ``finetune`` (spec :class:`.config.FinetuneSpec`): ``fs.encoder`` + ``fs.head`` trained
    end to end on ``fs.probe`` of build ``fs.data``, scored like a head run; its folder
    ``OUT/<encoder>-<finetuned|scratch>-<build>/<probe>/<head>[,<options>]/seed<k>`` also holds
    ``encoder.safetensors`` (ready for ``spar-probe cache --weights``) and ``timing.json``."""

    fs: Any
    rd: Path
    record: Any
    predictor: FinetunedEncoder
    splits: Any
    build: Any
    options: Any
    declared: frozenset[str] = field(default_factory=finetune_files)

    @staticmethod
    def rescore(rd: Path, target) -> Path:
        """The run scored on another cache (its head, as a head run's), or on a build its own
        trained encoder re-encodes (``target.data`` alone:
        :func:`~.encoding.run_eval_reencoded`)."""

        if target.features is not None:
            return run_eval(rd, target.features, target.data, target.n_boot, overwrite=target.overwrite)
        if target.data is None:
            raise ConfigError(NEEDS_FEATURES)
        return run_eval_reencoded(rd, target.data, target.n_boot, encoder=target.encoder, overwrite=target.overwrite)

    @classmethod
    def open(cls, fs, out, options) -> FinetuneJob:
        check_encoder_name(fs.encoder)  # names first: a typo is named before any file is read
        hrun, kind = fs.head_run(), head_input(fs.head)  # the head's run: the build's images are its features
        build = Build(fs.data)
        splits = build_splits(build, hrun)
        encoding, precision = load_encoding(fs.encoder, build, fs.seed, fs.cfg, weights=fs.weights, init=fs.init,
                                            model_kwargs=fs.model_kwargs, revision=fs.revision)  # fmt: skip
        check_encoder_reads(encoding.enc.spec, hrun.spec, fs.data)
        encoder = published_encoder(fs.encoder, encoding.enc.spec)  # no local path in the folder name or any record
        variant = fs.variant()
        rd = fs.run_dir(out, run_slug(encoder, fs.init, fs.data))
        model, in_dim, n_tokens = new_head(encoding, fs.head, hrun.spec, kind, fs.seed, fs.head_cfg,
                                           Split(splits.tr, hrun.spec.level, "train"), fs.init == "scratch")  # fmt: skip
        record = finetune_record(fs, encoder, encoding.enc.spec, build, kind, precision, variant)
        training = training_record(fs.init, build, encoding.enc.spec.weights)
        record = record.replace(extra=finetune_extra(fs, encoding.enc.spec, kind, model, (in_dim, n_tokens),
                                                     precision, training))  # fmt: skip
        key = run_key(encoder=encoder, weights=encoding.enc.spec.weights, init=fs.init, model_kwargs=fs.model_kwargs,
                      build=build.fingerprint, probe=fs.probe, head=fs.head, head_cfg=fs.head_cfg, seed=fs.seed,
                      cfg=fs.cfg.to_dict(), compute=precision.dtype, train_mirrors=fs.train_mirrors)  # fmt: skip
        trainer = Trainer(encoding, model, kind, fs.seed, rd, key, options.progress)
        predictor = FinetunedEncoder(hrun, encoding, model, kind, (in_dim, n_tokens), trainer, splits.val_split,
                                     options.resume)  # fmt: skip
        return cls(fs, rd, record, predictor, splits, build, options)

    def start(self) -> None:
        """A fresh run folder, or the checkpointed one with ``--resume``; an interrupted run is
        refused without ``--resume`` or ``--overwrite``; never a foreign folder."""

        check_target(self.rd)
        check_run_dir(self.rd, self.declared, "finetune run folder")
        started = (self.rd / CHECKPOINT).is_file()
        if started and self.options.resume:
            return
        if started and not self.options.overwrite:
            raise ConfigError(f"{self.rd}: holds an interrupted run; pass --resume to continue it, or --overwrite")
        fresh_run_dir(self.rd, lambda p: owned_run(p, self.declared), "finetune run folder")

    def fit(self):
        return self.predictor.fit(self.splits.tr, self.splits.va)

    def score(self, result):
        from .model import EXPORT_FILE, export_encoder

        fs, hrun, s, rec = self.fs, self.predictor.run, self.splits, self.record
        prior = hrun.spec.fit_prior(s.tr)
        scored = evaluate(hrun, self.predictor, s, prior)
        metrics = run_metrics(hrun, s, scored, encoder=self.rd.parent.parent.parent.name, variant=rec.variant,
                              layer=fs.cfg.layer, train=train_record(result, fs.cfg.patience),
                              training=rec.extra["training"], manifest=self.build.manifest)  # fmt: skip
        timing = {"images": result.images, "seconds": result.seconds,
                  "images_per_s": result.images / max(result.seconds, 1e-9)}
        meta = {"encoder": rec.model, "encoder_config": rec.extra["encoder_config"],
                "model_args": rec.inputs["model_args"], "training": rec.extra["training"],
                "run": {"probe": rec.probe, "head": rec.head, "seed": rec.seed}}
        enc, model = self.predictor.encoding.enc, self.predictor.model
        files = {EXPORT_FILE: (lambda p: export_encoder(enc, p, meta), True),
                 HEAD_FILE: (lambda p: save_head(p, model, rec.to_dict(), prior), True),
                 TIMING_FILE: (lambda p: p.write_text(json.dumps(timing, indent=2) + "\n"), False)}
        return metrics, rec, files
