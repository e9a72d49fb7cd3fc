"""Provenance records: package versions, JSON-safe values, and paths fit to publish.

One rule each, used by the build manifest and dataset card, feature caches and runs:

* :func:`package_versions` - installed versions of named distributions (``None`` for one
  that is not installed). The lists recorded per output are :data:`BUILD_PACKAGES`,
  :data:`CACHE_PACKAGES`, :data:`RUN_PACKAGES` and :data:`VQA_PACKAGES`.
* :func:`json_safe` - a value as plain JSON. The rule: mapping keys become strings,
  tuples and arrays become lists, numpy scalars become Python numbers, paths become
  POSIX strings, and a non-finite float (NaN, +-inf) becomes ``None`` (JSON ``null``:
  "no value", e.g. a metric undefined on an empty split). JSON has no NaN; the writers
  refuse one (``allow_nan=False``) rather than emit text other parsers reject.
* :func:`portable_path` - a path as published: relative to a base folder when it lies
  inside it, else ``None``. Nothing publishable carries an absolute local path;
  :func:`local_paths` finds any that slipped through.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator
from importlib import metadata
from pathlib import Path, PurePath
from typing import Any

import numpy as np

#: Libraries whose behaviour shapes a build's bytes (shards, Parquet, PNG, card).
BUILD_PACKAGES = ("spar-bench", "numpy", "scipy", "h5py", "hdf5plugin", "nibabel", "SimpleITK",
                  "datasets", "pyarrow", "pillow", "PyYAML", "torch")  # fmt: skip
#: Libraries whose behaviour shapes a feature cache.
CACHE_PACKAGES = ("spar-bench", "torch", "timm", "transformers", "open_clip_torch", "h5py", "numpy")
#: Libraries whose behaviour shapes a trained head and its metrics.
RUN_PACKAGES = ("spar-bench", "torch", "numpy", "scipy")
#: Libraries whose behaviour shapes an MLLM (``spar-probe vqa``) run.
VQA_PACKAGES = ("spar-bench", "numpy", "torch", "transformers", "pillow")
#: The version of docs/PROTOCOL.md this code implements: recorded in every build manifest
#: (``protocol_version``) and in every run's ``config.json`` and ``metrics.json``; the report
#: says which version each run used. Bump it with every change of a rule in PROTOCOL.md
#: (and list the change in its "Changes" section).
PROTOCOL_VERSION = "1.4"


def protocol_versions(manifest: dict[str, Any] | None) -> dict[str, str | None]:
    """What a run records of the protocol (docs/PROTOCOL.md): the version this code
    implements and the version the build (its ``manifest``) was made under (None: a build
    older than protocol 1.2, which did not record it)."""
    return {"protocol_version": PROTOCOL_VERSION,
            "build_protocol_version": (manifest or {}).get("protocol_version")}


def build_unanswerable(manifest: dict[str, Any] | None, probe: str) -> dict[str, Any] | None:
    """What the build dropped of ``probe`` (``level3.size``) because the pixel reader of its
    stored 224 masks does not give the label (protocol 1.4, the manifest's ``unanswerable``):
    ``{"dropped", "asked", "share"}`` over every source and split, or None (a build made
    before, or a probe that is not screened)."""
    level, _, name = probe.partition(".")
    per_probe = ((manifest or {}).get("unanswerable") or {}).get("per_probe") or {}
    return per_probe.get(name) if level == "level3" else None


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def package_versions(dists: Iterable[str]) -> dict[str, str | None]:
    """``{distribution: version or None}`` for ``dists`` (e.g. :data:`BUILD_PACKAGES`)."""
    return {d: package_version(d) for d in dists}


def json_safe(obj: Any) -> Any:
    """``obj`` as plain JSON values, by the rule in the module docstring."""

    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, PurePath):
        return obj.as_posix()
    return obj


def portable_path(path: str | os.PathLike, base: str | os.PathLike) -> str | None:
    """``path`` relative to folder ``base`` (POSIX) when it lies inside it, else None.

    Both are resolved first, so ``data/../data/word`` and a symlinked base compare equal.
    """
    p, b = Path(path).resolve(), Path(base).resolve()
    try:
        return p.relative_to(b).as_posix()
    except ValueError:
        return None


def path_from_build(path: str | os.PathLike, out: str | os.PathLike) -> str | None:
    """``path`` as seen from the build folder ``out`` (``"../data/word"``), when it lies in the
    folder that holds ``out``; else None (its location is then not published)."""
    rel = portable_path(path, Path(out).resolve().parent)
    return None if rel is None else Path(os.path.relpath(Path(out).resolve().parent / rel,
                                                          Path(out).resolve())).as_posix()


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


def local_prefixes(*paths: str | os.PathLike) -> list[str]:
    """Absolute folders that must not appear in published text: ``paths``, the current
    directory and the home folder (resolved and as given)."""
    out = set()
    for p in (*paths, Path.cwd(), Path.home()):
        for form in (Path(p).absolute(), Path(p).resolve()):
            if str(form) != form.anchor:  # never flag "/" itself
                out.add(str(form))
    return sorted(out, key=len, reverse=True)


def local_paths(obj: Any, prefixes: Iterable[str]) -> list[str]:
    """Strings in ``obj`` (keys included) that contain one of the absolute ``prefixes`` as a
    path (``/home/me`` matches ``x=/home/me/data`` but not ``/home/meg`` or ``a/home/me``)."""

    pats = [re.compile(r"(?<![\w.~/-])" + re.escape(p) + r"(?![\w.-])") for p in prefixes if p]
    return sorted({s for s in _strings(obj) if any(pat.search(s) for pat in pats)})


__all__ = ["BUILD_PACKAGES", "CACHE_PACKAGES", "RUN_PACKAGES", "VQA_PACKAGES", "json_safe",
           "local_paths", "local_prefixes", "package_version", "package_versions",
           "path_from_build", "portable_path"]  # fmt: skip
