"""A multimodal LLM as a :class:`~spar_bench.probes.runs.predictors.Predictor`.

``fit`` trains nothing (the model is asked as it is); ``predict`` asks each item's question
with its slice, its options in the class order (rotation 0), through the response cache,
and returns the class chosen (-1: no answer, which every metric counts as a miss); its
blind baseline asks the same questions without the image. So an MLLM runs through the
one lifecycle of :func:`spar_bench.probes.runs.session.run_predictor` with every control.

``spar-probe vqa`` asks more of it (every cyclic option order for CircularEval, parse and
refusal rates, answers.jsonl) and scores size and distance against the thresholds its
prompts state; this predictor scores them, like a head's, against the stored answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Backend
from .cache import ResponseCache
from .prompts import rotations
from .questions import Questions, load_questions
from .run import AskConfig, Item, answer_records, ask, cache_key, image_digests, prompt_of


def _item_key(t, j: int) -> tuple:
    """Row, organs (C on Level 4), axis and copy flags of item ``j`` of ``t``."""
    flipped = getattr(t, "is_flipped", None)
    return (int(t.rows[j]), *(int(t.y[o][j]) for o in ("organ_a", "organ_b", "organ_c") if o in t.y),
            int(t.y["axis"][j]), bool(t.is_mirror[j]), bool(flipped[j]) if flipped is not None else False)


def question_index(qs: Questions, t) -> np.ndarray:
    """The question of ``qs`` behind each item of ``t`` (both from one split of one build):
    matched on the slice (volume) row, the organs, the axis and the mirror (flip) flags."""
    where: dict[tuple, int] = {}
    for i in range(len(qs)):
        where.setdefault(_item_key(qs.t, i), i)
    return np.array([where[_item_key(t, j)] for j in range(len(t))], dtype=np.int64)


@dataclass
class Mllm:
    """``backend`` asked about ``build``'s Level 3 questions (``cfg``: hint, image size, seed),
    its answers kept in ``cache``; ``with_image=False`` is its blind baseline."""

    backend: Backend
    build: Any
    cache: ResponseCache
    cfg: AskConfig = AskConfig()
    with_image: bool = True
    kind: str = "mllm"

    def fit(self, train, val) -> None:
        return None  # asked as it is: nothing is trained

    def predict(self, t, split: str = "test") -> np.ndarray:
        if len(t) == 0:
            return np.zeros((0,), np.int64)
        qs = load_questions(self.build, t.spec, [split])
        idx = question_index(qs, t)
        items = [self._item(qs, int(i)) for i in idx]
        digests = image_digests(self.build, qs, items)
        keys = [cache_key(self.backend, qs, it, self.cfg, digests.get(it.q)) for it in items]
        replies = ask(self.backend, self.cache, self.build, qs, items, keys, self.cfg)
        records = answer_records(qs, items, replies, self.backend, digests, self.cfg.volume_as)
        return np.array([r["class"] for r in records], dtype=np.int64)

    def _item(self, qs: Questions, i: int) -> Item:
        """Question ``i`` in the class order, with its slice (volume, ``cfg.volume_as``) or (blind) without."""
        prompt = prompt_of(qs, i, rotations(qs.spec.n_classes)[0], self.cfg, blind=not self.with_image)
        return Item(i, "image" if self.with_image else "blind", 0, prompt)

    def blind(self) -> Mllm:
        return Mllm(self.backend, self.build, self.cache, self.cfg, with_image=False)
