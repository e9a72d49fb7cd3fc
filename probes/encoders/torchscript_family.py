"""``torchscript:PATH``: a scripted / traced module that maps images to tokens.

The module takes a normalised float tensor ``(B, C, H, W)`` and returns tokens
``(B, T, D)`` (or a list/tuple of them, one per layer, the last being layer ``-1``).
An optional sidecar ``PATH.json`` describes it (all keys optional)::

    {"input_size": [224, 224], "in_chans": 3, "mean": [...], "std": [...],
     "interpolation": "bilinear", "n_prefix": 1, "grid": [14, 14], "pooled": "cls"}

Without a sidecar: 224 x 224, 3 channels, ImageNet mean/std, no prefix tokens, mean pooling.
The encoder is named by the file's base name and content hash (``torchscript:tok.pt@1a2b3c4d``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from spar_bench.errors import ConfigError

from .base import Encoder, EncoderSpec, local_name, sha256_file


class TorchScriptEncoder(Encoder):
    def _raw(self, x):
        out = self.module(x)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def _layer_tokens(self, x, layers):
        outs = self._raw(x)
        res = {}
        for v in layers:
            t = outs[v]
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
    cfg = json.loads(side.read_text()) if side.is_file() else {}
    sha = sha256_file(path)
    spec = EncoderSpec(
        name=local_name("torchscript:", path, sha), family="torchscript",
        input_size=tuple(cfg.get("input_size", (224, 224))),
        in_chans=int(cfg.get("in_chans", 3)),
        mean=tuple(cfg.get("mean", EncoderSpec.mean)), std=tuple(cfg.get("std", EncoderSpec.std)),
        interpolation=cfg.get("interpolation", "bilinear"),
        n_prefix=int(cfg.get("n_prefix", 0)), pooled=cfg.get("pooled", "mean-patch"),
        weights={"kind": "file", "name": path.resolve().name, "sha256": sha},
        random_init=False, extra={"sidecar": side.name if side.is_file() else None},
    )
    enc = TorchScriptEncoder(spec, module)
    with torch.inference_mode():
        outs = enc._raw(enc.preprocess(torch.zeros(1, 224, 224, dtype=torch.uint8)))
    t = outs[-1]
    if t.ndim != 3:
        raise ConfigError(f"encoder {name}: the module returned {tuple(t.shape)}, expected tokens (B, T, D)")
    n_patch = int(t.shape[1]) - spec.n_prefix
    enc.spec = replace(spec, n_layers=len(outs) if len(outs) > 1 else None, dim=int(t.shape[-1]),
                       grid=tuple(cfg["grid"]) if "grid" in cfg else (1, n_patch))
    return enc
