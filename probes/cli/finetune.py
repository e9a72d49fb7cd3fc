"""``spar-probe finetune``: train an encoder and a probe head end to end on a build's images
(the run is kind ``finetune``, :class:`spar_bench.probes.finetune.predictor.FinetuneJob`, made by
:func:`spar_bench.probes.runs.session.run`)."""

from __future__ import annotations

import json

import click

from spar_bench.clitools import declared_type, wait_option
from spar_bench.locks import output_lock

from ..finetune.config import FinetuneConfig, FinetuneSpec, finetune_specs
from ..finetune.encoding import parse_model_args
from ..runs.session import run_all
from .options import (
    bootstrap_option,
    compute_option,
    device_option,
    fmt,
    head_option,
    loader_workers_option,
    names_all,
    probe_option,
    seeds_option,
    spec_options,
    threads_option,
)


@click.command("finetune")
@click.option("--encoder", required=True, help="Encoder spec, e.g. timm:resnet18 (see `spar-probe encoders`).")
@click.option("--weights", default=None, help="Weights to finetune from (file or folder).")
@click.option("--init", "init", type=declared_type(FinetuneSpec, "init"), default="weights", show_default=True,
              help="scratch: train the architecture from random weights (recorded as trained from scratch).")
@click.option("--model-args", default=None, help='JSON for timm.create_model, e.g. \'{"depth": 4}\'.')
@click.option("--revision", default=None, help="Pinned hub revision (hf: encoders).")
@click.option("--data", required=True, type=click.Path(file_okay=False), help="Build folder (manifest.json).")
@head_option("mlp")
@probe_option()
@seeds_option()
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False))
@click.option("--encoder-lr", default=1e-4, show_default=True, type=float)
@click.option("--head-lr", default=1e-3, show_default=True, type=float)
@click.option("--weight-decay", default=0.05, show_default=True, type=float)
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(1), help="Images per batch.")
@click.option("--accum", default=1, show_default=True, type=int, help="Batches per optimizer step.")
@click.option("--max-epochs", default=20, show_default=True, type=int)
@click.option("--warmup-epochs", default=1.0, show_default=True, type=float)
@click.option("--patience", default=5, show_default=True, type=int, help="Early stopping on the validation loss.")
@click.option("--freeze-blocks", default=0, show_default=True, type=int, help="Freeze the stem and the first N blocks.")
@click.option("--layer", default=-1, show_default=True, type=int)
@device_option
@compute_option
@loader_workers_option("DataLoader workers (default: 2 on CUDA, 0 on CPU).")
@click.option("--checkpoint-every", default=0, show_default=True, type=int,
              help="Also checkpoint every N optimizer steps (0: at epoch ends only).")
@threads_option
@bootstrap_option
@click.option("--no-controls", is_flag=True, help="Skip the blind baseline.")
@click.option("--train-mirrors", is_flag=True, help="Also train on mirrored counterfactual samples.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a finished or interrupted run (train it again).")
@spec_options(("head",))
@wait_option
def finetune_command(encoder, weights, init, model_args, revision, data, head, probes, seeds, out, encoder_lr,
                     head_lr, weight_decay, batch_size, accum, max_epochs, warmup_epochs, patience,
                     freeze_blocks, layer, device, compute, workers, checkpoint_every, threads, n_boot,
                     no_controls, train_mirrors, resume, overwrite, **head_opts):
    """Train an encoder and probe heads end to end on a build's images (finetune or from scratch;
    one run per probe x head x seed)."""
    import torch

    torch.set_num_threads(threads)
    cfg = FinetuneConfig(encoder_lr=encoder_lr, head_lr=head_lr, weight_decay=weight_decay,
                         batch_size=batch_size, accum=accum, max_epochs=max_epochs,
                         warmup_epochs=warmup_epochs, patience=patience, freeze_blocks=freeze_blocks,
                         layer=layer, device=device, compute=compute, workers=workers,
                         checkpoint_every=checkpoint_every)
    grid = finetune_specs(encoder, str(data), probes, head, seeds, weights=weights, init=init,
                          model_kwargs=parse_model_args(model_args), revision=revision, cfg=cfg, n_boot=n_boot,
                          controls=not no_controls, train_mirrors=train_mirrors, head_options=head_opts)  # fmt: skip
    click.get_current_context().with_resource(output_lock(out, what="spar-probe finetune"))
    for fs, rd in run_all(grid, out, skip_unavailable=names_all(probes), resume=resume, overwrite=overwrite):
        m = json.loads((rd / "metrics.json").read_text())
        key = m["headline"]
        click.echo(f"{fs.probe} {fs.head} seed{fs.seed}: {key}={fmt(m['test'].get(key))} -> {rd}")
