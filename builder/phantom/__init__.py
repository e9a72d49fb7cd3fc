"""The procedural abdominal phantom.

* :mod:`spar_bench.builder.phantom.generate`: :func:`sample_phantom_params` (seeded record),
  :func:`render_phantom` (pure rendering), :func:`write_phantom_dataset` (a WORD-layout
  folder of cases drawn with :class:`PhantomOptions`, read back by
  ``spar_bench.builder.sources.phantom.PhantomSource``);
* its intensities come from the pseudo-CT renderer, :mod:`spar_bench.builder.synth.render`
  (shared with real masks-only cases).

``spar-build phantom --out DIR --n N --layout canonical|mirrored|random [--intensities ct|distinct]``
writes a dataset.
"""

from __future__ import annotations

from .generate import (
    INTENSITIES,
    LAYOUTS,
    PHANTOM_VERSION,
    SIZES,
    PhantomOptions,
    PhantomVolume,
    make_phantom,
    render_phantom,
    sample_phantom_params,
    write_phantom_dataset,
)

__all__ = [
    "INTENSITIES",
    "LAYOUTS",
    "PHANTOM_VERSION",
    "SIZES",
    "PhantomOptions",
    "PhantomVolume",
    "make_phantom",
    "render_phantom",
    "sample_phantom_params",
    "write_phantom_dataset",
]
