"""The procedural phantom (``spar-build phantom``) read as a source.

A phantom dataset is a WORD-layout folder with labels per
``manifests/labels/phantom.json`` (WORD ids 1..16, 17 = liver lesion) and a
``phantom.json`` record; this adapter is :class:`~spar_bench.builder.sources.word.WordSource` with
that label map, plus the layout (canonical, mirrored, random) in every case's provenance.

The builder opens a source per case (a worker gets only picklable arguments), so the parsed
``phantom.json`` (every case's parameters: 24 MB for 1,000 cases on a 96 x 16 grid) is kept per process, keyed by
its path, size and modification time; parsing it once per case made a build quadratic in the
number of cases (1,000 cases: 1.5 cases/s, against ~16 with the record kept).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from spar_bench.errors import ConfigError

from ..case import Case, CaseRef
from .word import WordSource


class PhantomSource(WordSource):
    """Phantom cases written by :func:`spar_bench.builder.phantom.generate.write_phantom_dataset`."""

    name = "phantom"
    needs = (
        "ROOT/phantom.json and ROOT/imagesTr|imagesVal|imagesTs + labelsTr|labelsVal|labelsTs/"
        "phantom_NNNN.nii.gz, as written by `spar-build phantom --out ROOT`"
    )
    has_lesions = True
    labels_manifest: ClassVar[str] = "phantom"
    split_rule: ClassVar[str] = "phantom folders (generator's 100/20/30-proportioned split)"

    def record(self) -> dict[str, Any]:
        """The dataset's ``phantom.json`` (cached); ConfigError when missing or invalid."""
        if not hasattr(self, "_record"):
            path = self.root / "phantom.json"
            if not path.is_file():
                raise ConfigError(
                    f"{path} is missing: {self.root} is not a phantom dataset; expected {self.needs}"
                )
            st = path.stat()
            self._record = _parsed_record(path.resolve(), st.st_size, st.st_mtime_ns)
        return self._record

    def find(self) -> list[CaseRef]:
        self.record()
        return super().find()

    def load(self, ref: CaseRef) -> Case:
        case = super().load(ref)
        rec = self.record()
        case.provenance["phantom"] = {
            "layout": rec.get("layout"),
            "generator_version": rec.get("generator_version"),
            "seed": rec.get("seed"),
            "case_seed": rec.get("cases", {}).get(ref.case_id, {}).get("seed"),
        }
        case.provenance["layout"] = rec.get("layout")
        return case


@lru_cache(maxsize=4)
def _parsed_record(path: Path, size: int, mtime_ns: int) -> dict[str, Any]:
    """``phantom.json`` parsed once per process and version of the file (read it, never change it)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e}); regenerate with spar-build phantom") from None
