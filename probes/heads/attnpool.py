"""``attnpool``: learned queries attend once (multi-head) over the projected tokens.

The shared token-head machinery (fixed PCA projection, queries, outputs) is
:class:`spar_bench.probes.heads.base.TokenHead`.

``attnpool`` defaults: ``d_model`` 128, ``n_heads`` 4, ``dropout`` 0.1, ``proj_dim`` 128.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import TokenHead


class AttnPoolHead(TokenHead):
    """Learned queries attend once (multi-head) over the projected tokens."""

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__(spec, in_dim, n_tokens, **cfg)
        d = self.cfg["d_model"]
        self.kv_norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(
            d, self.cfg["n_heads"], dropout=self.cfg["dropout"], batch_first=True
        )
        self.mlp = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)
        )

    def forward(
        self, x: torch.Tensor, q: dict | None = None, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Outputs of the level; ``index`` (optional) maps each item to its row of ``x``."""
        kv, qs = self.pool_inputs(x, q, index)
        h = qs + self.attn(qs, kv, kv, need_weights=False)[0]
        h = h + self.mlp(h)
        return self.readout(h)
