"""The procedural abdominal phantom and the pseudo-CT renderer.

* :mod:`spar_bench.builder.phantom.generate`: :func:`sample_phantom_params` (seeded record),
  :func:`render_phantom` (pure rendering), :func:`write_phantom_dataset` (a WORD-layout
  folder read back by ``spar_bench.builder.sources.phantom.PhantomSource``);
* :mod:`spar_bench.builder.phantom.render`: :func:`render_pseudo_ct`, HU-like intensities for any
  canonical label volume (the phantom's and real masks-only cases').

``spar-build phantom --out DIR --n N --layout canonical|mirrored|random [--intensities ct|distinct]``
writes a dataset.
"""

from __future__ import annotations

from .generate import (
    INTENSITIES,
    LAYOUTS,
    PHANTOM_VERSION,
    SIZES,
    PhantomVolume,
    make_phantom,
    render_phantom,
    sample_phantom_params,
    write_phantom_dataset,
)
from .render import RenderError, derive_body, render_pseudo_ct

__all__ = [
    "INTENSITIES",
    "LAYOUTS",
    "PHANTOM_VERSION",
    "SIZES",
    "PhantomVolume",
    "RenderError",
    "derive_body",
    "make_phantom",
    "render_phantom",
    "render_pseudo_ct",
    "sample_phantom_params",
    "write_phantom_dataset",
]
