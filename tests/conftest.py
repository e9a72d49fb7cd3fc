"""Shared fixtures. Real data is read from ../shared/data (never copied into the repo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SPAR_SHARED_DATA", REPO.parent / "shared" / "data"))


def _shared(sub: str) -> Path:
    path = SHARED_DATA / sub
    if not path.exists():
        pytest.skip(f"real data not available: {path} is missing (set SPAR_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def word_labels_dir() -> Path:
    """The 20 real WORD label maps (masks only, L,P,S): ``word-labels/`` with labelsTs/."""
    return _shared("word-labels")


@pytest.fixture(scope="session")
def totalseg_dir() -> Path:
    """One real CT with TotalSegmentator masks (R,A,S): ``totalsegmentator-sample/``."""
    return _shared("totalsegmentator-sample")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: no GPU tests
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
