"""Heads on the pooled feature vector: ``linear`` and ``mlp``; the question embedding.

Both read ``x`` of shape ``(B, D)`` (the cached pooled vector, LayerNorm-ed first).
For probes that ask questions (Level 3) the question enters as embeddings of organ A, organ B (index 16 =
"none"), the relative-position axis (0 none, 1 left/right, 2 anterior/posterior) and
the probe, concatenated to the features. Level 4 adds organ C (distance's third organ) and
the superior/inferior axis (3), with its own probe indices; the sizes come from the probe
spec (``organs``, ``question_axes``, ``n_probes``), so a Level 3 head's parameters, their
initial draws and its outputs are those it had before Level 4 existed.

Defaults: ``mlp`` hidden 512, GELU, dropout 0.1; question embeddings of width 32 each.
"""

from __future__ import annotations

import torch
from torch import nn

from spar_bench.builder.schema import LEVEL3_PROBES, N_ORGANS

N_ORGAN_TOKENS = N_ORGANS + 1  # + "none"
N_AXES = 3  # none, left/right, anterior/posterior


def organ_index(o: torch.Tensor) -> torch.Tensor:
    """An organ field as valid embedding indices (-1 -> "none", index 16)."""
    return torch.where(o < 0, N_ORGANS, o).long()


def question_indices(q: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(organ A, organ B, axis, probe) as valid embedding indices (-1 -> "none")."""
    ax = (q["axis"].long() + 1).clamp(min=0)
    return organ_index(q["organ_a"]), organ_index(q["organ_b"]), ax, q["probe"].long()


class QuestionEmbedding(nn.Module):
    """Embeds a question; ``mode="concat"`` -> (B, n*dim), ``"sum"`` -> (B, dim), n = 4 parts
    (organ A, organ B, axis, probe), 5 with organ C (Level 4).

    ``n_axes`` counts "none" (Level 3: 3; Level 4: 4 with superior/inferior) and ``n_probes``
    the level's probes; :meth:`for_spec` takes all three from a probe spec. Organ C's table is
    made last, so the tables of a Level 3 embedding take the same draws as before it existed.
    """

    def __init__(self, dim: int, mode: str = "concat", n_axes: int = N_AXES, n_probes: int = len(LEVEL3_PROBES),
                 organ_c: bool = False):  # fmt: skip
        super().__init__()
        self.mode = mode
        self.organ_a = nn.Embedding(N_ORGAN_TOKENS, dim)
        self.organ_b = nn.Embedding(N_ORGAN_TOKENS, dim)
        self.axis = nn.Embedding(n_axes, dim)
        self.probe = nn.Embedding(n_probes, dim)
        self.organ_c = nn.Embedding(N_ORGAN_TOKENS, dim) if organ_c else None
        self.out_dim = (5 if organ_c else 4) * dim if mode == "concat" else dim

    @classmethod
    def for_spec(cls, spec, dim: int, mode: str = "concat") -> QuestionEmbedding:
        """The embedding of the questions of probe ``spec`` (a question spec of :mod:`..tasks`)."""
        return cls(dim, mode, n_axes=len(spec.question_axes) + 1, n_probes=spec.n_probes,
                   organ_c="organ_c" in spec.organs)  # fmt: skip

    def forward(self, q: dict[str, torch.Tensor]) -> torch.Tensor:
        a, b, ax, p = question_indices(q)
        parts = (self.organ_a(a), self.organ_b(b), self.axis(ax), self.probe(p))
        if self.organ_c is not None:
            parts = (*parts, self.organ_c(organ_index(q["organ_c"])))
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
        self.question = QuestionEmbedding.for_spec(spec, self.cfg["q_dim"]) if spec.asks else None
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
