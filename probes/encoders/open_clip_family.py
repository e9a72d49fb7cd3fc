"""``open_clip:<model name>`` and ``open_clip:local-dir:PATH``: the vision tower of a CLIP model.

``open_clip:local-dir:PATH`` loads ``PATH/open_clip_config.json`` (``model_cfg`` +
``preprocess_cfg``) and the checkpoint found next to it (``open_clip_model.safetensors``,
``open_clip_pytorch_model.bin``, ...), the layout of hub folders such as BiomedCLIP's,
without any network access. ``open_clip:<builtin name>`` takes ``--weights FILE``.

A BiomedCLIP-style tower wraps a timm trunk: tokens come from the trunk exactly as for
``timm:`` encoders (layer ``-1`` = ``trunk.forward_features``, other layers via
``forward_intermediates``). A native open_clip ``VisionTransformer`` uses its own
``forward_intermediates`` (block outputs; layer ``-1`` = the last block, before ``ln_post``).
Preprocessing (size, mean, std, interpolation) comes from the tower's ``preprocess_cfg``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from .base import Encoder, EncoderSpec, require_extra, sha256_file, weights_record
from .timm_family import TimmEncoder, timm_spec_from_model

LOCAL = "local-dir:"


class OpenClipNativeEncoder(Encoder):
    def _layer_tokens(self, x, layers):
        import torch

        n = self.spec.n_layers
        pos = sorted({v % n for v in layers})
        out = self.module.forward_intermediates(
            x, indices=pos, intermediates_only=True, output_fmt="NLC", output_extra_tokens=True
        )
        inter = out["image_intermediates"]
        prefix = out.get("image_intermediates_prefix")
        res = {}
        for v in layers:
            i = pos.index(v % n)
            t = inter[i]
            if t.ndim == 4:
                t = t.flatten(2).transpose(1, 2)
            res[v] = torch.cat([prefix[i], t], dim=1) if prefix is not None else t
        return res


def _preprocess(visual: Any) -> dict[str, Any]:
    cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
    size = cfg.get("size", getattr(visual, "image_size", 224))
    if isinstance(size, int):
        size = (size, size)
    return {
        "size": (int(size[0]), int(size[1])),
        "mean": tuple(float(v) for v in cfg.get("mean", (0.48145466, 0.4578275, 0.40821073))),
        "std": tuple(float(v) for v in cfg.get("std", (0.26862954, 0.26130258, 0.27577711))),
        "interpolation": str(cfg.get("interpolation", "bicubic")),
    }


def load_open_clip(rest: str, *, weights: str | None = None, random_init: bool = False,
                   revision: str | None = None) -> Encoder:
    """Factory of ``open_clip:...``."""
    name = f"open_clip:{rest}"
    open_clip = require_extra("open_clip", "open_clip")
    if revision is not None:
        raise ConfigError(f"encoder {name}: --revision is not supported; point at a local folder")
    if rest.startswith(LOCAL):
        folder = Path(rest[len(LOCAL):])
        if not (folder / "open_clip_config.json").is_file():
            raise ConfigError(f"encoder {name}: {folder}/open_clip_config.json not found")
        from spar_bench.compat import find_open_clip_checkpoint

        ckpt = find_open_clip_checkpoint(folder)
        if weights is not None:
            raise ConfigError(f"encoder {name}: the folder holds the weights; drop --weights")
        if ckpt is None and not random_init:
            raise ConfigError(
                f"encoder {name}: no checkpoint (*.safetensors, *.bin, *.pth) in {folder}; "
                "add one or pass --random-init"
            )
        if ckpt is not None and random_init:
            raise ConfigError(f"encoder {name}: {folder} holds weights {Path(ckpt).name}; drop --random-init")
        record = (
            {"kind": "file", "path": str(Path(ckpt).resolve()), "sha256": sha256_file(ckpt)}
            if ckpt else {"kind": "random-init"}
        )
        model_name, pretrained = f"{LOCAL}{folder}", None
    else:
        record = weights_record(weights, random_init, name)
        model_name, pretrained = rest, (str(weights) if weights else None)
    try:
        model = open_clip.create_model(model_name, pretrained=pretrained, device="cpu")
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"encoder {name}: open_clip cannot build it: {str(e).splitlines()[0]}") from None
    visual = model.visual.eval()
    pre = _preprocess(visual)
    trunk = getattr(visual, "trunk", None)
    if trunk is not None:
        spec = timm_spec_from_model(trunk, name, "open_clip", record)
        spec.input_size, spec.mean, spec.std = pre["size"], pre["mean"], pre["std"]
        spec.interpolation = pre["interpolation"]
        spec.extra["tower"] = "timm-trunk"
        return TimmEncoder(spec, trunk)
    if not hasattr(visual, "forward_intermediates"):
        raise ConfigError(f"encoder {name}: its vision tower {type(visual).__name__} exposes no tokens")
    import torch

    n_layers = len(getattr(getattr(visual, "transformer", None), "resblocks", [])) or None
    if n_layers is None:
        raise ConfigError(f"encoder {name}: only ViT towers (timm trunk or open_clip VisionTransformer) are supported")
    spec = EncoderSpec(
        name=name, family="open_clip", input_size=pre["size"], mean=pre["mean"], std=pre["std"],
        interpolation=pre["interpolation"], n_layers=n_layers, weights=record,
        random_init=record["kind"] == "random-init", pooled="cls", extra={"tower": "open_clip-vit"},
    )
    enc = OpenClipNativeEncoder(spec, visual)
    with torch.inference_mode():
        t = enc._layer_tokens(enc.preprocess(torch.zeros(1, 224, 224, dtype=torch.uint8)), [-1])[-1]
    grid = tuple(int(g) for g in getattr(visual, "grid_size", (0, 0)))
    n_prefix = int(t.shape[1]) - grid[0] * grid[1] if grid[0] else 0
    spec.grid, spec.n_prefix, spec.dim = grid, n_prefix, int(t.shape[-1])
    ps = getattr(visual, "patch_size", None)
    spec.patch_size = int(ps[0] if isinstance(ps, (tuple, list)) else ps) if ps else None
    if n_prefix == 0:
        spec.pooled = "mean-patch"
    return enc
