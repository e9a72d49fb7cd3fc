"""The encoder as a trainable module: loading (weights or scratch), freezing, forward with
gradients, parameter groups, and the safetensors export that ``spar-probe cache`` reads back.

An :class:`~spar_bench.probes.encoders.base.Encoder` is built for frozen feature extraction
(``inference_mode``, ``requires_grad=False``). :func:`load_trainable` builds the same
encoder through the registry and unfreezes it; :func:`encode` runs its preprocessing and
token extraction with gradients, so finetuned features are, by construction, what
``spar-probe cache`` computes from the exported weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError

from ..encoders import load_encoder
from ..encoders.base import EXPORT_META_KEY, WeightsGiven, pool_tokens, read_export_meta  # noqa: F401  (re-exported)

EXPORT_FILE = "encoder.safetensors"
#: families whose constructor takes ``--model-args`` (and whose ``--init weights`` needs ``--weights``)
ARGS_FAMILIES = ("timm:", "monai:")
#: parameter names whose first number after one of these words is a block index.
_BLOCK_RE = re.compile(r"(?:^|\.)(?:blocks|layers?|resblocks|stages)\.(\d+)\.")
#: CNN stages named with their number (ResNet ``layer1``..``layer4``).
_STAGE_RE = re.compile(r"(?:^|\.)layer\d+\.")
#: a monai: network's stages (3-D ResNet ``layer1``..``layer4``, Swin ``layers1``..``layers4``):
#: its block groups (a Swin stage's ``blocks.N`` are blocks within the stage)
_MONAI_STAGE_RE = re.compile(r"^layers?(\d+)\.")


def load_trainable(name: str, *, weights: str | None, init: str, seed: int,
                   model_kwargs: dict[str, Any] | None = None, revision: str | None = None):
    """The encoder ``name`` with trainable parameters.

    ``init`` is ``"weights"`` (``weights`` required: finetuning) or ``"scratch"`` (a random
    initialisation drawn from ``seed``: training from scratch). Anything else, or weights
    missing, is refused: random features never appear by accident.
    """
    import torch

    if init not in ("weights", "scratch"):
        raise ConfigError(f"--init must be 'weights' or 'scratch', got {init!r}")
    if init == "scratch" and weights is not None:
        raise ConfigError(f"encoder {name}: pass either --weights (finetune) or --init scratch, not both")
    if init == "weights" and weights is None and name.startswith(ARGS_FAMILIES):
        raise ConfigError(
            f"encoder {name}: no weights given; pass --weights PATH to finetune, or --init scratch "
            "to train the architecture from random weights"
        )
    kw: dict[str, Any] = {"model_kwargs": dict(model_kwargs)} if model_kwargs else {}
    if kw and not name.startswith(ARGS_FAMILIES):
        raise ConfigError(f"encoder {name}: --model-args apply to timm: and monai: encoders only")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            enc = load_encoder(name, weights=weights, random_init=init == "scratch", revision=revision, **kw)
        except WeightsGiven as e:  # finetune's flag is --init scratch, not cache's --random-init
            raise e.for_flag("--init scratch") from None
    if init == "weights" and enc.spec.random_init:
        raise ConfigError(
            f"encoder {name}: has no trained weights (random-init); finetuning it would be training "
            "from scratch - say so with --init scratch"
        )
    for p in enc.module.parameters():
        p.requires_grad_(True)
    return enc


def encode(enc, images, layer: int = -1):
    """``(tokens (B,T,D), pooled (B,D))`` of uint8 ``images (B,H,W)`` (a 3-D encoder: volumes
    ``(B,S,S,S)``), with gradients.

    The same preprocessing, token extraction and pooling as ``Encoder.forward`` (what
    ``spar-probe cache`` stores), without ``inference_mode``.
    """

    x = enc.preprocess(images.to(enc.device, non_blocking=True))
    tokens = enc._layer_tokens(x, enc.check_layers([layer]))[layer]
    return tokens, pool_tokens(tokens, enc.spec.pooled, enc.spec.n_prefix)


def block_index(enc) -> dict[str, int]:
    """Parameter name -> block group: 0 = stem / embeddings, 1.. = blocks in order.

    timm models use their own ``group_matcher`` (the grouping of layer-wise learning-rate
    decay); other families are grouped by the first ``blocks.N`` / ``layer.N`` /
    ``layers.N`` / ``resblocks.N`` in the name. Parameters after the blocks (final norm)
    get a group past the last block, so they are never frozen.
    """
    m = enc.module
    if hasattr(m, "group_matcher"):
        from timm.models import group_parameters

        groups = group_parameters(m, m.group_matcher(coarse=True))
        out = {n: int(g) for g, names in groups.items() for n in names}
        tail = max(out.values(), default=0) + 1
        # coarse groups fold the final norm into the last block: it is not a block
        return {n: g if g == 0 or _BLOCK_RE.search(n) or _STAGE_RE.search(n) else tail
                for n, g in out.items()}
    out, last = {}, 0
    stages = enc.spec.family == "monai" and enc.spec.extra.get("arch") != "vit"
    for n, _ in m.named_parameters():
        hit = _MONAI_STAGE_RE.search(n) if stages else _BLOCK_RE.search(n)
        out[n] = int(hit.group(1)) + (0 if stages else 1) if hit else -1
        last = max(last, out[n])
    # before any block: stem (0); after the last block: past it
    seen_block, fixed = False, {}
    for n, g in out.items():
        seen_block = seen_block or g > 0
        fixed[n] = g if g >= 0 else (last + 1 if seen_block else 0)
    return fixed


def freeze_blocks(enc, n: int) -> int:
    """Freeze the stem and the first ``n`` blocks (``n = 0``: nothing). Returns frozen tensors."""
    if n <= 0:
        return 0
    groups = block_index(enc)
    n_blocks = max((g for k, g in groups.items() if _BLOCK_RE.search(k) or _STAGE_RE.search(k)
                    or _MONAI_STAGE_RE.search(k)), default=0)
    if n > n_blocks:
        raise ConfigError(f"--freeze-blocks {n}: encoder {enc.spec.name} has {n_blocks} block groups")
    frozen = 0
    for name, p in enc.module.named_parameters():
        if groups.get(name, n_blocks + 1) <= n:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def export_encoder(enc, path: Path, meta: dict[str, Any]) -> Path:
    """Write the encoder's state dict to ``path`` (safetensors) with ``meta`` in its header.

    ``meta`` (JSON) carries the encoder spec, timm ``model_args`` and how it was trained;
    ``spar-probe cache --weights path`` reads it back (the cache records the training).
    The header also names the encoder ``family`` and the ``module`` the state dict is of:
    ``model`` (timm, hf: the whole network) or, for ``open_clip:``, the vision tower's
    ``visual.trunk`` (a timm trunk) or ``visual`` (open_clip's own ViT); a loader given an
    export of another family or part refuses it (``encoders.base.check_export``).
    """
    from safetensors.torch import save_file

    meta = {**meta, "family": enc.spec.family, "module": enc.spec.extra.get("module", "model")}
    state = {k: v.detach().cpu().contiguous() for k, v in enc.module.state_dict().items()}
    state = _untie(state)
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata={EXPORT_META_KEY: json.dumps(meta, sort_keys=True, default=str)})
    tmp.replace(path)
    return path


def _untie(state: dict) -> dict:
    """Clone tensors that share storage (safetensors refuses shared memory)."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        out[k] = v.clone() if ptr in seen else v
        if ptr != -1:
            seen.add(ptr)
    return out
