"""``hf:<hub repo or local dir>``: transformers ``AutoModel`` vision encoders (DINOv2, RadDINO).

Hub ids load at a pinned revision (``--revision``, or the one in the alias table of
:mod:`spar_bench.probes.encoders`); ``HF_HUB_OFFLINE=1`` is respected by transformers itself. Local
folders load with ``local_files_only=True`` and are fingerprinted by sha256.

Preprocessing comes from the folder's image processor config (``image_mean``,
``image_std``, crop or resize size, resample); images are resized whole to that size (no
crop, which would cut mosaic tiles). Tokens: layer ``-1`` is ``last_hidden_state`` (after
the final layer norm); layer ``L`` is ``hidden_states[L]`` (``output_hidden_states``).
Pooled: the CLS token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from .base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
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

_RESAMPLE = {0: "nearest", 1: "bicubic", 2: "bilinear", 3: "bicubic", 4: "bilinear", 5: "bicubic"}


class HFEncoder(Encoder):
    def _layer_tokens(self, x, layers):
        need_hidden = any(v != -1 for v in layers)
        out = self.module(pixel_values=x, output_hidden_states=need_hidden, return_dict=True)
        res = {}
        for v in layers:
            res[v] = out.last_hidden_state if v == -1 else out.hidden_states[v]
        return res


def _size_from_processor(cfg: dict[str, Any], default: int) -> tuple[int, int]:
    for key in ("crop_size", "size"):
        s = cfg.get(key)
        if key == "crop_size" and not cfg.get("do_center_crop", True):
            continue
        if isinstance(s, int):
            return (s, s)
        if isinstance(s, dict):
            if "height" in s and "width" in s:
                return (int(s["height"]), int(s["width"]))
            if "shortest_edge" in s:
                return (int(s["shortest_edge"]), int(s["shortest_edge"]))
    return (default, default)


def hf_spec_from_config(name: str, model_cfg: dict[str, Any], proc_cfg: dict[str, Any],
                        weights: dict[str, Any]) -> EncoderSpec:
    """Spec from ``config.json`` + ``preprocessor_config.json`` contents (no model built)."""
    image_size = int(model_cfg.get("image_size", 224))
    size = _size_from_processor(proc_cfg, image_size)
    patch = int(model_cfg.get("patch_size", 14))
    n_reg = int(model_cfg.get("num_register_tokens", 0) or 0)
    return EncoderSpec(
        name=name,
        family="hf",
        input_size=size,
        in_chans=int(model_cfg.get("num_channels", 3)),
        mean=tuple(proc_cfg.get("image_mean", IMAGENET_MEAN)),
        std=tuple(proc_cfg.get("image_std", IMAGENET_STD)),
        interpolation=_RESAMPLE.get(proc_cfg.get("resample", 3), "bicubic"),
        patch_size=patch,
        n_prefix=1 + n_reg,
        grid=(size[0] // patch, size[1] // patch),
        dim=int(model_cfg.get("hidden_size", 0)) or None,
        pooled="cls",
        n_layers=int(model_cfg.get("num_hidden_layers", 0)) + 1 or None,
        weights=weights,
        random_init=weights["kind"] == "random-init",
        extra={"model_type": model_cfg.get("model_type")},
    )


def load_hf(rest: str, *, weights: str | None = None, random_init: bool = False,
            revision: str | None = None) -> HFEncoder:
    """Factory of ``hf:<repo or dir>``; ``--weights DIR`` is an alternative to a dir in the name."""
    name = f"hf:{rest}"
    transformers = require_extra("transformers", "transformers")
    export = None
    if weights is not None and Path(weights).is_file() and Path(weights).suffix == ".safetensors":
        if not Path(rest).is_dir():
            raise ConfigError(f"encoder {name}: --weights FILE needs the model's folder as hf:DIR")
        export, weights = Path(weights), None  # trained weights over the folder's architecture
        check_export(export, read_export_meta(export), name, "hf")
    local = Path(weights) if weights is not None else Path(rest)
    if local.is_dir():
        if random_init:
            raise WeightsGiven(name, f"folder {local}")
        record = weights_record(local, False, name)
        src, kw = str(local), {"local_files_only": True}
    elif weights is not None:
        raise ConfigError(f"encoder {name}: --weights for hf encoders must be a save_pretrained folder, got {weights}")
    else:
        if "/" not in rest or rest.startswith((".", "/")):
            raise ConfigError(f"encoder {name}: {rest} is neither a folder nor a hub id 'org/repo'")
        if revision is None and not random_init:
            raise ConfigError(
                f"encoder {name}: pass --revision <commit> to pin the hub weights "
                "(or --random-init for a randomly initialised network)"
            )
        src = rest
        kw = {"revision": revision} if revision else {}
        if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "TRUE", "yes"):
            kw["local_files_only"] = True
        record = {"kind": "hub", "repo": rest, "revision": revision} if not random_init else {"kind": "random-init", "config_from": rest, "revision": revision}
    try:
        config = transformers.AutoConfig.from_pretrained(src, **kw)
        if record["kind"] == "random-init":
            model = transformers.AutoModel.from_config(config)
        else:
            model = transformers.AutoModel.from_pretrained(src, **kw)
        try:
            proc = transformers.AutoImageProcessor.from_pretrained(src, **kw).to_dict()
        except (OSError, ValueError):
            proc = {}
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"encoder {name}: cannot load {src}: {first}") from None
    if export is not None:  # a `spar-probe finetune` export: its state dict, its record
        load_into(model, load_state_dict_file(export), export, name)
    if Path(rest).is_dir():  # named by the folder's base name and content, never its path
        folder_sha = record["sha256"] if local == Path(rest) else sha256_file(rest)
        name = local_name("hf:", rest, folder_sha)
    if export is not None:
        record = weights_record(export, False, name)
    model_cfg = json.loads(config.to_json_string())
    spec = hf_spec_from_config(name, model_cfg, proc, record)
    return HFEncoder(spec, model.eval())
