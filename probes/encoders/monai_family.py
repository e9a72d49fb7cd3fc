"""``monai:<arch>``: MONAI's 3-D networks as volume encoders (Level 4), from local weights.

Architectures (``monai.networks.nets``, built with ``spatial_dims=3`` and one input channel):

- ``monai:resnet10`` ... ``monai:resnet200``: the 3-D ResNets (no classifier). Layers ``0..3`` are
  the outputs of ``layer1..layer4``; ``-1`` is ``layer4``. Pooled: the average of the tokens.
- ``monai:vit``: ``ViT`` (default ViT-B: patch 16, width 768, 12 blocks; ``classification``
  off, so no CLS token). Layers ``0..n-1`` are the block outputs; ``-1`` the final norm's
  output. Pooled: the mean of the patch tokens.
- ``monai:resnet152-i3``: Merlin's inflated ResNet-152 with Merlin's CT preprocessing
  (:mod:`.astra`; the pretrained weights are the encoder ``astra-ct``).
- ``monai:swinunetr``: the encoder of ``SwinUNETR`` (its ``swinViT``, default feature size 48).
  Layers ``0..4`` are its five normalised stage outputs (patch embedding, stages 1-4); ``-1``
  the last (stride 32). Pooled: the average of the tokens.

Every layer's map ``(B, C, D', H', W')`` is flattened z-major to tokens ``(B, D'*H'*W', C)``;
the grid of each layer is in ``spec.extra["layer_grids"]`` and a cache records it. Input:
the uint8 volume ``(B, S, S, S)`` scaled to [0, 1] (the build's window, as Levels 1-3),
resized trilinearly to ``input_size`` (model argument, default 128; the ViT's ``img_size``),
then normalised by ``mean``/``std`` (default 0 and 1: MONAI's CT pipelines feed [0, 1]).

Weights: ``--weights FILE`` (a ``.safetensors``/``.pt``/``.pth`` state dict, e.g. a
``spar-probe finetune`` export, whose ``model_args`` it reads back; ``module.``, and for
checkpoints of whole networks ``swinViT.``/``vit.``, prefixes are stripped), or a folder with
``config.json`` (``{"model_args": {...}}``) and ``model.safetensors`` / ``pytorch_model.bin``
/ ``model.pth`` / ``model.pt``; ``--random-init`` only when asked. Nothing is ever downloaded
(MONAI's ``pretrained=True`` is refused), so ``HF_HUB_OFFLINE`` has nothing to stop.
``model_kwargs`` (``--model-args`` of ``spar-probe finetune``) go to the constructor, plus
``input_size``, ``mean`` and ``std``.
"""

from __future__ import annotations

import copy
import difflib
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
    ncdhw_to_tokens,
    read_export_meta,
    require_extra,
    volume_grids,
    weights_record,
)

RESNETS = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet200")
ARCHS = (*RESNETS, "vit", "swinunetr", "resnet152-i3")  # the last: Merlin's, in :mod:`.astra`
DEFAULT_SIZE = 128
#: our own model arguments (not the constructor's)
OWN_ARGS = ("input_size", "mean", "std")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pth", "model.pt")


class MonaiEncoder(Encoder):
    """A MONAI 3-D network: ``uint8 (B, S, S, S)`` volumes -> per-layer token sets."""

    def _maps(self, x, layers: list[int]) -> dict[int, Any]:
        arch, m, n = self.spec.extra["arch"], self.module, self.spec.n_layers
        want = {v % n for v in layers}
        if arch == "vit":
            last, hidden = m(x)
            return {v: last if v == -1 else hidden[v % n] for v in layers}
        if arch == "swinunetr":
            outs = m(x, normalize=True)
            return {v: outs[v % n] for v in layers}
        x = m.act(m.bn1(m.conv1(x)))
        if not m.no_max_pool:
            x = m.maxpool(x)
        stages = {}
        for i, stage in enumerate((m.layer1, m.layer2, m.layer3, m.layer4)):
            if i > max(want):
                break
            x = stage(x)
            stages[i] = x
        return {v: stages[v % n] for v in layers}

    def _layer_tokens(self, x, layers):
        return {v: t if t.ndim == 3 else ncdhw_to_tokens(t) for v, t in self._maps(x, layers).items()}


def check_arch(arch: str) -> str:
    if arch in ARCHS:
        return arch
    close = difflib.get_close_matches(arch, ARCHS, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(f'monai:{c}' for c in close)}?" if close else ""
    raise ConfigError(f"encoder monai:{arch}: unknown architecture{hint} (known: {', '.join(ARCHS)})")


def monai_nets():
    """``monai.networks.nets``, or a one-line error naming the extra to install."""
    require_extra("monai", "monai")
    require_extra("einops", "monai")  # MONAI's ViT and Swin blocks need it (a monai extra of its own)
    import einops  # noqa: F401
    import monai.networks.nets as nets

    return nets


def _constructor(arch: str, args: dict[str, Any], size: int) -> tuple[Any, dict[str, Any]]:
    """``(MONAI constructor, its keyword arguments)`` for ``arch`` with the user's ``args``."""
    nets = monai_nets()
    if args.get("pretrained"):
        raise ConfigError(f"encoder monai:{arch}: pretrained=True would download weights; pass --weights FILE")
    if arch in RESNETS:
        base = {"spatial_dims": 3, "n_input_channels": 1, "feed_forward": False}
        return getattr(nets, arch), {**base, **args}
    if arch == "vit":
        base = {"in_channels": 1, "img_size": size, "patch_size": 16, "spatial_dims": 3}
        if args.get("classification"):
            raise ConfigError("encoder monai:vit: classification=True adds a classifier; drop it (tokens are read)")
        return nets.ViT, {**base, **args, "classification": False}
    base = {"in_channels": 1, "out_channels": 1, "feature_size": 48, "spatial_dims": 3}
    return nets.SwinUNETR, {**base, **args}


def build_monai_model(arch: str, args: dict[str, Any]) -> tuple[Any, dict[str, Any], int]:
    """``(encoder module, constructor kwargs, input side)`` of ``arch`` built on the CPU."""
    own = {k: args[k] for k in OWN_ARGS if k in args}
    rest = {k: v for k, v in args.items() if k not in OWN_ARGS}
    size = int(own.get("input_size", rest.get("img_size", DEFAULT_SIZE)))
    if size < 1:
        raise ConfigError(f"encoder monai:{arch}: input_size must be >= 1, got {size}")
    ctor, kwargs = _constructor(arch, rest, size)
    if arch == "vit" and int(kwargs["img_size"] if isinstance(kwargs["img_size"], int) else kwargs["img_size"][0]) != size:
        raise ConfigError(f"encoder monai:vit: input_size {size} differs from img_size {kwargs['img_size']}")
    try:
        model = ctor(**kwargs)
    except (TypeError, ValueError, AssertionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"encoder monai:{arch}: MONAI refuses the model arguments {json.dumps(rest, sort_keys=True)} "
                          f"({first})") from None
    if arch == "swinunetr":
        model = model.swinViT  # the encoder alone: the decoder's weights are never used
    return model.eval(), kwargs, size


def _weights_file(weights: str, record: dict[str, Any], name: str) -> tuple[Path, dict[str, Any]]:
    """``(state dict file, model_args it carries)`` of ``--weights`` (a file or a folder)."""
    path = Path(weights)
    if record["kind"] == "dir":
        cfg_path = path / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except ValueError as e:
            raise ConfigError(f"{cfg_path}: not JSON ({e})") from None
        for fname in _WEIGHT_FILES:
            if (path / fname).is_file():
                return path / fname, dict(cfg.get("model_args", {}))
        raise ConfigError(f"encoder {name}: weights folder {path} has none of {', '.join(_WEIGHT_FILES)}")
    exported = read_export_meta(path) or {}
    check_export(path, exported, name, "monai")
    return path, dict(exported.get("model_args", {}))


def _strip_wrappers(sd: dict[str, Any], module) -> dict[str, Any]:
    """A checkpoint's state dict with ``module.`` and a whole network's ``swinViT.``/``vit.``
    prefix removed (the keys of that part only), as the encoder module names them."""
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    own = module.state_dict()
    for prefix in ("swinViT.", "vit."):
        if not any(k.startswith(prefix) for k in own) and any(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def _dry_grids(model, arch: str, size: int, n_layers: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    """``({layer: [D', H', W']}, {layer: width})`` of every layer, from a forward on the meta
    device (shapes only: no memory, no compute), or on the CPU if the meta forward fails."""
    import torch

    enc = MonaiEncoder(_spec_stub(arch, size, n_layers), model)
    layers = [-1, *range(n_layers)]
    try:
        meta = copy.deepcopy(model).to("meta")
        with torch.no_grad():
            maps = MonaiEncoder(enc.spec, meta)._maps(torch.zeros(1, 1, size, size, size, device="meta"), layers)
    except Exception:  # noqa: BLE001 - an op without a meta kernel: one real forward instead
        with torch.inference_mode():
            maps = enc._maps(torch.zeros(1, 1, size, size, size), layers)
    grids, dims = {}, {}
    for v, t in maps.items():
        if t.ndim == 3:  # ViT tokens (B, N, C): the cube of patches
            side = round(int(t.shape[1]) ** (1 / 3))
            grids[str(v)] = [side] * 3 if side**3 == int(t.shape[1]) else [1, 1, int(t.shape[1])]
            dims[str(v)] = int(t.shape[-1])
        else:
            grids.update(volume_grids({v: t}))
            dims[str(v)] = int(t.shape[1])
    return grids, dims


def _spec_stub(arch: str, size: int, n_layers: int) -> EncoderSpec:
    return EncoderSpec(name=f"monai:{arch}", family="monai", input_size=(size,) * 3, in_chans=1,
                       n_layers=n_layers, extra={"arch": arch})


def _n_layers(arch: str, model) -> int:
    if arch == "vit":
        return len(model.blocks)
    return 5 if arch == "swinunetr" else 4


def load_monai(rest: str, *, weights: str | None = None, random_init: bool = False,
               revision: str | None = None, model_kwargs: dict[str, Any] | None = None) -> MonaiEncoder:
    """Factory of ``monai:<arch>`` (see the module docstring)."""
    arch = check_arch(rest)
    name = f"monai:{arch}"
    if revision is not None:
        raise ConfigError(f"encoder {name}: --revision applies to hub encoders; use --weights PATH")
    record = weights_record(weights, random_init, name)
    file, args = (None, {}) if weights is None else _weights_file(weights, record, name)
    args = {**args, **dict(model_kwargs or {})}
    model, kwargs, size = build_monai_model(arch, args)
    if file is not None:
        sd = _strip_wrappers(load_state_dict_file(file), model)
        load_into(model, sd, file, name)
    n_layers = _n_layers(arch, model)
    grids, dims = _dry_grids(model, arch, size, n_layers)
    patch = kwargs.get("patch_size") if arch == "vit" else None
    spec = EncoderSpec(
        name=name, family="monai", input_size=(size,) * 3, in_chans=1,
        mean=tuple(float(v) for v in args.get("mean", (0.0,))), std=tuple(float(v) for v in args.get("std", (1.0,))),
        interpolation="trilinear", patch_size=int(patch) if isinstance(patch, int) else None, n_prefix=0,
        grid=tuple(grids["-1"]), dim=dims["-1"], pooled="mean-patch" if arch == "vit" else "avgpool",
        n_layers=n_layers, weights=record, random_init=record["kind"] == "random-init",
        extra={"arch": arch, "layer_grids": grids, "layer_dims": dims,
               "constructor": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool, list, tuple))}},
    )
    if args:
        spec.extra["model_args"] = args  # exported with finetuned weights, recorded in caches
    return MonaiEncoder(spec, model)
