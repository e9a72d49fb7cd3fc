"""What a level's rows need after the sampler: the level hooks the build calls.

The sampler (:func:`~spar_bench.builder.samples.process_case`) leaves some answers open:
Level 3's size and distance answers are ``-1`` until thresholds fixed on the training
split finish them (:mod:`.thresholds`). The build asks a level's hooks
(:func:`level_hooks`, keyed by :class:`~spar_bench.builder.schema.LevelSpec` name) whether
its questions need thresholds, to fit them, and to finish the answers, so it names no probe.

:mod:`~spar_bench.builder.schema` declares levels and is read by every part of the
toolkit; these hooks use the sampler's code, so they live here, beside it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..schema import LEVEL3_PROBES
from .thresholds import apply_thresholds, fit_thresholds, original_questions

Table = dict[str, np.ndarray]


class LevelHooks:
    """A level whose rows are complete as sampled: it needs no thresholds."""

    #: Whether the level's questions may need thresholds fitted on a split.
    fits_thresholds: bool = False
    #: The questions that need thresholds, as the manifest's ``thresholds.origin`` names them.
    threshold_questions: str = ""

    def needs_thresholds(self, questions: Table) -> bool:
        """Whether one case's questions table holds a question left open for the thresholds."""
        return False

    def fit_input(self, rows: Table, questions: Table) -> Table:
        """What one case of the fitting split gives :meth:`fit`: its original questions."""
        return questions

    def fit(self, tables: list[Table]) -> dict[str, Any] | None:
        """The thresholds fitted on :meth:`fit_input`'s tables (JSON-serialisable), or None."""
        return None

    def finalise(self, questions: Table, thresholds: dict[str, Any] | None) -> Table:
        """One case's questions with every answer the thresholds decide filled in."""
        return questions


class TertileHooks(LevelHooks):
    """Level 3: size and distance answers are tertiles fitted on the original training questions."""

    fits_thresholds = True
    threshold_questions = "size or distance questions"
    #: The probes whose answers the thresholds decide (``q_probe`` values).
    FITTED = (LEVEL3_PROBES.index("size"), LEVEL3_PROBES.index("distance"))

    def needs_thresholds(self, questions: Table) -> bool:
        return bool(np.isin(questions.get("q_probe", np.empty(0)), self.FITTED).any())

    def fit_input(self, rows: Table, questions: Table) -> Table:
        return original_questions(rows, questions)

    def fit(self, tables: list[Table]) -> dict[str, Any]:
        return fit_thresholds(tables)

    def finalise(self, questions: Table, thresholds: dict[str, Any] | None) -> Table:
        if thresholds is None or not questions or not len(next(iter(questions.values()))):
            return questions
        return apply_thresholds(questions, thresholds)


#: The levels with hooks; every other level is complete as sampled (:class:`LevelHooks`).
#: At most one level fits thresholds: the manifest records one ``thresholds`` entry.
LEVEL_HOOKS: dict[str, LevelHooks] = {"level3": TertileHooks()}


def level_hooks(level: str) -> LevelHooks:
    """The hooks of ``level`` (a :data:`~spar_bench.builder.schema.LEVELS` name)."""
    return LEVEL_HOOKS.get(level, LevelHooks())
