"""``oracle`` and ``oracle:pixels``: answers from the build's masks and geometry, never from
its stored answers (protocol 1.2: every MLLM question is answerable from its image).

The oracle reads the question from the build (organs, axis) and the thresholds and band
from the PROMPT's text, then recomputes the answer:

* ``oracle`` reads the geometry stored with each question, measured at the scan's own
  resolution: the organ centres (``q_centroid_a``/``_b``, pixels of the 224 frame), areas
  (``q_area_a_mm2``/``_b``), lesion count (``q_count``) and the slice's ``mm_per_pixel``;
  it checks in the slice's label mask that every organ it is asked about is visible, and
  abstains (no answer: a miss) when one is not. It must score 100 % on every probe,
  original and mirrored; anything less is a labelling or prompt bug.
* ``oracle:pixels`` measures everything on the 224 x 224 masks themselves (centroids and
  areas of the label map, 8-connected lesion components of at least the stated number of
  pixels), as a perfect reader of the image as shown would: the ceiling of a model that
  sees only those pixels. It is the build's own pixel reader
  (:func:`spar_bench.builder.samples.pixels.pixel_class`), which since protocol 1.4 drops
  every question whose pixel answer is not its label, so it scores 100 % on every probe of
  such a build (on older builds it falls short where a measurement lies within the frame's
  resampling error of a decision boundary).

Level 4 (volumes): both variants read the question's STORED label and lesion volumes
(whatever ``--volume-as`` shows) and recompute the answer with the mask oracle's rules
(:func:`spar_bench.probes.runs.mask_oracle.answer`, the sampler's own measurements), taking
the symmetry band, adjacency threshold and smallest counted lesion from the prompt's text;
it scores 100 % on originals, mirrored and flipped copies.

Without an image (the blind control) the oracle abstains. Answers are deterministic; the
identity holds :data:`ORACLE_VERSION` so a changed oracle never reuses cached answers.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.builder.samples.pixels import Geometry, decide, pixel_class
from spar_bench.builder.schema import (
    LEVEL3_CLASS_NAMES,
    LEVEL3_PROBES,
    LEVEL4_CLASS_NAMES,
    LEVEL4_PROBES,
    LEVEL_SPECS,
)
from spar_bench.builder.shards import Build
from spar_bench.errors import ConfigError

from ..runs.mask_oracle import RULES, Volume
from .base import Backend, BackendOptions, Reply, Request
from .prompts import option_text, volume_option_texts

#: the level whose rows carry the slice questions (Level 3), looked up in the schema
_QLEVEL = next(spec.name for spec in LEVEL_SPECS.values() if spec.questions and not spec.volume)
#: the levels whose questions are about volumes (Level 4)
_VLEVELS = tuple(spec.name for spec in LEVEL_SPECS.values() if spec.questions and spec.volume)

ORACLE_VERSION = "2"
VARIANTS = ("geometry", "pixels")
Q_FIELDS = ("q_key", "q_slice", "q_probe", "q_axis", "q_organ_a", "q_organ_b", "q_centroid_a",
            "q_centroid_b", "q_area_a_mm2", "q_area_b_mm2", "q_count")
#: Level 4: the question's volume and organs; everything else is measured on the stored volume
Q4_FIELDS = ("q_key", "q_volume", "q_probe", "q_axis", "q_organ_a", "q_organ_b", "q_organ_c")

_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
#: Where each prompt states what the oracle needs: probe -> patterns of its numbers.
STATED = {
    "size": (rf"small: below {_NUMBER} mm\^2", rf"large: {_NUMBER} mm\^2 or more"),
    "distance": (rf"near: below {_NUMBER} mm", rf"far: {_NUMBER} mm or more"),
    "symmetry": (rf"at most {_NUMBER}% of their mean",),
    "counting": (rf"fewer than {_NUMBER} pixels of the image at 224 x 224",),
}
#: Level 4: the mask oracle's rule parameters a volume prompt states (symmetry: a percentage).
STATED_VOLUME = {
    "symmetry": ("symmetry_band", rf"at most {_NUMBER}% of their mean volume"),
    "adjacency": ("adjacency_mm", rf"the gap between them is at most {_NUMBER} mm"),
    "counting": ("lesion_min_voxels", rf"fewer than {_NUMBER} voxels of this volume"),
}


def volume_rules(probe: str, text: str, build_rules: dict[str, float]) -> dict[str, float]:
    """The Level 4 rule parameters for one prompt: the build's, with the one the prompt
    states (read from its text, as a reader of the prompt would) in its place."""
    rules = dict(build_rules)
    if probe in STATED_VOLUME:
        name, pattern = STATED_VOLUME[probe]
        m = re.search(pattern, text)
        if m is None:
            raise ConfigError(f"oracle: the level4 {probe} prompt does not state {pattern!r}: {text!r}")
        value = float(m.group(1))
        rules[name] = value / 100.0 if probe == "symmetry" else value
    return rules


def stated_numbers(probe: str, text: str) -> tuple[float, ...]:
    """The numbers the prompt of ``probe`` states (thresholds; the symmetry band in %)."""
    out = []
    for pattern in STATED.get(probe, ()):
        m = re.search(pattern, text)
        if m is None:
            raise ConfigError(f"oracle: the {probe} prompt does not state {pattern!r}: {text!r}")
        out.append(float(m.group(1)))
    return tuple(out)


class OracleBackend(Backend):
    """Reads the build given with ``--data`` (see the module doc)."""

    def __init__(self, variant: str, data: str | Path | None, mode: str = "constrained"):
        if variant not in VARIANTS:
            raise ConfigError(f"model oracle:{variant}: expected oracle or oracle:pixels")
        if data is None:
            raise ConfigError("model oracle: needs the build it answers from (--data)")
        self.variant, self.mode, self.build = variant, mode, Build(data)
        self.name = "oracle" if variant == "geometry" else f"oracle-{variant}"
        self.identity = {"kind": "oracle", "variant": variant, "version": ORACLE_VERSION,
                         "build": self.build.fingerprint}
        self.decoding = {"mode": mode}
        self.batch_size = 4096
        self.random_init = False
        self._index: dict[str, tuple[str, str, int]] | None = None
        self._q: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        self._slices: dict[tuple[str, int], tuple[np.ndarray, np.ndarray, float]] = {}
        self._volumes: dict[tuple[str, str, int], Any] = {}

    def _locate(self, key: str) -> tuple[str, str, int]:
        """(level, split, question index in that split) of a question key (Level 3 or 4)."""
        if self._index is None:
            self._index = {}
            for level in (lv for lv in (_QLEVEL, *_VLEVELS) if lv in self.build.levels()):
                fields = Q4_FIELDS if level in _VLEVELS else Q_FIELDS
                for split in self.build.splits(level):
                    self._q[(level, split)] = self.build.read(level, split, list(fields))
                    for j, k in enumerate(self._q[(level, split)]["q_key"].astype(str)):
                        self._index[k] = (level, split, j)
        if key not in self._index:
            raise ConfigError(f"oracle: question {key} is not in {self.build.root}; pass its build as --data")
        return self._index[key]

    def _slice(self, split: str, row: int) -> tuple[np.ndarray, np.ndarray, float]:
        if (split, row) not in self._slices:
            rows = np.array([row], dtype=np.int64)
            label = self.build.images(_QLEVEL, split, rows, field="label")[0]
            lesion = self.build.images(_QLEVEL, split, rows, field="lesion")[0]
            mpp = float(self.build.read(_QLEVEL, split, ["mm_per_pixel"])["mm_per_pixel"][row])
            self._slices[(split, row)] = (label, lesion, mpp)
        return self._slices[(split, row)]

    def _class(self, r: Request, split: str, q: dict) -> tuple[str, int | None]:
        """(probe, recomputed class, or None when an organ asked about is not visible)."""
        probe, axis = LEVEL3_PROBES[int(q["q_probe"])], int(q["q_axis"])
        a, b = int(q["q_organ_a"]), int(q["q_organ_b"])
        label, lesion, mpp = self._slice(split, int(q["q_slice"]))
        numbers = stated_numbers(probe, r.text)
        if self.variant == "pixels":  # the build's own pixel reader, with the prompt's numbers
            min_pixels = int(numbers[0]) if probe == "counting" else 1
            return probe, pixel_class(probe, axis, label, lesion, (a, b), mpp, numbers, min_pixels)
        if any(o >= 0 and not (label == o + 1).any() for o in (a, b)):
            return probe, None  # an organ the image does not show: no reader could answer
        g = Geometry(tuple(map(float, q["q_centroid_a"])), tuple(map(float, q["q_centroid_b"])),
                     float(q["q_area_a_mm2"]), float(q["q_area_b_mm2"]), int(q["q_count"]), mpp)
        return probe, decide(probe, axis, g, numbers)

    def _volume(self, level: str, split: str, row: int):
        """The stored label and lesion volumes of a Level 4 row (the few last read are kept)."""

        key = (level, split, row)
        if key not in self._volumes:
            if len(self._volumes) >= 8:
                self._volumes.pop(next(iter(self._volumes)))
            rows = np.array([row], dtype=np.int64)
            read = lambda f: self.build.images(level, split, rows, field=f)[0]  # noqa: E731
            mpv = float(self.build.read(level, split, ["mm_per_voxel"])["mm_per_voxel"][row])
            sample = self.build.manifest.get("sample_config") or {}
            self._volumes[key] = Volume(read("label"), read("lesion"), mpv,
                                        {k: sample.get(k, d) for k, d in RULES.items()})
        return self._volumes[key]

    def _volume_option(self, r: Request, level: str, split: str, q: dict) -> str | None:
        """The option text of a Level 4 question's answer, recomputed on the stored label and
        lesion volumes (whatever ``--volume-as`` shows) with the thresholds the prompt states."""
        from ..runs.mask_oracle import answer

        probe = LEVEL4_PROBES[int(q["q_probe"])]
        a, b, c = (int(q[f"q_organ_{x}"]) for x in "abc")
        v = self._volume(level, split, int(q["q_volume"]))
        if any(o >= 0 and not v.organs.counts[o] > 0 for o in (a, b, c)):
            return None  # an organ the volume does not hold: no reader could answer
        rules = volume_rules(probe, r.text, v.rules)
        if rules != v.rules:  # a prompt stating another threshold: measured afresh
            v = replace(v, rules=rules)
        cls = answer(probe, v, a, b, c, int(q["q_axis"]))
        return volume_option_texts(probe, LEVEL4_CLASS_NAMES[probe], b, c)[cls]

    def _position(self, r: Request) -> int | None:
        """The displayed position of the recomputed answer, or None (abstain)."""
        if r.blind:
            return None
        level, split, j = self._locate(r.key)
        q = {f: v[j] for f, v in self._q[(level, split)].items()}
        if level in _VLEVELS:
            text = self._volume_option(r, level, split, q)
        else:
            probe, cls = self._class(r, split, q)
            text = None if cls is None else option_text(LEVEL3_CLASS_NAMES[probe][cls])
        return r.options.index(text) if text in r.options else None

    def answer(self, requests: list[Request]) -> list[Reply]:
        out = []
        for r in requests:
            p = self._position(r)
            if self.mode == "generate":
                out.append(Reply(text="" if p is None else f"The correct answer is ({r.letters[p]})."))
            else:
                out.append(Reply(choice=p, text="" if p is not None else "(no answer)"))
        return out

    def close(self) -> None:
        self.build.close()


def load_oracle(rest: str, options: BackendOptions) -> OracleBackend:
    return OracleBackend(rest or "geometry", options.data, options.mode)
