"""The base of the token heads (``attnpool``, ``transformer``): fixed PCA projection, queries, outputs.

Token heads read ``(B, T, D)`` token features. Projecting thousands of 768-wide tokens
through a learned layer every epoch is the CPU wall of a sweep, so a token head first
fits a FIXED projection: PCA of the training tokens to ``proj_dim`` (default 128),
stored as buffers in the head (it travels with the state_dict, so ``eval`` on another
cache applies the same one). The training loop calls :meth:`TokenHead.preproject`
once on every split and trains on the small tokens.

``proj_dim="none"`` (CLI ``--proj-dim none``; ``0`` means the same): no PCA, every
channel reaches the head. The fixed map is then only centring per channel and ONE
global scale (1 / the standard deviation of all centred values), so no channel is
dropped, rotated or amplified against the others (per-channel whitening would scale
near-constant channels of weak features by up to 1e6); the learned ``embed`` layer reads
all ``in_dim`` channels. It costs memory (pre-projected splits are ``in_dim`` wide,
float32) and time (docs/SCALE.md).

Positions: one learned embedding per token; over a 3-D encoder's tokens (``token_grid``
given: Level 4) factorised (z, row, col) embeddings (:mod:`.positions`).

Queries: ``spec.n_queries`` learned query tokens - 16 tile queries for Levels 1-2
(query p belongs to organ p in Level 1, to mosaic position p in Level 2), one query
for a probe that asks questions (Levels 3-4), plus the question (sum of organ A, organ B,
axis and probe embeddings; Level 4 adds organ C's).
Token heads take ``forward(x, q=None, index=None)``: with ``index`` ``(B,)``, ``x``
holds only the distinct cache rows of the batch and item ``i`` reads row ``index[i]``
(Level 3: one slice, many questions; see :func:`spar_bench.probes.train.group_batch`).
Outputs (the spec's ``output``): ``"assignment"`` probes get query x slot-embedding
dot products (scaled by 1/sqrt(d)); every other output is a linear layer on each
query's output, to the last dimension of ``spec.output_shape`` ((x, y) per tile query,
or the logits of the question's answer).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import nn

from .pooled import QuestionEmbedding
from .positions import GridPositions

#: projections fitted in this process, by (sample shape and dtype, width, no PCA, sample digest): the
#: last :data:`MAX_PROJECTIONS` (:meth:`TokenHead.fit_projection`)
PROJECTIONS: dict[tuple, dict[str, torch.Tensor]] = {}
MAX_PROJECTIONS = 4


def no_projection(proj_dim) -> bool:
    """Whether a token head's ``proj_dim`` option asks for no PCA (``"none"``, 0 or None)."""
    return proj_dim in (None, 0, "none")


class TokenHead(nn.Module):
    input_kind = "tokens"
    #: True when the head encodes each cache row once and the training loop should batch
    #: items row by row (Level 3 ``transformer``: one body per slice for all its questions).
    shares_body = False
    DEFAULTS: dict = {"d_model": 128, "n_heads": 4, "dropout": 0.1, "proj_dim": 128}

    def __init__(self, spec, in_dim: int, n_tokens: int = 1, **cfg):
        super().__init__()
        self.spec = spec
        token_grid = cfg.pop("token_grid", None)  # a 3-D encoder's [n_prefix, D, H, W] (.positions)
        self.cfg = {**self.DEFAULTS, **cfg}
        d = self.cfg["d_model"]
        self.no_pca = no_projection(self.cfg["proj_dim"])
        k = in_dim if self.no_pca else min(int(self.cfg["proj_dim"]), in_dim)
        self.in_dim, self.proj_dim = in_dim, k
        self.register_buffer("proj_mean", torch.zeros(in_dim))
        self.register_buffer("proj_w", torch.eye(in_dim)[:, :k].clone())
        self.register_buffer("proj_scale", torch.ones(k))
        self.embed = nn.Linear(k, d)
        if token_grid is None:
            self.pos = nn.Parameter(torch.randn(max(n_tokens, 1), d) * 0.02)
        else:  # 3-D position embeddings from the recorded grid; 2-D heads are as before
            self.cfg["token_grid"] = [int(g) for g in token_grid]
            self.pos = GridPositions(self.cfg["token_grid"], d, n_tokens)
        self.question = QuestionEmbedding.for_spec(spec, d, mode="sum") if spec.asks else None
        self.queries = nn.Parameter(torch.randn(spec.n_queries, d) * 0.02)
        width = spec.output_shape[-1]
        if spec.output == "assignment":  # query x slot scores
            self.slots = nn.Parameter(torch.randn(width, d) * 0.02)
        self.out_norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d if spec.output == "assignment" else width)

    # ---------------------------------------------------------------- projection
    @torch.no_grad()
    def fit_projection(self, tokens: np.ndarray) -> None:
        """Fit the fixed PCA projection on a sample of training tokens ``(M, D)``
        (``proj_dim="none"``: centring and one global scale, no PCA).

        The fit of the same sample to the same width is kept in this process
        (:data:`PROJECTIONS`): a sweep's token heads on one level often fit on the same rows
        (every training row, when the level has fewer than ``50000 / n_tokens``), and an
        fp64 covariance and eigendecomposition of 1280-wide tokens costs seconds a run."""
        tokens = np.ascontiguousarray(tokens)
        key = (tokens.shape, tokens.dtype.str, self.proj_dim, self.no_pca,
               hashlib.blake2b(tokens.data, digest_size=20).digest())
        if key not in PROJECTIONS:
            while len(PROJECTIONS) >= MAX_PROJECTIONS:
                PROJECTIONS.pop(next(iter(PROJECTIONS)))
            PROJECTIONS[key] = self._fitted_projection(tokens)
        for name, value in PROJECTIONS[key].items():
            getattr(self, name).copy_(value)

    def _fitted_projection(self, tokens: np.ndarray) -> dict[str, torch.Tensor]:
        """``{buffer name: value}`` of the projection fitted on ``tokens``."""
        x = torch.as_tensor(np.asarray(tokens, dtype=np.float64))
        mean = x.mean(dim=0)
        xc = x - mean
        if self.no_pca:
            scale = torch.full_like(self.proj_scale, float(1.0 / xc.std().clamp(min=1e-6)))
            return {"proj_mean": mean.float(), "proj_scale": scale}
        cov = xc.T @ xc / max(x.shape[0] - 1, 1)
        evals, evecs = torch.linalg.eigh(cov)
        order = torch.argsort(evals, descending=True)[: self.proj_dim]
        w = evecs[:, order]
        # deterministic sign: largest-magnitude entry of each component positive
        sign = torch.sign(w.gather(0, w.abs().argmax(dim=0, keepdim=True)))
        w = w * torch.where(sign == 0, torch.ones_like(sign), sign)
        std = (xc @ w).std(dim=0).clamp(min=1e-6)
        return {"proj_mean": mean.float(), "proj_w": w.float(), "proj_scale": (1.0 / std).float()}

    @torch.no_grad()
    def preproject(self, tokens: np.ndarray) -> np.ndarray:
        """Apply the fixed projection: ``(N, T, D)`` -> ``(N, T, proj_dim)`` float32."""
        t = torch.as_tensor(np.asarray(tokens, dtype=np.float32))
        if t.shape[-1] != self.in_dim:
            raise ValueError(
                f"tokens have width {t.shape[-1]}, the head was built for {self.in_dim}"
            )
        if self.no_pca:  # proj_w is the identity: skip the (D, D) product
            return ((t - self.proj_mean) * self.proj_scale).numpy()
        return (((t - self.proj_mean) @ self.proj_w) * self.proj_scale).numpy()

    # ---------------------------------------------------------------- pieces
    def query_tokens(self, batch: int, q: dict | None) -> torch.Tensor:
        qs = self.queries.unsqueeze(0).expand(batch, -1, -1)
        if self.question is not None:
            if q is None:
                raise ValueError(f"a {self.spec.name} head needs the question (q=...)")
            qs = qs + self.question(q).unsqueeze(1)
        return qs

    def pool_inputs(self, x: torch.Tensor, q: dict | None, index: torch.Tensor | None):
        """Keys/values ``(B, T, d)`` (embedded tokens through the head's ``kv_norm``; item ``i``
        reads row ``index[i]`` when ``index`` is given) and queries ``(B, Q, d)`` of a head that
        attends once over the tokens (``attnpool``, ``coordpool``)."""
        kv = self.kv_norm(self.token_embed(x))
        if index is not None:
            kv = kv[index]
        return kv, self.query_tokens(kv.shape[0], q)

    def read_one_token(self) -> TokenHead:
        """Make this head read a single token (a blind baseline's one constant row): its
        learned position table is cut to the first row, the only one such an input used.
        The values and the parameters' order are kept, so its training is what it was."""
        if isinstance(self.pos, GridPositions):
            raise ValueError("a head with 3-D grid positions cannot read one token; build it without token_grid")
        self.pos = nn.Parameter(self.pos.detach()[:1].clone())
        return self

    def token_embed(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if isinstance(self.pos, GridPositions):
            return self.embed(x) + self.pos(t)
        if t != self.pos.shape[0]:  # fewer would shift every position embedding: wrong, silently
            raise ValueError(f"{t} tokens but the head was built for {self.pos.shape[0]}: its position "
                             "embeddings fit that token grid only; fit a head on these features")
        return self.embed(x) + self.pos

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """Query outputs ``(B, Q, d)`` -> the probe's output ``(B, *spec.output_shape)``."""
        o = self.out(self.out_norm(h))
        if self.spec.output == "assignment":
            o = o @ self.slots.T / math.sqrt(o.shape[-1])
        return self.spec.shape_output(o.flatten(1))
