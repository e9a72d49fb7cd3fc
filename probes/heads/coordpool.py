"""``coordpool``: ``attnpool`` that also reads out WHERE each attention head looked.

One learned query (plus the question) attends once, multi-head, over the projected tokens, as
in ``attnpool``; besides the attended values, each head's attention-weighted mean of the token
grid's coordinates (row, col in [-1, 1]; (z, row, col) over a 3-D encoder's grid) is mapped by
a linear layer into the query's output. An attention head that finds organ A thus hands the
readout A's centre in the image frame, not only a content vector that would have to carry it,
so "is A left of B" is a comparison of two numbers the head already has. Positions stay
learned as in every token head (the embeddings of :class:`~.base.TokenHead`).

The coordinates come from the attention weights before dropout. Prefix tokens (a ViT's class
or register tokens) sit at the centre (0). The grid is the ``token_grid`` a 3-D encoder
records; over 2-D tokens it is square, and the tokens beyond the largest square are taken as
prefix tokens (``T = n_prefix + s * s``, as for 1 class token and 14 x 14 patches).

``coordpool`` defaults: those of ``attnpool`` (``d_model`` 128, ``n_heads`` 4, ``dropout`` 0.1,
``proj_dim`` 128).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .base import TokenHead


def grid_coordinates(n_tokens: int, token_grid: Sequence[int] | None = None) -> torch.Tensor:
    """``(n_tokens, k)`` coordinates in [-1, 1] of token-cell centres (prefix tokens: 0).

    ``token_grid``: ``[n_prefix, D, H, W]`` (k = 3, z/row/col); without it the tokens are
    ``n_prefix`` prefix tokens then a row-major square ``s x s`` grid, ``s = isqrt(n_tokens)``
    (k = 2, row/col).
    """
    if token_grid is not None:
        n_prefix, *grid = (int(g) for g in token_grid)
    else:
        s = math.isqrt(n_tokens)
        n_prefix, grid = n_tokens - s * s, [s, s]
    if n_prefix + math.prod(grid) != n_tokens or min(grid) < 1:
        raise ValueError(f"a grid of {n_prefix} + {'x'.join(map(str, grid))} tokens does not hold "
                         f"the features' {n_tokens} tokens")
    axes = [(torch.arange(g, dtype=torch.float32) + 0.5) / g * 2.0 - 1.0 for g in grid]
    cells = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid))
    return torch.cat([torch.zeros(n_prefix, len(grid)), cells])


class CoordPoolHead(TokenHead):
    """Learned queries attend once (multi-head); each head also reports where it looked."""

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__(spec, in_dim, n_tokens, **cfg)
        d, n_heads = self.cfg["d_model"], self.cfg["n_heads"]
        if d % n_heads:
            raise ValueError(f"coordpool: d_model {d} is not a multiple of n_heads {n_heads}")
        coords = grid_coordinates(max(n_tokens, 1), self.cfg.get("token_grid"))
        self.register_buffer("coords", coords, persistent=False)
        self.kv_norm = nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(self.cfg["dropout"])
        self.where = nn.Linear(n_heads * coords.shape[1], d)
        self.mlp = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, d)`` -> ``(B, n_heads, N, d / n_heads)``."""
        b, n, d = x.shape
        h = self.cfg["n_heads"]
        return x.view(b, n, h, d // h).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, q: dict | None = None, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Outputs of the level; ``index`` (optional) maps each item to its row of ``x``."""
        kv, qs = self.pool_inputs(x, q, index)
        qh, kh, vh = self._heads(self.q_proj(qs)), self._heads(self.k_proj(kv)), self._heads(self.v_proj(kv))
        w = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(qh.shape[-1]), dim=-1)  # (B, H, Q, T)
        att = (self.drop(w) @ vh).transpose(1, 2).flatten(2)  # (B, Q, d)
        where = (w @ self.coords[: kv.shape[1]]).transpose(1, 2).flatten(2)  # (B, Q, H * k)
        h = qs + self.o_proj(att) + self.where(where)
        h = h + self.mlp(h)
        return self.readout(h)
