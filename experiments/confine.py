"""Every path a plan's steps write lies inside the experiment's ``out`` (the second defence,
after the names checked where they are declared: :func:`spar_bench.names.check_name`).

A step's outputs, and every ``{out}/...`` path of its specs, are resolved (symlinks followed)
and must lie under ``out`` resolved, as must ``out/.plan`` (markers, the log, the lock files):
a name that climbs out, or a symlinked folder inside ``out`` that points elsewhere, is one line
before any step runs or any output is removed (:func:`spar_bench.names.confined`); before a
step runs, so is a symbolic link already inside its folders (``runs/frozen-e/x -> /elsewhere``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from spar_bench.names import confined

from .plan import PLAN, Step


def _inside_paths(value: Any) -> Iterator[str]:
    """Every ``{out}/...`` string of a spec record."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _inside_paths(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _inside_paths(v)
    elif isinstance(value, str) and value.startswith("{out}"):
        yield value


def step_paths(step: Step) -> list[str]:
    """What ``step`` writes or reads inside ``out`` (``{out}`` unreplaced)."""
    return list(dict.fromkeys([*step.outputs, *(p for _, record in step.specs for p in _inside_paths(record))]))


def check_confined(out: Path, steps: Iterable[Step], deep: bool = False) -> None:
    """``out/.plan`` and every path of ``steps`` inside ``out`` once resolved, else one line;
    ``deep`` (a step about to run): also every symbolic link already inside its folders."""
    confined(out / PLAN, out, "the plan folder")
    for s in steps:
        for rel in step_paths(s):
            path = confined(Path(rel.replace("{out}", str(out), 1)), out, f"step {s.id} writes")
            if deep and path.is_dir():
                for link in _links(path):
                    confined(link, out, f"step {s.id} writes")


def _links(folder: Path) -> Iterator[Path]:
    """The symbolic links under ``folder`` (not followed)."""
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            if os.path.islink(os.path.join(root, name)):
                yield Path(root) / name
