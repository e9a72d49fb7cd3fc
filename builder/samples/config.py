"""The recorded parameters of sample generation (Levels 1-4).

Every field of :class:`SampleConfig` is written into the build manifest through
:meth:`SampleConfig.to_dict`; :meth:`SampleConfig.from_dict` rebuilds the exact config
from it, so a build can be regenerated bit for bit from its manifest. The Level 4 fields
(:data:`LEVEL4_FIELDS`) are recorded only when ``"level4"`` is among the levels, so the
manifests of builds without Level 4 are unchanged.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields
from typing import Any

from spar_bench.errors import ConfigError

from ..schema import ARRANGEMENTS, LEVELS, N_ORGANS

COUNTERFACTUALS = (None, "mirror", "mirror+flip")
#: Fields read only by Level 4 (left out of :meth:`SampleConfig.to_dict` without it).
LEVEL4_FIELDS = ("volume_size", "l4_questions_per_probe", "l4_min_voxels", "adjacency_mm")


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
        lesion_min_voxels: lesion components smaller than this are not counted.
        counterfactual: ``None``, ``"mirror"`` (append left-right mirrored copies) or
            ``"mirror+flip"`` (Levels 1-3 as ``"mirror"``; Level 4 also appends a
            superior-inferior flipped copy).
        volume_size: Level 4 cube side ``S`` in voxels (>= 8).
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
            "volume_size",
            "l4_questions_per_probe",
            "l4_min_voxels",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"sample config: {name} must be an integer >= 1, got {value!r}")
        if self.volume_size < 8:
            raise ConfigError(f"sample config: volume_size must be an integer >= 8, got {self.volume_size}")
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
        """Inverse of :meth:`to_dict`; unknown keys raise :class:`ConfigError` with suggestions."""
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
        kwargs = dict(d)
        if "levels" in kwargs:
            kwargs["levels"] = tuple(kwargs["levels"])
        return cls(**kwargs)
