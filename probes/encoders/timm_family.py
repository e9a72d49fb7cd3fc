"""``timm:<model name>``: any timm model, weights from a local file or a timm-style folder.

``timm.create_model(name, pretrained=False, num_classes=0)`` builds the network (no
download ever); ``--weights`` loads a ``.safetensors`` / ``.pth`` / ``.bin`` state dict, or a
folder holding timm's ``config.json`` + ``model.safetensors`` (``pytorch_model.bin``), as saved
by ``timm.models.push_to_hf_hub`` / ``save_for_hf``. Preprocessing comes from
``timm.data.resolve_data_config`` (the pretrained config, or the folder's ``config.json``).

Tokens: layer ``-1`` is ``forward_features`` (ViT: prefix + patch tokens after the final
norm; CNN: the last feature map flattened ``(B,C,H,W) -> (B,H*W,C)``); other layers come
from ``forward_intermediates`` (block outputs before the final norm; for CNNs, the stages).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from .base import (
    Encoder,
    EncoderSpec,
    check_export,
    load_into,
    load_state_dict_file,
    nchw_to_tokens,
    read_export_meta,
    weights_record,
)
from .coordconv import COORD_KEY, add_coord_channels


def _folder_weights(folder: Path) -> tuple[Path, dict[str, Any]]:
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    for fname in ("model.safetensors", "pytorch_model.bin", "model.pth"):
        if (folder / fname).is_file():
            return folder / fname, cfg
    raise ConfigError(
        f"timm weights folder {folder} has no model.safetensors / pytorch_model.bin / model.pth"
    )


class TimmEncoder(Encoder):
    def _layer_tokens(self, x, layers):
        m = self.module
        out: dict[int, Any] = {}
        if -1 in layers:
            out[-1] = self._as_tokens(m.forward_features(x))
        rest = [v for v in layers if v != -1]
        if rest:
            n = self.spec.n_layers
            pos = sorted({v % n for v in rest})
            feats = m.forward_intermediates(x, indices=pos, intermediates_only=True, **self._kw)
            by_pos = dict(zip(pos, feats, strict=True))
            for v in rest:
                out[v] = self._as_tokens(by_pos[v % n])
        return out

    @property
    def _kw(self) -> dict[str, Any]:
        if self.spec.n_prefix > 0:
            return {"return_prefix_tokens": True, "output_fmt": "NLC", "norm": False}
        if self.spec.extra.get("vit_like"):
            return {"output_fmt": "NLC", "norm": False}
        return {}

    @staticmethod
    def _as_tokens(f):
        import torch

        if isinstance(f, tuple):  # (patch tokens, prefix tokens) from a ViT
            patches, prefix = f
            if patches.ndim == 4:
                patches = nchw_to_tokens(patches)
            return torch.cat([prefix, patches], dim=1)
        if f.ndim == 4:
            return nchw_to_tokens(f)
        return f


def build_timm_model(name: str, num_classes: int = 0, **kwargs: Any):
    """timm's ``name`` with random weights, never downloaded; ``num_classes=0``: no classifier."""
    import timm

    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            import difflib

            close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"timm has no model {name!r}.{hint}") from None
        raise


def timm_spec_from_model(model, name: str, family: str, weights: dict[str, Any]) -> EncoderSpec:
    """Derive token layout, dims and preprocessing of a built timm model (one dry forward)."""
    import timm.data
    import torch

    cfg = timm.data.resolve_data_config({}, model=model)
    in_chans = int(cfg["input_size"][0])
    size = (int(cfg["input_size"][1]), int(cfg["input_size"][2]))
    pe_size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if pe_size is not None:  # a ViT built for another size (model_args img_size) takes that size
        size = (int(pe_size[0]), int(pe_size[1]))
    n_prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    with torch.inference_mode():
        f = model.forward_features(torch.zeros(1, in_chans, *size))
    vit_like = f.ndim == 3
    if vit_like:
        pe = getattr(model, "patch_embed", None)
        grid = tuple(int(g) for g in pe.grid_size) if pe is not None and hasattr(pe, "grid_size") else None
        if grid is None or n_prefix + grid[0] * grid[1] != f.shape[1]:
            grid = (1, int(f.shape[1]) - n_prefix)
        patch = int(pe.patch_size[0]) if pe is not None and hasattr(pe, "patch_size") else None
        gp = getattr(model, "global_pool", "token")
        pooled = "cls" if gp == "token" and n_prefix > 0 else "mean-patch"
    else:
        grid = (int(f.shape[2]), int(f.shape[3]))
        info = getattr(model, "feature_info", None)
        patch = int(info[-1]["reduction"]) if info else max(1, size[0] // grid[0])
        n_prefix = 0
        pooled = "avgpool"
    n_layers = len(model.feature_info) if hasattr(model, "forward_intermediates") and getattr(model, "feature_info", None) else None
    return EncoderSpec(
        name=name,
        family=family,
        input_size=size,
        in_chans=in_chans,
        mean=tuple(float(v) for v in cfg["mean"]),
        std=tuple(float(v) for v in cfg["std"]),
        interpolation=str(cfg.get("interpolation", "bicubic")),
        patch_size=patch,
        n_prefix=n_prefix,
        grid=grid,
        dim=int(f.shape[-1] if vit_like else f.shape[1]),
        pooled=pooled,
        n_layers=n_layers,
        weights=weights,
        random_init=weights["kind"] == "random-init",
        extra={"vit_like": vit_like},
    )


def load_timm(rest: str, *, weights: str | None = None, random_init: bool = False,
              revision: str | None = None, model_kwargs: dict[str, Any] | None = None) -> TimmEncoder:
    """Factory of ``timm:<name>``. ``model_kwargs`` go to ``timm.create_model`` (e.g. ``depth``), but
    ``coord_channels: true``, which adds coordinate input channels (:mod:`.coordconv`)."""
    name = f"timm:{rest}"
    if revision is not None:
        raise ConfigError(f"encoder {name}: --revision applies to hub encoders; use --weights PATH")
    record = weights_record(weights, random_init, name)
    kwargs = dict(model_kwargs or {})
    file = None
    if record["kind"] == "dir":
        file, cfg = _folder_weights(Path(weights))
        if cfg.get("architecture") and cfg["architecture"] != rest:
            raise ConfigError(
                f"encoder {name}: {weights}/config.json is for {cfg['architecture']!r}, not {rest!r}"
            )
        if cfg.get("pretrained_cfg"):
            kwargs["pretrained_cfg_overlay"] = {
                k: cfg["pretrained_cfg"][k]
                for k in ("mean", "std", "input_size", "interpolation")
                if k in cfg["pretrained_cfg"]
            }
        kwargs.update(cfg.get("model_args", {}))
    elif record["kind"] == "file":
        file = Path(weights)
        exported = read_export_meta(file) or {}  # a `spar-probe finetune` export
        check_export(file, exported, name, "timm")
        kwargs = {**exported.get("model_args", {}), **kwargs}
    coord = bool(kwargs.get(COORD_KEY, False))
    model = build_timm_model(rest, **{k: v for k, v in kwargs.items() if k != COORD_KEY})
    if coord:
        add_coord_channels(model, name)  # before the spec's dry forward
    if file is not None:
        load_into(model, load_state_dict_file(file), file, name)
    model.eval()
    spec = timm_spec_from_model(model, name, "timm", record)
    if kwargs:
        spec.extra["model_args"] = kwargs  # exported with finetuned weights, recorded in caches
    return TimmEncoder(spec, model)
