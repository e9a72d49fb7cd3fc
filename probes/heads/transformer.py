"""``transformer``: a few pre-norm Transformer layers over [query tokens; all tokens].

Tokens are projected once to ``proj_dim`` (fixed PCA, see :mod:`probes.heads.attnpool`),
then by a learned layer to ``d_model`` with learned position embeddings; the query
tokens (16 tile queries for Levels 1-2, one question token for Level 3) are prepended
and the layers run over the whole set; outputs are read at the query tokens.

Defaults: ``d_model`` 128, ``n_layers`` 2, ``n_heads`` 4, feed-forward 2 x d_model,
``dropout`` 0.1, ``proj_dim`` 128 (MEASUREMENTS.md: ~20 s/epoch for 10k samples of
50 tokens at d_model 128 on 2 CPU cores, half the cost at 256).
"""

from __future__ import annotations

import torch
from torch import nn

from . import Task
from .attnpool import TokenHead


class TransformerHead(TokenHead):
    DEFAULTS = {**TokenHead.DEFAULTS, "n_layers": 2}

    def __init__(self, task: Task, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__(task, in_dim, n_tokens, **cfg)
        d = self.cfg["d_model"]
        layer = nn.TransformerEncoderLayer(
            d,
            self.cfg["n_heads"],
            dim_feedforward=2 * d,
            dropout=self.cfg["dropout"],
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(
            layer, self.cfg["n_layers"], enable_nested_tensor=False
        )

    def forward(self, x: torch.Tensor, q: dict | None = None) -> torch.Tensor:
        qs = self.query_tokens(x.shape[0], q)
        h = self.encoder(torch.cat([qs, self.token_embed(x)], dim=1))
        return self.readout(h[:, : qs.shape[1]])
