"""3-D position embeddings of token heads over a 3-D encoder's tokens (Level 4 volumes).

A 2-D head learns one position embedding per token (``TokenHead.pos``, a ``(T, d)``
parameter): unchanged. Over a 3-D encoder's cache the head is built with ``token_grid =
[n_prefix, D', H', W']`` (the cache's record, :meth:`~spar_bench.probes.features.FeatureCache.token_grid`)
and its ``pos`` is a :class:`GridPositions`: the prefix tokens get their own learned
embeddings, grid token (z, r, c) the sum ``z_emb[z] + row_emb[r] + col_emb[c]`` of one learned
table per axis. Factorised, it has ``D' + H' + W'`` rows instead of ``D' H' W'`` (8^3 tokens: 24
rows, not 512) and says which tokens share a plane, which a few hundred training volumes
could not teach a free table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class GridPositions(nn.Module):
    """Factorised learned positions of ``n_prefix`` prefix tokens and a ``(D', H', W')`` grid."""

    def __init__(self, token_grid: Sequence[int], d: int, n_tokens: int | None = None):
        super().__init__()
        if len(token_grid) != 4 or min(token_grid[1:]) < 1 or token_grid[0] < 0:
            raise ValueError(f"token_grid must be [n_prefix, D, H, W], got {list(token_grid)}")
        n_prefix, *grid = (int(g) for g in token_grid)
        if n_tokens is not None and n_tokens != n_prefix + math.prod(grid):
            raise ValueError(f"token_grid {list(token_grid)} holds {n_prefix + math.prod(grid)} tokens, "
                             f"the features have {n_tokens}")
        self.n_prefix, self.grid = n_prefix, tuple(grid)
        self.prefix = nn.Parameter(torch.randn(n_prefix, d) * 0.02)
        self.axes = nn.ParameterList(nn.Parameter(torch.randn(g, d) * 0.02) for g in grid)

    @property
    def n_tokens(self) -> int:
        return self.n_prefix + math.prod(self.grid)

    def forward(self, t: int) -> torch.Tensor:
        """The ``(t, d)`` embeddings of a token set of ``t`` tokens (the recorded count)."""
        if t != self.n_tokens:
            raise ValueError(f"{t} tokens but the head was built for {self.n_tokens} "
                             f"({self.n_prefix} + {'x'.join(map(str, self.grid))})")
        z, r, c = self.axes
        grid = z[:, None, None] + r[None, :, None] + c[None, None, :]
        return torch.cat([self.prefix, grid.reshape(-1, grid.shape[-1])])
