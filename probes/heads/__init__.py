"""Probe heads: small trainable modules read on top of frozen encoder features.

Registry names (``HEADS``, lazily imported so listing them never imports torch):

* ``linear``      - one linear layer on the pooled vector (:mod:`spar_bench.probes.heads.pooled`);
* ``mlp``         - a 2-layer MLP on the pooled vector (:mod:`spar_bench.probes.heads.pooled`);
* ``attnpool``    - learned queries attending once over the token set
  (:mod:`spar_bench.probes.heads.attnpool`);
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
:func:`build_head`; a head class takes ``(spec, in_dim, n_tokens, **cfg)``.
"""

from __future__ import annotations

from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.registry import Registry

HEADS: Registry = Registry("head")
HEADS.register_lazy("linear", "spar_bench.probes.heads.pooled:LinearHead", input="pooled")
HEADS.register_lazy("mlp", "spar_bench.probes.heads.pooled:MLPHead", input="pooled")
HEADS.register_lazy("attnpool", "spar_bench.probes.heads.attnpool:AttnPoolHead", input="tokens")
HEADS.register_lazy("transformer", "spar_bench.probes.heads.transformer:TransformerHead", input="tokens")


def head_input(name: str) -> str:
    """``"pooled"`` or ``"tokens"``: which cached features the head reads."""
    return HEADS.meta(name)["input"]


def build_head(name: str, spec, in_dim: int, n_tokens: int = 1, **cfg: Any):
    """Instantiate head ``name`` for probe ``spec`` (a spec or its name) on features of width ``in_dim``.

    ``n_tokens`` is the token count (token heads); ``cfg`` overrides the head's
    documented defaults (unknown keys raise :class:`ConfigError`).
    """
    cls = HEADS.get(name)
    unknown = set(cfg) - set(cls.DEFAULTS)
    if unknown:
        raise ConfigError(
            f"head {name!r} has no option(s) {sorted(unknown)}; options: {sorted(cls.DEFAULTS)}"
        )
    from ..tasks import get_probe

    return cls(get_probe(spec), in_dim, n_tokens, **cfg)


def head_defaults(name: str) -> dict[str, Any]:
    """The documented options of head ``name`` and their defaults."""
    return dict(HEADS.get(name).DEFAULTS)


__all__ = ["HEADS", "build_head", "head_defaults", "head_input"]
