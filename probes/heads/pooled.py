"""Heads on the pooled feature vector: ``linear`` and ``mlp``; the question embedding.

Both read ``x`` of shape ``(B, D)`` (the cached pooled vector, LayerNorm-ed first).
For probes that ask questions (Level 3) the question enters as embeddings of organ A, organ B (index 16 =
"none"), the relative-position axis (0 none, 1 left/right, 2 anterior/posterior) and
the probe, concatenated to the features.

Defaults: ``mlp`` hidden 512, GELU, dropout 0.1; question embeddings of width 32 each.
"""

from __future__ import annotations

import torch
from torch import nn

from spar_bench.builder.schema import LEVEL3_PROBES, N_ORGANS

N_ORGAN_TOKENS = N_ORGANS + 1  # + "none"
N_AXES = 3  # none, left/right, anterior/posterior


def question_indices(q: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(organ A, organ B, axis, probe) as valid embedding indices (-1 -> "none")."""
    a = torch.where(q["organ_a"] < 0, N_ORGANS, q["organ_a"]).long()
    b = torch.where(q["organ_b"] < 0, N_ORGANS, q["organ_b"]).long()
    ax = (q["axis"].long() + 1).clamp(min=0)
    return a, b, ax, q["probe"].long()


class QuestionEmbedding(nn.Module):
    """Embeds a Level 3 question; ``mode="concat"`` -> (B, 4*dim), ``"sum"`` -> (B, dim)."""

    def __init__(self, dim: int, mode: str = "concat"):
        super().__init__()
        self.mode = mode
        self.organ_a = nn.Embedding(N_ORGAN_TOKENS, dim)
        self.organ_b = nn.Embedding(N_ORGAN_TOKENS, dim)
        self.axis = nn.Embedding(N_AXES, dim)
        self.probe = nn.Embedding(len(LEVEL3_PROBES), dim)
        self.out_dim = 4 * dim if mode == "concat" else dim

    def forward(self, q: dict[str, torch.Tensor]) -> torch.Tensor:
        a, b, ax, p = question_indices(q)
        parts = (self.organ_a(a), self.organ_b(b), self.axis(ax), self.probe(p))
        return torch.cat(parts, dim=-1) if self.mode == "concat" else sum(parts)


class PooledHead(nn.Module):
    """Base of pooled-vector heads: LayerNorm(x) [+ question] -> body -> output."""

    input_kind = "pooled"
    shares_body = False
    DEFAULTS: dict = {"q_dim": 32}

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__()
        self.spec = spec
        self.cfg = {**self.DEFAULTS, **cfg}
        self.norm = nn.LayerNorm(in_dim)
        self.question = QuestionEmbedding(self.cfg["q_dim"]) if spec.asks else None
        self.body_in = in_dim + (self.question.out_dim if self.question is not None else 0)

    def features(self, x: torch.Tensor, q: dict | None) -> torch.Tensor:
        h = self.norm(x)
        if self.question is not None:
            if q is None:
                raise ValueError(f"a {self.spec.name} head needs the question (q=...)")
            h = torch.cat([h, self.question(q)], dim=-1)
        return h

    def forward(self, x: torch.Tensor, q: dict | None = None) -> torch.Tensor:
        return self.spec.shape_output(self.body(self.features(x, q)))


class LinearHead(PooledHead):
    """One linear layer: ``LayerNorm(x) [+ question] -> Linear -> output``."""

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__(spec, in_dim, n_tokens, **cfg)
        self.body = nn.Linear(self.body_in, spec.n_outputs)


class MLPHead(PooledHead):
    """``LayerNorm(x) [+ question] -> Linear(hidden) -> GELU -> Dropout -> Linear``.

    Options: ``hidden`` (512), ``dropout`` (0.1), ``q_dim`` (32).
    """

    DEFAULTS = {**PooledHead.DEFAULTS, "hidden": 512, "dropout": 0.1}

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__(spec, in_dim, n_tokens, **cfg)
        h = self.cfg["hidden"]
        self.body = nn.Sequential(
            nn.Linear(self.body_in, h),
            nn.GELU(),
            nn.Dropout(self.cfg["dropout"]),
            nn.Linear(h, spec.n_outputs),
        )
