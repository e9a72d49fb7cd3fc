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

Every head maps features (and, for Level 3, the question) to the output of its level:

* Level 1: ``(B, 16, 2)`` normalised (x, y) centroid per organ (class order);
* Level 2: ``(B, 16, 16)`` scores of (mosaic position, arrangement slot);
* Level 3: ``(B, n_classes)`` logits of the probe's answer.

Build one with :func:`build_head`; a head class takes ``(task, in_dim, n_tokens, **cfg)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spar_bench.builder.schema import LEVEL3_N_CLASSES, LEVEL3_PROBES, N_ORGANS, PROBES

from spar_bench.errors import ConfigError
from spar_bench.registry import Registry, UnknownNameError

HEADS: Registry = Registry("head")
HEADS.register_lazy("linear", "spar_bench.probes.heads.pooled:LinearHead", input="pooled")
HEADS.register_lazy("mlp", "spar_bench.probes.heads.pooled:MLPHead", input="pooled")
HEADS.register_lazy("attnpool", "spar_bench.probes.heads.attnpool:AttnPoolHead", input="tokens")
HEADS.register_lazy("transformer", "spar_bench.probes.heads.transformer:TransformerHead", input="tokens")


@dataclass(frozen=True)
class Task:
    """What a head must predict: one probe of ``spar_bench.builder.schema.PROBES``."""

    probe: str

    def __post_init__(self) -> None:
        if self.probe not in PROBES:
            import difflib

            close = difflib.get_close_matches(self.probe, PROBES, n=2)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown probe {self.probe!r}.{hint} Known: {', '.join(PROBES)}")

    @property
    def level(self) -> str:
        return self.probe.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.probe.split(".", 1)[1]

    @property
    def n_classes(self) -> int:
        """Answer classes (Level 3); 0 for Levels 1-2."""
        return LEVEL3_N_CLASSES[self.name] if self.level == "level3" else 0

    @property
    def probe_index(self) -> int:
        """Index into ``LEVEL3_PROBES`` (Level 3); -1 otherwise."""
        return LEVEL3_PROBES.index(self.name) if self.level == "level3" else -1

    @property
    def n_outputs(self) -> int:
        """Width of a flat output layer: 32 (L1), 256 (L2) or n_classes (L3)."""
        if self.level == "level1":
            return N_ORGANS * 2
        if self.level == "level2":
            return N_ORGANS * N_ORGANS
        return self.n_classes


def head_input(name: str) -> str:
    """``"pooled"`` or ``"tokens"``: which cached features the head reads."""
    try:
        return HEADS.meta(name)["input"]
    except UnknownNameError as e:
        raise ConfigError(str(e)) from None


def build_head(name: str, task: Task, in_dim: int, n_tokens: int = 1, **cfg: Any):
    """Instantiate head ``name`` for ``task`` on features of width ``in_dim``.

    ``n_tokens`` is the token count (token heads); ``cfg`` overrides the head's
    documented defaults (unknown keys raise :class:`ConfigError`).
    """
    try:
        cls = HEADS.get(name)
    except UnknownNameError as e:
        raise ConfigError(str(e)) from None
    unknown = set(cfg) - set(cls.DEFAULTS)
    if unknown:
        raise ConfigError(
            f"head {name!r} has no option(s) {sorted(unknown)}; options: {sorted(cls.DEFAULTS)}"
        )
    return cls(task, in_dim, n_tokens, **cfg)


__all__ = ["HEADS", "Task", "build_head", "head_input"]
