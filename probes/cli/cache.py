"""``spar-probe cache``: encode every image of a build and store its features
(:func:`spar_bench.probes.cache.write_cache`)."""

from __future__ import annotations

import click

from spar_bench.clitools import field_options, given, old_spelling, wait_option

from ..cache import STORAGE_DTYPES, TILE_ENCODINGS, CacheOptions, cache_options, write_cache
from ..distributed import die_with_launcher
from .options import compute_option, device_option, loader_workers_option


@click.command("cache")
@click.option("--encoder", required=True, help="Encoder name (see `spar-probe encoders`), e.g. timm:resnet50.")
@click.option("--weights", default=None, help="Weights file or folder for the encoder.")
@click.option("--random-init", is_flag=True, help="Use a randomly initialised network on purpose (recorded).")
@click.option("--revision", default=None, help="Pinned hub revision (hf: encoders).")
@click.option("--model-args", default=None,
              help='JSON for the model constructor (timm:, monai:), e.g. \'{"input_size": 32}\' (recorded).')
@click.option("--data", required=True, type=click.Path(file_okay=False), help="Build folder (with manifest.json).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Cache file, e.g. cache/resnet50.h5.")
@click.option("--levels", default=None, help="Comma-separated levels (default: all in the build).")
@click.option("--splits", default=None, help="Comma-separated splits (default: all).")
@field_options(CacheOptions, "layers", helps={"layers": "Comma-separated layer indices, e.g. -1,-4."},
               types={"layers": click.STRING})
@click.option("--probe", default=None,
              help="A question stage (mllm:DIR@llm:N+q) only: the Level 3 probe whose questions it reads, "
                   "e.g. level3.size (the cache holds a row per question of that probe).")
@device_option(CacheOptions)
@field_options(CacheOptions, "batch_size", "dtype", helps={
    "batch_size": "Images per batch.", "dtype": "Storage dtype of tokens and pooled vectors."},
    types={"batch_size": click.IntRange(1), "dtype": click.Choice(sorted(STORAGE_DTYPES))})  # fmt: skip
@old_spelling("--batch", "--batch-size", "batch_size", type=click.IntRange(1))
@compute_option(CacheOptions)
@field_options(CacheOptions, "processes", helps={
    "processes": "CPU only: 1-thread processes, each encoding the next batch when free, written in order (the file is the "
                 "same for any number; default: one per usable core)."}, types={"processes": click.IntRange(1)})
@loader_workers_option("DataLoader workers reading shards (default: 2 on CUDA, 0 on CPU).")
@click.option("--overwrite", is_flag=True, help="Delete an existing cache at --out first.")
@field_options(CacheOptions, "tile_encoding", types={"tile_encoding": click.Choice(TILE_ENCODINGS)}, helps={
    "tile_encoding": "Levels 1-2: encode each mosaic whole, or each 56-pixel tile resized to the encoder's input "
                     "and encoded alone (the 16 token sets stacked; pooled: the 16 vectors side by side)."})  # fmt: skip
@click.option("--token-grid", type=int, default=None,
              help="Pool each token grid to G x G by area averaging before storing (e.g. 37x37 -> 14); "
                   "prefix tokens are kept.")
@click.option("--token-proj", default=None,
              help="Project stored tokens to K dimensions: pca:K (fitted on training images only) or "
                   "random:K (seeded); the map is stored in the cache.")
@click.option("--token-int8", is_flag=True,
              help="Store tokens as int8 with one scale per row and channel (dequantised on read).")
@wait_option  # the cache file's lock is taken by write_cache (spar_bench.locks)
def cache_command(encoder, weights, random_init, revision, model_args, data, out, levels, splits, layers,
                  probe, device, batch_size, dtype, compute, processes, workers, overwrite, tile_encoding,
                  token_grid, token_proj, token_int8) -> None:
    """Encode every image of a build and store tokens + pooled vectors (resumable)."""
    die_with_launcher()  # a torchrun rank ends with torchrun, however torchrun ends
    path = write_cache(encoder, data, out, cache_options(
        weights=weights, random_init=random_init, revision=revision, model_args=model_args, levels=levels,
        splits=splits, probe=probe, device=device, compute=compute, loader_workers=workers, overwrite=overwrite,
        token_grid=token_grid, token_proj=token_proj, token_int8=token_int8,
        **given({"layers": layers, "batch_size": batch_size, "dtype": dtype, "tile_encoding": tile_encoding,
                 "processes": processes}),
    ))
    click.echo(str(path))
