"""The one place that touches private APIs of third-party libraries.

Each function here wraps one private API that SPAR-Bench relies on, so that a library
release that renames or drops it breaks one function (and its test in
``tests/test_compat.py``), not a build or a run:

* :func:`features_yaml_list` - ``datasets.Features._to_yaml_list``: the ``features``
  list of a dataset card's ``dataset_info``, in exactly the form ``datasets`` reads back
  (``Features._from_yaml_list``). Gone: a :class:`~spar_bench.errors.ConfigError` naming
  the installed ``datasets`` version and the one SPAR-Bench is tested with.
* :func:`find_open_clip_checkpoint` - ``open_clip.factory._find_checkpoint_in_dir``: the
  checkpoint ``open_clip`` itself loads from a ``local-dir:`` folder. Gone: the same rule,
  reimplemented below (:func:`_find_checkpoint_fallback`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.provenance import package_version

#: Preference order of open_clip's ``_find_checkpoint_in_dir`` (open_clip_torch 2.23 - 3.x).
OPEN_CLIP_PREFERRED = (
    "open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth",
    "model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth",
)  # fmt: skip


def _version(dist: str) -> str:
    return package_version(dist) or "not installed"


def features_yaml_list(features: Any) -> list[dict[str, Any]]:
    """``datasets.Features`` as the YAML ``features`` list of a dataset card's ``dataset_info``."""
    to_yaml = getattr(features, "_to_yaml_list", None)
    if to_yaml is None:
        raise ConfigError(
            f"datasets {_version('datasets')} has no Features._to_yaml_list, which the dataset card "
            "needs; install a datasets release SPAR-Bench supports (>=4.0, tested with 4.x-5.x) "
            "or build with --no-hf"
        )
    return to_yaml()


def find_open_clip_checkpoint(folder: str | Path) -> str | None:
    """The checkpoint open_clip loads from a ``local-dir:`` folder (None when there is none)."""
    try:
        from open_clip.factory import _find_checkpoint_in_dir
    except ImportError:  # open_clip absent or the private helper gone: same rule, ours
        return _find_checkpoint_fallback(Path(folder))
    return _find_checkpoint_in_dir(Path(folder))


def _find_checkpoint_fallback(folder: Path) -> str | None:
    """open_clip's rule: a preferred name first, else the first ``.safetensors``, ``.bin``, ``.pth``."""
    found = [p for ext in ("*.safetensors", "*.bin", "*.pth") for p in folder.glob(ext)]
    if not found:
        return None
    preferred = sorted((p for p in found if p.name in OPEN_CLIP_PREFERRED),
                       key=lambda p: OPEN_CLIP_PREFERRED.index(p.name))
    if preferred:
        return str(preferred[0])
    found.sort()
    found.sort(key=lambda p: p.suffix == ".safetensors", reverse=True)
    return str(found[0])


__all__ = ["features_yaml_list", "find_open_clip_checkpoint"]
