"""``transformer``: pre-norm Transformer layers over the projected token set.

Tokens are projected once to ``proj_dim`` (fixed PCA, see :mod:`spar_bench.probes.heads.attnpool`),
then by a learned layer to ``d_model`` with learned position embeddings.

* Probes without questions (Levels 1-2): the 16 tile queries are prepended and ``n_layers`` self-attention layers
  run over [queries; tokens]; outputs are read at the query tokens.
* Probes that ask questions (Level 3): an item is a QUESTION and a slice carries many, so the slice's tokens are
  encoded ONCE, without the question: ``n_layers - 1`` self-attention layers (the
  body). Each question is one query token (organ A + organ B + axis + probe
  embeddings + a learned query) passing through ``n_layers`` pre-norm cross-attention
  blocks (cross-attention, then a feed-forward layer, each residual); block ``l``
  reads the tokens as they enter body layer ``l`` (block 0 the embedded tokens, the
  last block the body output), as the query of the joint encoder does, except that
  the tokens never see the question. Questions never attend to each other, so an
  answer does not depend on which other questions share the batch.
  ``forward(x, q, index)`` takes the DISTINCT slices ``x`` ``(U, T, k)`` and
  ``index`` ``(B,)``, the row of ``x`` of each question; the training loop batches
  questions slice by slice (:func:`spar_bench.probes.train.epoch_order`,
  :func:`spar_bench.probes.train.group_batch`), so the body runs once per slice per batch.

Defaults: ``d_model`` 64, ``n_layers`` 2, ``n_heads`` 4, feed-forward 2 x d_model,
``dropout`` 0.1, ``proj_dim`` 128 (the PCA width; the learned embedding maps 128 -> 64).
Width 64, not the token heads' 128: a Levels 1-2 run puts 65 tokens per item through
the joint layers, so its steps are bound by their GEMMs, and at 64 an epoch costs about
half (``bench/heads.py``). Measured on a WORD-sized phantom build (timm:resnet18 features),
64 kept the accuracy of 128 where the features carry signal: Level 2 tile accuracy .343
vs .339, Level 3 distance and size as high or higher (docs/SCALE.md). Level 3 per slice
token costs one body layer plus two key/value projections, once per slice instead of
two full layers once per question: ~3 x faster per epoch at ~3.5 questions per slice
(phantom, ``relative_position``), more with more questions per slice.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .base import TokenHead


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout (as ``nn.Dropout``: keep with probability 1 - p, scale 1 / (1 - p)).

    The mask comes from ``torch.rand``, about twice as fast on the CPU as ``bernoulli_``.
    """
    if not training or p == 0:
        return x
    return x * (torch.rand_like(x) >= p) * (1.0 / (1.0 - p))


def encoder_layer(layer: nn.TransformerEncoderLayer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a pre-norm GELU ``nn.TransformerEncoderLayer`` without a mask, faster.

    The same parameters and the same function (bit-identical in eval mode): one qkv
    projection, explicit softmax attention (no mask handling) and :func:`dropout`.
    About 1.2x faster per training step than the module on the CPU (Levels 1-2 joint
    encoder: 65 tokens of width 128).
    """
    attn, p, training = layer.self_attn, layer.dropout.p, layer.training
    b, t, d = x.shape
    nh = attn.num_heads
    dh = d // nh
    qkv = F.linear(layer.norm1(x), attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = qkv.view(b, t, 3, nh, dh).permute(2, 0, 3, 1, 4)
    w = torch.softmax((q * dh**-0.5) @ k.transpose(-1, -2), dim=-1)
    a = (dropout(w, p, training) @ v).transpose(1, 2).reshape(b, t, d)
    x = x + dropout(attn.out_proj(a), p, training)
    f = layer.linear2(dropout(F.gelu(layer.linear1(layer.norm2(x))), p, training))
    return x + dropout(f, p, training)


class CrossBlock(nn.Module):
    """Pre-norm block: query ``h`` cross-attends to per-row memory, then a feed-forward layer.

    Keys and values are projected once per memory row ``(U, T, d)`` and gathered per
    query with ``index``; every query attends only to its own row's memory.
    """

    def __init__(self, d: int, n_heads: int, dropout: float):
        super().__init__()
        if d % n_heads:
            raise ValueError(f"d_model {d} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.norm_q = nn.LayerNorm(d)
        self.norm_kv = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.o = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.drop = nn.Dropout(dropout)
        self.ff = nn.Sequential(
            nn.LayerNorm(d),
            nn.Linear(d, 2 * d),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(2 * d, d),
        )

    def forward(self, h: torch.Tensor, mem: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``h`` ``(B, d)`` queries, ``mem`` ``(U, T, d)``, ``index`` ``(B,)`` -> ``(B, d)``."""
        b, d = h.shape
        u, t, _ = mem.shape
        nh, dh = self.n_heads, d // self.n_heads
        kv = self.kv(self.norm_kv(mem)).view(u, t, 2, nh, dh).permute(2, 0, 3, 1, 4)
        k, v = kv[0][index], kv[1][index]  # (B, nh, T, dh): each query's own row
        q = self.q(self.norm_q(h)).view(b, nh, 1, dh)
        w = torch.softmax((q @ k.transpose(-1, -2)) * dh**-0.5, dim=-1)  # (B, nh, 1, T)
        a = (dropout(w, self.attn_drop.p, self.training) @ v).reshape(b, d)
        h = h + dropout(self.o(a), self.drop.p, self.training)
        return h + dropout(self.ff(h), self.drop.p, self.training)


class TransformerHead(TokenHead):
    DEFAULTS = {**TokenHead.DEFAULTS, "d_model": 64, "n_layers": 2}

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__(spec, in_dim, n_tokens, **cfg)
        d, n_layers = self.cfg["d_model"], int(self.cfg["n_layers"])
        layer = nn.TransformerEncoderLayer(
            d,
            self.cfg["n_heads"],
            dim_feedforward=2 * d,
            dropout=self.cfg["dropout"],
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.shares_body = spec.asks  # many questions per slice: encode the slice once
        if not self.shares_body:
            self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
            return
        # Level 3: query layer l reads the slice's tokens as they enter body layer l, as
        # in the joint encoder, but the tokens never see the question.
        self.body_layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(n_layers - 1))
        self.decoder = nn.ModuleList(
            CrossBlock(d, self.cfg["n_heads"], self.cfg["dropout"]) for _ in range(n_layers)
        )

    def body(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Level 3: the question-agnostic token states ``(U, T, d)`` entering each layer."""
        states = [self.token_embed(x)]
        for layer in self.body_layers:
            states.append(encoder_layer(layer, states[-1]))
        return states

    def forward(
        self, x: torch.Tensor, q: dict | None = None, index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Outputs of the level; ``index`` (optional) maps each item to its row of ``x``."""
        if not self.shares_body:
            if index is not None:
                x = x[index]
            qs = self.query_tokens(x.shape[0], q)
            h = torch.cat([qs, self.token_embed(x)], dim=1)
            for layer in self.encoder.layers:
                h = encoder_layer(layer, h)
            return self.readout(h[:, : qs.shape[1]])
        if index is None:
            index = torch.arange(x.shape[0])
        h = self.query_tokens(index.shape[0], q)[:, 0]
        for block, mem in zip(self.decoder, self.body(x), strict=True):
            h = block(h, mem, index)
        return self.readout(h[:, None])
