"""How a feature cache stores the tokens of many-token encoders (docs/FORMATS.md).

A ViT-B/14 at 518 px (RadDINO's native size) gives 1 + 37 x 37 tokens of 768 dimensions:
2.1 MB per image in fp16, about 56 GB per layer for a WORD-sized build. Three reductions,
applied in this order on the device before the tokens are written, each recorded in the
cache's ``token_storage`` attribute (and shown by the report):

- ``grid=G``: the patch tokens are pooled to a G x G grid by area averaging (the prefix
  tokens, CLS and registers, are kept as they are). 37 x 37 -> 14 x 14 is 7x fewer tokens.
  A 3-D encoder's (D', H', W') grid is pooled to G x G x G the same way.
- ``proj=pca:K`` / ``proj=random:K``: every token is mapped to K dimensions by a linear map
  fitted on the *training split only* (PCA: mean and top-K principal axes of a deterministic
  sample of training tokens) or drawn from a seed (random: a Gaussian Johnson-Lindenstrauss
  map scaled by 1/sqrt(K)). The map is stored in the cache (``/token_projection``).
- ``int8``: each row's tokens are quantised to int8 with one scale per channel (the
  channel's largest absolute value over that row's tokens / 127), stored beside them as
  ``token_scale``; :class:`~spar_bench.probes.features.FeatureCache` dequantises on read.

The pooled vectors (what pooled heads read) are always computed from the full token set and
stored unreduced: they are small. Every function here is pure: same input, same output bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from spar_bench.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

_PROJ = re.compile(r"(pca|random):([1-9][0-9]*)")


@dataclass(frozen=True)
class TokenStorage:
    """The reductions applied to tokens before they are written; the identity by default."""

    grid: int | None = None
    proj: str | None = None
    int8: bool = False

    @classmethod
    def parse(cls, grid: int | None = None, proj: str | None = None, int8: bool = False) -> TokenStorage:
        """From the CLI's ``--token-grid``, ``--token-proj`` and ``--token-int8``; checked."""
        if grid is not None and int(grid) < 1:
            raise ConfigError(f"--token-grid must be a positive grid side like 14; got {grid!r}")
        if proj in ("", "none"):
            proj = None
        if proj is not None and not _PROJ.fullmatch(proj):
            raise ConfigError(f"--token-proj must be pca:K or random:K (e.g. pca:128) or none; got {proj!r}")
        return cls(int(grid) if grid is not None else None, proj, bool(int8))

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> TokenStorage:
        d = d or {}
        return cls(d.get("grid"), d.get("proj"), bool(d.get("int8", False)))

    def to_dict(self) -> dict[str, Any]:
        return {"grid": self.grid, "proj": self.proj, "int8": self.int8}

    @property
    def identity(self) -> bool:
        return self.grid is None and self.proj is None and not self.int8

    @property
    def proj_kind(self) -> str | None:
        return self.proj.split(":")[0] if self.proj else None

    @property
    def proj_dim(self) -> int | None:
        return int(self.proj.split(":")[1]) if self.proj else None

    def describe(self) -> str:
        """A short label for reports: ``full tokens`` or ``grid 14x14, pca:128, int8``."""
        parts = ([f"grid {self.grid}x{self.grid}"] if self.grid else []) + ([self.proj] if self.proj else [])
        return ", ".join(parts + (["int8"] if self.int8 else [])) or "full tokens"

    def slug(self) -> str:
        """The runs' encoder-folder suffix: ``""`` for full tokens, else ``-tokens-grid14-pca128-int8``.

        Runs over reduced tokens are other runs than those over full tokens: they never share
        a folder, and the report's encoder column says which storage each row read.
        """
        if self.identity:
            return ""
        parts = ([f"grid{self.grid}"] if self.grid else []) + ([self.proj.replace(":", "")] if self.proj else [])
        return "-tokens-" + "-".join(parts + (["int8"] if self.int8 else []))

    def check_encoder(self, n_prefix: int, grid: tuple[int, ...] | None, dim: int, where: str) -> None:
        """Refuse reductions the encoder's token layout cannot take, in one line."""
        if self.grid is not None:
            if grid is None:
                raise ConfigError(f"{where}: --token-grid needs an encoder with a known token grid")
            if self.grid > min(grid):
                raise ConfigError(f"{where}: --token-grid {self.grid} is larger than the encoder's "
                                  f"{'x'.join(map(str, grid))} token grid")
        if self.proj_dim is not None and self.proj_dim > dim:
            raise ConfigError(f"{where}: --token-proj {self.proj} asks for more dimensions than the "
                              f"encoder's {dim}")


def pool_grid(tokens: torch.Tensor, n_prefix: int, grid: tuple[int, ...], side: int) -> torch.Tensor:
    """``(B, n_prefix + H*W, D)`` -> ``(B, n_prefix + side*side, D)``: patch tokens area-averaged
    (a 3-D grid ``(D', H', W')``: to ``side**3`` tokens, z-major)."""
    import torch
    import torch.nn.functional as F

    b, _, d = tokens.shape
    patches = tokens[:, n_prefix:].reshape(b, *grid, d).movedim(-1, 1).float()
    if len(grid) == 3:
        pooled = F.adaptive_avg_pool3d(patches, (side,) * 3)
    else:
        pooled = F.adaptive_avg_pool2d(patches, (side, side))
    pooled = pooled.movedim(1, -1).reshape(b, side ** len(grid), d)
    return torch.cat([tokens[:, :n_prefix].float(), pooled], dim=1)


def random_projection(dim: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, components)``: zero mean and a seeded Gaussian ``(dim, k)`` map / sqrt(k)."""
    rng = np.random.default_rng(seed)
    comps = rng.standard_normal((dim, k)) / np.sqrt(k)
    return np.zeros(dim, np.float32), comps.astype(np.float32)


def pca_projection(sample: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, components)`` of ``sample`` (``(n, dim)`` training tokens): top-``k`` axes."""
    x = np.asarray(sample, np.float64)
    if x.ndim != 2:
        raise ConfigError("a PCA token projection needs a 2-D sample of training tokens")
    return pca_from_moments(x.shape[0], x.sum(axis=0), x.T @ x, k)


def pca_from_moments(n: int, total: np.ndarray, xtx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, components)`` from ``n`` tokens' sum and ``X^T X`` (float64, ``dim x dim``).

    The moments can be accumulated batch by batch (on the device), so the sample never has to
    be held; each axis's sign is fixed (largest coefficient positive) so the map is
    deterministic.
    """
    if n < 2:
        raise ConfigError("a PCA token projection needs at least 2 training tokens")
    mean = np.asarray(total, np.float64) / n
    cov = (np.asarray(xtx, np.float64) - n * np.outer(mean, mean)) / (n - 1)
    vals, vecs = np.linalg.eigh((cov + cov.T) / 2)
    comps = vecs[:, np.argsort(vals)[::-1][:k]]
    signs = np.sign(comps[np.abs(comps).argmax(axis=0), np.arange(comps.shape[1])])
    comps = comps * np.where(signs == 0, 1.0, signs)
    return mean.astype(np.float32), comps.astype(np.float32)


class Moments:
    """Running sum and ``X^T X`` of tokens (float64, on their device): PCA without the sample."""

    def __init__(self) -> None:
        self.n, self.total, self.xtx = 0, None, None

    def update(self, tokens: torch.Tensor) -> None:
        import torch

        x = tokens.reshape(-1, tokens.shape[-1]).to(torch.float64)
        if self.total is None:
            self.total, self.xtx = x.sum(dim=0), x.T @ x
        else:
            self.total += x.sum(dim=0)
            self.xtx += x.T @ x
        self.n += x.shape[0]

    def pca(self, k: int) -> Projection:
        if self.total is None:
            raise ConfigError("a PCA token projection needs training images; the build has none")
        mean, comps = pca_from_moments(self.n, self.total.cpu().numpy(), self.xtx.cpu().numpy(), k)
        return Projection(mean, comps)


def quantise_int8(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T, D)`` -> int8 tokens and ``(B, D)`` float32 scales (channel absmax / 127 per row)."""
    import torch

    x = tokens.float()
    scale = x.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe[:, None, :]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantise_int8(q: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Inverse of :func:`quantise_int8` (up to rounding): ``q * scale`` per row and channel."""
    return (q.astype(np.float32) * scale.astype(np.float32)[:, None, :]).astype(dtype, copy=False)


@dataclass(frozen=True)
class Projection:
    """A fitted token map: ``(x - mean) @ components``."""

    mean: np.ndarray
    components: np.ndarray

    def apply(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch

        mean = torch.as_tensor(self.mean, device=tokens.device)
        comps = torch.as_tensor(self.components, device=tokens.device)
        return (tokens.float() - mean) @ comps


def patch_grid(n_tokens: int, n_prefix: int, grid: tuple[int, ...] | None) -> tuple[int, ...]:
    """The patch grid of a token set of ``n_tokens``: the encoder's, else the square one (a
    3-D encoder's: the cube)."""

    patches = n_tokens - n_prefix
    if grid is not None and math.prod(grid) == patches:
        return tuple(grid)
    if grid is not None and len(grid) == 3:
        side = round(patches ** (1 / 3))
        if side**3 != patches:
            raise ConfigError(f"--token-grid: a layer of {n_tokens} tokens ({n_prefix} prefix) has no "
                              "cubic patch grid to pool; drop --token-grid for this encoder")
        return side, side, side
    side = math.isqrt(patches)
    if side * side != patches:
        raise ConfigError(f"--token-grid: a layer of {n_tokens} tokens ({n_prefix} prefix) has no "
                          "square patch grid to pool; drop --token-grid for this encoder")
    return side, side


@dataclass
class Reducer:
    """Applies a :class:`TokenStorage` to a batch's ``{layer: (tokens, pooled)}``.

    ``tiled``: levels whose tokens are ``tiles`` token sets stacked (``--tile-encoding
    per-tile``); the grid is pooled tile by tile. ``projections``: ``{layer: Projection}``.
    """

    storage: TokenStorage
    n_prefix: int = 0
    grid: tuple[int, int] | None = None
    projections: dict[int, Projection] | None = None
    tiled: tuple[str, ...] = ()
    tiles: int = 1

    @classmethod
    def identity(cls) -> Reducer:
        return cls(TokenStorage())

    def pool(self, level: str, tokens: torch.Tensor) -> torch.Tensor:
        """The grid pooling alone (what a PCA projection is fitted on)."""
        if self.storage.grid is None:
            return tokens
        k = self.tiles if level in self.tiled else 1
        b, t, d = tokens.shape
        per = tokens.reshape(b * k, t // k, d)
        pooled = pool_grid(per, self.n_prefix, patch_grid(t // k, self.n_prefix, self.grid), self.storage.grid)
        return pooled.reshape(b, -1, d)

    def __call__(self, level: str, res: dict) -> dict[int, dict[str, torch.Tensor]]:
        out = {}
        for v, (tokens, pooled) in res.items():
            tokens = self.pool(level, tokens)
            if self.projections:
                tokens = self.projections[v].apply(tokens)
            arrays = {"tokens": tokens, "pooled": pooled}
            if self.storage.int8:
                arrays["tokens"], arrays["token_scale"] = quantise_int8(tokens)
            out[v] = arrays
        return out
