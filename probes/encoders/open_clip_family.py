"""``open_clip:<model name>`` and ``open_clip:local-dir:PATH``: the vision tower of a CLIP model.

``open_clip:local-dir:PATH`` loads ``PATH/open_clip_config.json`` (``model_cfg`` +
``preprocess_cfg``) and the checkpoint found next to it (``open_clip_model.safetensors``,
``open_clip_pytorch_model.bin``, ...), the layout of hub folders such as BiomedCLIP's,
without any network access; the encoder is then named by the folder's base name and a
content hash (``open_clip:local-dir:BiomedCLIP@1a2b3c4d``), never its path.
``open_clip:<builtin name>`` takes ``--weights FILE``.
Either takes ``--weights RUN/encoder.safetensors``, a ``spar-probe finetune`` export: the
model is built from its config and the export's vision tower (``module`` in its header:
``visual.trunk`` or ``visual``, see :data:`TOWER_MODULES`) loaded over it; an export of
another family or tower, or whose keys do not fit, is refused naming the file.

A BiomedCLIP-style tower wraps a timm trunk: tokens come from the trunk exactly as for
``timm:`` encoders (layer ``-1`` = ``trunk.forward_features``, other layers via
``forward_intermediates``). A native open_clip ``VisionTransformer`` uses its own
``forward_intermediates`` (block outputs; layer ``-1`` = the last block, before ``ln_post``).
Preprocessing (size, mean, std, interpolation) comes from the tower's ``preprocess_cfg``.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any

from spar_bench.compat import find_open_clip_checkpoint
from spar_bench.errors import ConfigError

from .base import (
    Encoder,
    EncoderSpec,
    WeightsGiven,
    check_export,
    load_into,
    load_state_dict_file,
    local_name,
    read_export_meta,
    require_extra,
    sha256_file,
    weights_record,
)
from .timm_family import TimmEncoder, timm_spec_from_model

LOCAL = "local-dir:"
#: the part of the CLIP model each tower kind encodes with: what a finetune export holds.
TOWER_MODULES = {"timm-trunk": "visual.trunk", "open_clip-vit": "visual"}


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
    export = read_export_meta(weights) if weights is not None else None
    model_name, pretrained, record = _source(rest, name, weights, random_init, export)
    if rest.startswith(LOCAL):  # named by the folder's base name and content, never its path
        folder = rest[len(LOCAL):]
        name = local_name(f"open_clip:{LOCAL}", folder, sha256_file(folder))
    kw = {"load_weights": False} if export and _takes(open_clip.create_model, "load_weights") else {}
    try:
        model = open_clip.create_model(model_name, pretrained=pretrained, device="cpu", **kw)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"encoder {name}: open_clip cannot build it: {str(e).splitlines()[0]}") from None
    enc = _tower(model.visual.eval(), name, record)
    if export:  # a `spar-probe finetune` export: the trained tower over the model's architecture
        module = enc.spec.extra["module"]
        check_export(weights, export, name, "open_clip", module)
        load_into(enc.module, load_state_dict_file(weights), weights, name)
    return enc


def _takes(fn: Any, arg: str) -> bool:
    return arg in inspect.signature(fn).parameters


def _source(rest: str, name: str, weights: str | None, random_init: bool,
            export: dict[str, Any] | None) -> tuple[str, str | None, dict[str, Any]]:
    """``(open_clip model name, pretrained file or None, weights record)`` of ``open_clip:rest``.

    ``export`` (the header of a ``spar-probe finetune`` export given as ``--weights``): the
    model's architecture is built and the export's tower loaded over it (``load_open_clip``).
    """
    if not rest.startswith(LOCAL):
        record = weights_record(weights, random_init, name)
        return rest, (str(weights) if weights and not export else None), record
    folder = Path(rest[len(LOCAL):])
    if not (folder / "open_clip_config.json").is_file():
        raise ConfigError(f"encoder {name}: {folder}/open_clip_config.json not found")
    if export:
        return f"{LOCAL}{folder}", None, weights_record(weights, random_init, name)

    ckpt = find_open_clip_checkpoint(folder)
    if weights is not None:
        raise ConfigError(
            f"encoder {name}: the folder holds the weights; --weights takes only a `spar-probe finetune` "
            f"export (encoder.safetensors), not {weights}"
        )
    if ckpt is None and not random_init:
        raise ConfigError(
            f"encoder {name}: no checkpoint (*.safetensors, *.bin, *.pth) in {folder}; "
            "add one or pass --random-init"
        )
    if ckpt is not None and random_init:
        raise WeightsGiven(name, f"{folder} (checkpoint {Path(ckpt).name})")
    record = weights_record(ckpt, False, name) if ckpt else {"kind": "random-init"}
    return f"{LOCAL}{folder}", None, record


def _tower(visual: Any, name: str, record: dict[str, Any]) -> Encoder:
    """The encoder of a CLIP model's vision tower: its timm trunk, or open_clip's own ViT."""
    pre = _preprocess(visual)
    trunk = getattr(visual, "trunk", None)
    if trunk is not None:
        spec = timm_spec_from_model(trunk, name, "open_clip", record)
        spec = replace(spec, input_size=pre["size"], mean=pre["mean"], std=pre["std"],
                       interpolation=pre["interpolation"],
                       extra={**spec.extra, "tower": "timm-trunk", "module": TOWER_MODULES["timm-trunk"]})
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
        random_init=record["kind"] == "random-init", pooled="cls",
        extra={"tower": "open_clip-vit", "module": TOWER_MODULES["open_clip-vit"]},
    )
    enc = OpenClipNativeEncoder(spec, visual)
    with torch.inference_mode():
        t = enc._layer_tokens(enc.preprocess(torch.zeros(1, 224, 224, dtype=torch.uint8)), [-1])[-1]
    grid = tuple(int(g) for g in getattr(visual, "grid_size", (0, 0)))
    n_prefix = int(t.shape[1]) - grid[0] * grid[1] if grid[0] else 0
    ps = getattr(visual, "patch_size", None)
    enc.spec = replace(spec, grid=grid, n_prefix=n_prefix, dim=int(t.shape[-1]),
                       patch_size=int(ps[0] if isinstance(ps, (tuple, list)) else ps) if ps else None,
                       pooled="mean-patch" if n_prefix == 0 else spec.pooled)
    return enc
