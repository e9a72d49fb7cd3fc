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
from .prompts import render, rotations
from .questions import Questions, load_questions
from .run import AskConfig, Item, answer_records, ask, cache_key, image_digests


def question_index(qs: Questions, t) -> np.ndarray:
    """The question of ``qs`` behind each item of ``t`` (both from one split of one build):
    matched on the slice row, the organs, the axis and the mirror flag."""
    where: dict[tuple, int] = {}
    y = qs.t.y
    for i in range(len(qs)):
        where.setdefault((int(qs.t.rows[i]), int(y["organ_a"][i]), int(y["organ_b"][i]), int(y["axis"][i]),
                          bool(qs.t.is_mirror[i])), i)  # fmt: skip
    return np.array([where[(int(t.rows[j]), int(t.y["organ_a"][j]), int(t.y["organ_b"][j]), int(t.y["axis"][j]),
                            bool(t.is_mirror[j]))] for j in range(len(t))], dtype=np.int64)  # fmt: skip


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
        records = answer_records(qs, items, replies, self.backend, digests)
        return np.array([r["class"] for r in records], dtype=np.int64)

    def _item(self, qs: Questions, i: int) -> Item:
        """Question ``i`` in the class order, with its slice or (blind) without."""
        order = rotations(qs.spec.n_classes)[0]
        args = (qs.probe, int(qs.t.y["organ_a"][i]), int(qs.t.y["organ_b"][i]), int(qs.t.y["axis"][i]))
        prompt = render(*args, order, self.cfg.hint, blind=not self.with_image,
                        context=qs.context(i, self.cfg.image_size))  # fmt: skip
        return Item(i, "image" if self.with_image else "blind", 0, prompt)

    def blind(self) -> Mllm:
        return Mllm(self.backend, self.build, self.cache, self.cfg, with_image=False)
