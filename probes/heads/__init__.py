"""Probe heads: small trainable modules read on top of frozen encoder features.

Registry names (``HEADS``, lazily imported so listing them never imports torch; a head's
facts, ``input_kind`` and ``DEFAULTS``, are its class's attributes, declared once):

* ``linear``      - one linear layer on the pooled vector (:mod:`spar_bench.probes.heads.pooled`);
* ``mlp``         - a 2-layer MLP on the pooled vector (:mod:`spar_bench.probes.heads.pooled`);
* ``attnpool``    - learned queries attending once over the token set
  (:mod:`spar_bench.probes.heads.attnpool`);
* ``coordpool``   - ``attnpool`` whose attention heads also report where they looked (the
  attention-weighted mean of the token-grid coordinates; :mod:`spar_bench.probes.heads.coordpool`);
* ``transformer`` - a few Transformer layers over the full token set, tokens first
  projected to a small width; Levels 1-2 prepend the tile queries, Level 3 encodes each
  slice once and lets every question read it by cross-attention
  (:mod:`spar_bench.probes.heads.transformer`).

Every head maps features (and, when the probe asks questions, the question) to the
output its probe spec declares (:mod:`spar_bench.probes.tasks`): ``(B, *spec.output_shape)``,
made by ``spec.shape_output`` from a flat output - ``"points"`` ``(B, 16, 2)`` normalised
(x, y) per organ, ``"assignment"`` ``(B, 16, 16)`` scores of (mosaic position, slot),
``"classes"`` ``(B, n_classes)`` logits.

Token heads share :class:`spar_bench.probes.heads.base.TokenHead`. Build one with
:func:`build_head`; a head class takes ``(spec, in_dim, n_tokens, **cfg)``. What the
training loop reads of a head is the :class:`Head` protocol (:class:`TokenHeadLike` for
token heads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from spar_bench.errors import ConfigError
from spar_bench.registry import Registry

from ..tasks import ProbeSpec, get_probe

if TYPE_CHECKING:
    import numpy as np


class Head(Protocol):
    """What the training loop, ``fit`` and ``finetune`` read of a head (a ``torch.nn.Module``).

    Every head class declares its facts once, as class attributes: ``input_kind`` and
    ``DEFAULTS`` (the registry holds only where the class lives).
    """

    #: ``"pooled"`` (reads the pooled vector ``(B, D)``) or ``"tokens"`` (the tokens ``(B, T, D)``)
    input_kind: ClassVar[str]
    #: the head's options and their defaults (``build_head`` refuses any other key)
    DEFAULTS: ClassVar[dict[str, Any]]
    #: True when the head encodes each cache row once for all its items, so the training
    #: loop batches items row by row (Level 3 ``transformer``)
    shares_body: bool
    spec: ProbeSpec
    #: ``DEFAULTS`` updated with the options it was built with
    cfg: dict[str, Any]

    def __call__(self, x: Any, q: dict | None = None, *index: Any) -> Any: ...


class TokenHeadLike(Head, Protocol):
    """A token head (``input_kind == "tokens"``): a fixed projection fitted on training tokens
    (:class:`spar_bench.probes.heads.base.TokenHead`)."""

    in_dim: int
    proj_dim: int

    def fit_projection(self, tokens: np.ndarray) -> None: ...

    def preproject(self, tokens: np.ndarray) -> np.ndarray: ...


HEADS: Registry = Registry("head")
HEADS.register_lazy("linear", "spar_bench.probes.heads.pooled:LinearHead")
HEADS.register_lazy("mlp", "spar_bench.probes.heads.pooled:MLPHead")
HEADS.register_lazy("attnpool", "spar_bench.probes.heads.attnpool:AttnPoolHead")
HEADS.register_lazy("coordpool", "spar_bench.probes.heads.coordpool:CoordPoolHead")
HEADS.register_lazy("transformer", "spar_bench.probes.heads.transformer:TransformerHead")


def head_input(name: str) -> str:
    """``"pooled"`` or ``"tokens"``: which cached features head ``name`` reads (its class's
    ``input_kind``)."""
    return HEADS.get(name).input_kind


def build_head(
    name: str, spec: ProbeSpec | str, in_dim: int, n_tokens: int = 1, **cfg: Any
) -> Head:
    """Instantiate head ``name`` for probe ``spec`` (a spec or its name) on features of width ``in_dim``.

    ``n_tokens`` is the token count (token heads); ``cfg`` overrides the head's
    documented defaults (unknown keys raise :class:`ConfigError`). A token head also takes
    ``token_grid=[n_prefix, D, H, W]``: a 3-D encoder's grid, for 3-D position embeddings
    (:mod:`spar_bench.probes.heads.positions`; recorded in its ``cfg``).
    """
    cls = HEADS.get(name)
    unknown = set(cfg) - set(cls.DEFAULTS) - ({"token_grid"} if cls.input_kind == "tokens" else set())
    if unknown:
        raise ConfigError(
            f"head {name!r} has no option(s) {sorted(unknown)}; options: {sorted(cls.DEFAULTS)}"
        )
    return cls(get_probe(spec), in_dim, n_tokens, **cfg)


def head_defaults(name: str) -> dict[str, Any]:
    """The documented options of head ``name`` and their defaults."""
    return dict(HEADS.get(name).DEFAULTS)


__all__ = ["HEADS", "Head", "TokenHeadLike", "build_head", "head_defaults", "head_input"]
