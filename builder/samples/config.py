"""The recorded parameters of sample generation (Levels 1-4).

Every field of :class:`SampleConfig` is written into the build manifest through
:meth:`SampleConfig.to_dict`; :meth:`SampleConfig.from_dict` rebuilds the exact config
from it, so a build can be regenerated bit for bit from its manifest. The Level 4 fields
(:data:`LEVEL4_FIELDS`) are recorded only when ``"level4"`` is among the levels, so the
manifests of builds without Level 4 are unchanged.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from spar_bench.errors import ConfigError

from ..schema import ARRANGEMENTS, LEVELS, N_ORGANS

COUNTERFACTUALS = (None, "mirror", "mirror+flip")
#: Fields read only by Level 4 (left out of :meth:`SampleConfig.to_dict` without it).
LEVEL4_FIELDS = ("volume_size", "l4_questions_per_probe", "l4_min_voxels", "adjacency_mm")
#: The smallest Level 4 cube side.
VOLUME_SIZE_MIN = 8
#: Bytes a Level 4 volume of side S needs per voxel of its S^3 cube while a case is processed:
#: measured peak (tracemalloc) about 33 x S^3 making a cube (float32 resample, the uint8 image,
#: label and lesion) with its mirrored and flipped copies and their measures; rounded up.
VOLUME_BYTES_PER_VOXEL = 36


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``, else the free
    physical pages); None when the system says neither."""

    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def volume_size_max(available: int | None) -> int | None:
    """The largest cube side S whose volume (:data:`VOLUME_BYTES_PER_VOXEL` x S^3 bytes) fits in
    ``available`` bytes; None when ``available`` is unknown."""
    if available is None:
        return None
    side = int(round((available / VOLUME_BYTES_PER_VOXEL) ** (1 / 3)))
    while side > 0 and VOLUME_BYTES_PER_VOXEL * side**3 > available:
        side -= 1
    while VOLUME_BYTES_PER_VOXEL * (side + 1) ** 3 <= available:
        side += 1
    return side


def check_volume_size(size: Any, *, bounded: bool = True) -> None:
    """The one rule of a Level 4 cube side: an integer from :data:`VOLUME_SIZE_MIN` to the largest
    one volume of which fits in the memory available now (:func:`volume_size_max`), refused in one
    line that names both bounds. ``bounded=False`` leaves the upper bound unchecked (a config read
    back, not a build about to start: memory is checked where a build starts)."""
    ok = isinstance(size, int) and not isinstance(size, bool) and size >= VOLUME_SIZE_MIN
    available = available_memory()
    largest = volume_size_max(available)
    if ok and not (bounded and largest is not None and size > largest):
        return
    if largest is None:
        raise ConfigError(f"volume_size (--volume-size) {size!r}: must be an integer >= {VOLUME_SIZE_MIN} "
                          "(this machine does not say how much memory is available)")
    raise ConfigError(
        f"volume_size (--volume-size) {size!r}: must be an integer from {VOLUME_SIZE_MIN} to {largest}, "
        f"the largest this machine allows: one volume of side S needs about {VOLUME_BYTES_PER_VOXEL} x S^3 "
        f"bytes, and {available / 2**30:.1f} GiB of memory is available")


def check_level4_fields(d: dict[str, Any]) -> None:
    """A Level 4 field (:data:`LEVEL4_FIELDS`, e.g. ``volume_size``) given while ``levels`` lacks
    ``level4`` would be ignored: refused in one line."""
    levels = tuple(d.get("levels") or SampleConfig.levels)
    given = [k for k in LEVEL4_FIELDS if k in d]
    if given and "level4" not in levels:
        spelled = ", ".join("volume_size (--volume-size)" if k == "volume_size" else k for k in given)
        raise ConfigError(
            f"{spelled}: applies to Level 4 only, and the levels are {','.join(levels)}; add level4 "
            f"(--levels {','.join(levels)},level4) or drop it")


@dataclass(frozen=True)
class SampleConfig:
    """How samples are drawn and labelled (defaults follow docs/PROTOCOL.md).

    Attributes:
        levels: which levels :func:`spar_bench.builder.samples.process_case` produces.
        samples_per_case: Level 1/2 mosaics per case.
        arrangement: Level 2 target arrangement, one of ``spar_bench.builder.schema.ARRANGEMENTS``.
        window_level, window_width: CT window (HU) mapped to uint8 0..255.
        fov_margin_mm: margin around the body's bounding box of the square field of view.
        tile_min_area_frac: a Level 1/2 tile's slice must show the organ with at least
            this fraction of the organ's largest slice area.
        l12_min_organs: a Level 1/2 sample needs at least this many present organs (tiles);
            a case with fewer gives no Level 1/2 samples (LiTS: liver only). Default 8:
            exact-permutation chance ``1/8!`` (2.5e-5) is negligible (docs/PROTOCOL.md 4).
        l3_stride: Level 3 considers slices ``z`` with ``z % l3_stride == 0``.
        l3_min_organs: a Level 3 slice needs this many organs of area >= ``l3_min_area_mm2``.
        l3_min_area_mm2: an organ takes part in Level 3 questions only at this area or more.
        l3_questions_per_probe: at most this many questions of each probe per slice.
        rel_margin_mm: relative-position pairs closer than this on the asked axis are
            skipped; orientation pairs whose centroids are closer than this are skipped.
        symmetry_band: ``|d| <= band`` is "similar", with ``d = (A - B) / mean(A, B)``.
        lesion_min_voxels: Level 4 counting: lesion components of fewer voxels of the stored
            volume are not counted; a counting-only Level 3 slice needs a native lesion
            component of at least this many voxels.
        lesion_min_pixels: Level 3 counting (protocol 1.4): 8-connected components of the
            slice's 224 x 224 lesion mask with fewer pixels are not counted.
        counterfactual: ``None``, ``"mirror"`` (append left-right mirrored copies) or
            ``"mirror+flip"`` (Levels 1-3 as ``"mirror"``; Level 4 also appends a
            superior-inferior flipped copy).
        volume_size: Level 4 cube side ``S`` in voxels: from 8 to the largest the memory
            allows (:func:`check_volume_size`, checked where a build starts).
        l4_questions_per_probe: at most this many questions of each probe per volume.
        l4_min_voxels: an organ takes part in Level 4 questions with this many voxels or more.
        adjacency_mm: Level 4 adjacency: "touching" at a surface gap of at most this (mm),
            "apart" beyond 3 x this.
    """

    levels: tuple[str, ...] = ("level1", "level2", "level3")
    samples_per_case: int = 32
    arrangement: str = "rows-by-y"
    window_level: float = 40.0
    window_width: float = 400.0
    fov_margin_mm: float = 10.0
    tile_min_area_frac: float = 0.25
    l12_min_organs: int = 8
    l3_stride: int = 2
    l3_min_organs: int = 2
    l3_min_area_mm2: float = 50.0
    l3_questions_per_probe: int = 4
    rel_margin_mm: float = 5.0
    symmetry_band: float = 0.15
    lesion_min_voxels: int = 3
    lesion_min_pixels: int = 3
    counterfactual: str | None = None
    volume_size: int = 128
    l4_questions_per_probe: int = 16
    l4_min_voxels: int = 8
    adjacency_mm: float = 3.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        bad = [lv for lv in self.levels if lv not in LEVELS]
        if bad or not self.levels:
            raise ConfigError(
                f"sample config: levels must be a non-empty subset of {LEVELS}, got {self.levels}"
            )
        if self.arrangement not in ARRANGEMENTS:
            raise ConfigError(
                f"sample config: arrangement {self.arrangement!r} unknown; choose one of {ARRANGEMENTS}"
            )
        if self.counterfactual not in COUNTERFACTUALS:
            raise ConfigError(
                f"sample config: counterfactual must be None, 'mirror' or 'mirror+flip', "
                f"got {self.counterfactual!r}"
            )
        positive_ints = (
            "samples_per_case",
            "l12_min_organs",
            "l3_stride",
            "l3_min_organs",
            "l3_questions_per_probe",
            "lesion_min_voxels",
            "lesion_min_pixels",
            "l4_questions_per_probe",
            "l4_min_voxels",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"sample config: {name} must be an integer >= 1, got {value!r}")
        check_volume_size(self.volume_size, bounded=False)
        if isinstance(self.adjacency_mm, bool) or not isinstance(self.adjacency_mm, (int, float)) \
                or not self.adjacency_mm > 0:
            raise ConfigError(f"sample config: adjacency_mm must be a number > 0, got {self.adjacency_mm!r}")
        if self.window_width <= 0:
            raise ConfigError(f"sample config: window_width must be > 0, got {self.window_width}")
        if self.l12_min_organs > N_ORGANS:
            raise ConfigError(
                f"sample config: l12_min_organs must be at most {N_ORGANS} (the canonical organs), "
                f"got {self.l12_min_organs}"
            )
        if not 0.0 <= self.tile_min_area_frac <= 1.0:
            raise ConfigError(
                f"sample config: tile_min_area_frac must be in [0, 1], got {self.tile_min_area_frac}"
            )
        for name in ("fov_margin_mm", "l3_min_area_mm2", "rel_margin_mm", "symmetry_band"):
            if getattr(self, name) < 0:
                raise ConfigError(f"sample config: {name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field (tuples become lists); without Level 4, its fields
        are left out (:meth:`from_dict` restores their defaults)."""
        d = asdict(self)
        d["levels"] = list(self.levels)
        if "level4" not in self.levels:
            for name in LEVEL4_FIELDS:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SampleConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise :class:`ConfigError` with suggestions, and so
        does a Level 4 field without ``level4`` in the levels (:func:`check_level4_fields`)."""
        known = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in known]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, known, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"sample config: unknown field(s) {', '.join(hints)}; known: {', '.join(known)}"
            )
        check_level4_fields(d)
        kwargs = dict(d)
        if "levels" in kwargs:
            kwargs["levels"] = tuple(kwargs["levels"])
        return cls(**kwargs)
