"""Coordinate channels (CoordConv) for a timm encoder: ``--model-args '{"coord_channels": true}'``.

The encoders feed a grey image repeated over the network's input channels. With
``coord_channels`` the network's first convolution sees, in place of input channels 1 and 2,
each pixel's column and row coordinate in [-1, 1] (channel 0 stays the image): position is an
input feature, so a network trained from scratch does not have to infer it from its padding
(Liu et al. 2018, "An intriguing failing of convolutional neural networks and the CoordConv
solution"). The weights keep their shapes, so state dicts and exports are the plain model's;
the option is one of the model args, which a ``spar-probe finetune`` export carries, so
the exported encoder is loaded back with its coordinates.
"""

from __future__ import annotations

from typing import Any

from spar_bench.errors import ConfigError

#: the model-args key (popped before ``timm.create_model``).
COORD_KEY = "coord_channels"


def first_conv(model: Any, name: str) -> Any:
    """The first registered ``Conv2d`` of ``model`` (a ResNet's stem, a ViT's patch embedding)."""
    from torch import nn

    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None or conv.in_channels < 3:
        raise ConfigError(f"encoder {name}: {COORD_KEY} needs a first Conv2d with >= 3 input channels")
    return conv


def coord_input(x: Any) -> Any:
    """``x (B, C>=3, H, W)`` with channels 1 and 2 replaced by column and row coordinates in [-1, 1]."""
    import torch

    b, _, h, w = x.shape
    cols = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype).view(1, 1, 1, w).expand(b, 1, h, w)
    rows = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype).view(1, 1, h, 1).expand(b, 1, h, w)
    return torch.cat([x[:, :1], cols, rows, x[:, 3:]], dim=1)


def add_coord_channels(model: Any, name: str) -> None:
    """Make ``model``'s first convolution read :func:`coord_input` (a forward pre-hook)."""
    first_conv(model, name).register_forward_pre_hook(lambda _mod, args: (coord_input(args[0]), *args[1:]))
