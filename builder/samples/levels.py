"""What a level's rows need after the sampler: the level hooks the build calls.

The sampler (:func:`~spar_bench.builder.samples.process_case`) leaves some answers open:
Level 3's size and distance answers are ``-1`` until thresholds fixed on the training
split finish them (:mod:`.thresholds`); each Level 3 question is then answered again from
its slice's stored 224 masks (:mod:`.pixels`) and kept only where that answer is its label. The build asks a level's hooks
(:func:`level_hooks`, keyed by :class:`~spar_bench.builder.schema.LevelSpec` name) whether
its questions need thresholds, to fit them, and to finish the answers, so it names no probe.

:mod:`~spar_bench.builder.schema` declares levels and is read by every part of the
toolkit; these hooks use the sampler's code, so they live here, beside it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..schema import LEVEL3_PROBES
from .config import SampleConfig
from .pixels import answerable, pixel_answers
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

    def finalise(self, rows: Table, questions: Table, thresholds: dict[str, Any] | None,
                 config: SampleConfig) -> Table:
        """One case's questions (``rows``: its level's rows) with every answer the thresholds
        decide filled in, and whatever the level records of each answer."""
        return questions

    def answerable(self, questions: Table, thresholds: dict[str, Any] | None) -> np.ndarray:
        """Which of :meth:`finalise`'s questions the build keeps (all, unless a level screens)."""
        return np.ones(len(questions.get("q_key", ())), dtype=bool)


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

    def finalise(self, rows: Table, questions: Table, thresholds: dict[str, Any] | None,
                 config: SampleConfig) -> Table:
        """Thresholds applied, then ``q_pixel_answer``: each question answered again from its
        slice's stored 224 masks (:mod:`.pixels`, protocol 1.4)."""
        if not questions or not len(next(iter(questions.values()))):
            return questions
        if thresholds is not None:
            questions = apply_thresholds(questions, thresholds)
        return {**questions, "q_pixel_answer": pixel_answers(rows, questions, thresholds, config.symmetry_band,
                                                              config.lesion_min_pixels)}

    def answerable(self, questions: Table, thresholds: dict[str, Any] | None) -> np.ndarray:
        """The questions whose pixel answer is their label (:func:`.pixels.answerable`)."""
        if not questions or not len(questions.get("q_key", ())):
            return np.zeros(0, dtype=bool)
        return answerable(questions, thresholds)


#: The levels with hooks; every other level is complete as sampled (:class:`LevelHooks`).
#: At most one level fits thresholds: the manifest records one ``thresholds`` entry.
LEVEL_HOOKS: dict[str, LevelHooks] = {"level3": TertileHooks()}


def level_hooks(level: str) -> LevelHooks:
    """The hooks of ``level`` (a :data:`~spar_bench.builder.schema.LEVELS` name)."""
    return LEVEL_HOOKS.get(level, LevelHooks())
