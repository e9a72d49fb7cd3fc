"""``torchscript:PATH``: a scripted / traced module that maps images to tokens.

The module takes a normalised float tensor ``(B, C, H, W)`` and returns tokens
``(B, T, D)`` (or a list/tuple of them, one per layer, the last being layer ``-1``).
An optional sidecar ``PATH.json`` describes it (all keys optional)::

    {"input_size": [224, 224], "in_chans": 3, "mean": [...], "std": [...],
     "interpolation": "bilinear", "n_prefix": 1, "grid": [14, 14], "pooled": "cls"}

Without a sidecar: 224 x 224, 3 channels, ImageNet mean/std, no prefix tokens, mean pooling.
The encoder is named by the file's base name and content hash (``torchscript:tok.pt@1a2b3c4d``).

A 3-D encoder (Level 4 volumes) has a sidecar with a 3-entry ``"input_size": [S, S, S]``: the
module takes ``(B, C, S, S, S)`` (default 1 channel, mean 0, std 1: the volume scaled to
[0, 1]) and returns 3-D feature maps ``(B, C', D', H', W')`` (or, with ``"channels_last":
true``, ``(B, D', H', W', C')``), or tokens ``(B, T, D)`` whose grid the sidecar's 3-entry
``"grid"`` gives (else the cube of the patch tokens); maps are flattened z-major.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from spar_bench.errors import ConfigError

from .base import Encoder, EncoderSpec, local_name, ncdhw_to_tokens, sha256_file, volume_grids


class TorchScriptEncoder(Encoder):
    def _raw(self, x):
        out = self.module(x)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if self.spec.volumetric and self.spec.extra.get("channels_last"):
            outs = [t.permute(0, 4, 1, 2, 3) if t.ndim == 5 else t for t in outs]
        return outs

    def _layer_tokens(self, x, layers):
        outs = self._raw(x)
        res = {}
        for v in layers:
            t = outs[v]
            if t.ndim == 5 and self.spec.volumetric:
                t = ncdhw_to_tokens(t)
            if t.ndim != 3:
                raise ConfigError(f"encoder {self.spec.name}: the module returned {tuple(t.shape)}, expected (B, T, D)")
            res[v] = t
        return res


def load_torchscript(rest: str, *, weights: str | None = None, random_init: bool = False,
                     revision: str | None = None) -> TorchScriptEncoder:
    """Factory of ``torchscript:PATH`` (the file is the weights: no ``--weights``)."""
    import torch

    name = f"torchscript:{rest}"
    path = Path(rest)
    if weights is not None or random_init or revision is not None:
        raise ConfigError(f"encoder {name}: the scripted file holds its weights; drop --weights/--random-init/--revision")
    if not path.is_file():
        raise ConfigError(f"encoder {name}: {path} does not exist")
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except RuntimeError as e:
        raise ConfigError(f"encoder {name}: {path} is not a TorchScript file ({str(e).splitlines()[0]})") from None
    side = path.with_name(path.name + ".json")
    try:
        cfg = json.loads(side.read_text()) if side.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"encoder {name}: sidecar {side} is not JSON ({e})") from None
    sha = sha256_file(path)
    size = tuple(int(v) for v in cfg.get("input_size", (224, 224)))
    if len(size) not in (2, 3):
        raise ConfigError(f"encoder {name}: sidecar input_size must be [H, W] or [S, S, S], got {list(size)}")
    vol = len(size) == 3
    extra = {"sidecar": side.name if side.is_file() else None}
    if vol:
        extra["channels_last"] = bool(cfg.get("channels_last", False))
    spec = EncoderSpec(
        name=local_name("torchscript:", path, sha), family="torchscript", input_size=size,
        in_chans=int(cfg.get("in_chans", 1 if vol else 3)),
        mean=tuple(cfg.get("mean", (0.0,) if vol else EncoderSpec.mean)),
        std=tuple(cfg.get("std", (1.0,) if vol else EncoderSpec.std)),
        interpolation=cfg.get("interpolation", "trilinear" if vol else "bilinear"),
        n_prefix=int(cfg.get("n_prefix", 0)), pooled=cfg.get("pooled", "mean-patch"),
        weights={"kind": "file", "name": path.resolve().name, "sha256": sha},
        random_init=False, extra=extra,
    )
    enc = TorchScriptEncoder(spec, module)
    if vol:
        return _volume_spec(enc, cfg, name)
    with torch.inference_mode():
        outs = enc._raw(enc.preprocess(torch.zeros(1, 224, 224, dtype=torch.uint8)))
    t = outs[-1]
    if t.ndim != 3:
        raise ConfigError(f"encoder {name}: the module returned {tuple(t.shape)}, expected tokens (B, T, D)")
    n_patch = int(t.shape[1]) - spec.n_prefix
    enc.spec = replace(spec, n_layers=len(outs) if len(outs) > 1 else None, dim=int(t.shape[-1]),
                       grid=tuple(cfg["grid"]) if "grid" in cfg else (1, n_patch))
    return enc


def _volume_spec(enc: TorchScriptEncoder, cfg: dict, name: str) -> TorchScriptEncoder:
    """A 3-D encoder's token layout from one dry forward: every output's grid and width."""
    import torch

    try:
        with torch.inference_mode():
            outs = enc._raw(enc.preprocess(enc.blank()))
    except RuntimeError as e:
        raise ConfigError(f"encoder {name}: the module failed on a blank (1, {enc.spec.in_chans}, "
                          f"{', '.join(map(str, enc.spec.input_size))}) volume ({str(e).splitlines()[0]})") from None
    grids, n_prefix = {}, enc.spec.n_prefix
    for v, t in enumerate(outs):
        if t.ndim == 5:
            grids.update(volume_grids({v: t}))
        elif t.ndim == 3:
            grids[str(v)] = _token_grid(int(t.shape[1]) - n_prefix, cfg.get("grid"), name)
        else:
            raise ConfigError(f"encoder {name}: output {v} is {tuple(t.shape)}; a 3-D encoder returns "
                              "(B, C, D, H, W) maps or (B, T, D) tokens")
    grids["-1"] = grids[str(len(outs) - 1)]
    last = outs[-1]
    dim = int(last.shape[1] if last.ndim == 5 else last.shape[-1])
    enc.spec = replace(enc.spec, n_layers=len(outs) if len(outs) > 1 else None, dim=dim,
                       grid=tuple(grids["-1"]), extra={**enc.spec.extra, "layer_grids": grids})
    return enc


def _token_grid(patches: int, grid, name: str) -> list[int]:
    """The (D', H', W') grid of ``patches`` tokens: the sidecar's, else their cube."""
    if grid is not None:
        if len(grid) != 3 or grid[0] * grid[1] * grid[2] != patches:
            raise ConfigError(f"encoder {name}: sidecar grid {grid} does not hold the module's {patches} patch tokens")
        return [int(g) for g in grid]
    side = round(patches ** (1 / 3))
    if side**3 != patches:
        raise ConfigError(f"encoder {name}: {patches} patch tokens are not a cube; give the sidecar a 3-entry \"grid\"")
    return [side] * 3
