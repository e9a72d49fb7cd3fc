"""The rows of a question cache: one feature row per question of ONE probe.

An encoder that reads the question with the image (``mllm:DIR@llm:N+q``: the LM's hidden states
at the image tokens with the probe's question in the prompt) gives one feature set per
(slice, question), not per slice. Its cache (``spar-probe cache --probe PROBE``) is made for one
Level 3 probe: each split holds one row per question of that probe (mirrored ones included), in
the order :func:`spar_bench.probes.vqa.questions.load_questions` gives them, keyed by the
question key (``q_key``); slices with no question of the probe, splits with none, other probes
and other levels are not cached (questions the build dropped as unanswerable are not in the build at all).

Each row's text is the user message ``spar-probe vqa`` sends with the image for that question:
its plain prompt (options in class order, no rotation, not blind, the convention hint, the 224
image; :func:`spar_bench.probes.vqa.ask.plain_prompt`). The probe, the template version and the
sha256 of every (key, text) pair are recorded in the encoder's spec (:meth:`QuestionRows.record`),
so they are part of the cache's ``encoder_config`` and ``cache_args``: a cache made for one probe
never resumes as another's, and ``spar-probe fit`` refuses it for any other probe
(:meth:`~.features.FeatureCache.check_probe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_json

from .tasks import QuestionSpec, get_probe
from .vqa.ask import plain_prompt
from .vqa.prompts import template_version
from .vqa.questions import is_volume_probe, load_questions


@dataclass(frozen=True)
class QuestionRows:
    """Per split of the probe's level: the question keys, their slices' rows in the split and
    the user messages (``texts``), row ``i`` of the cache being question ``i``."""

    probe: str
    level: str
    template: str
    keys: dict[str, np.ndarray]
    slices: dict[str, np.ndarray]
    texts: dict[str, tuple[str, ...]]

    def count(self, split: str) -> int:
        return int(len(self.keys[split]))

    @property
    def sha256(self) -> str:
        """sha256 of every split's (key, text) pairs, in order."""

        return sha256_json({s: [[str(k), t] for k, t in zip(self.keys[s], self.texts[s], strict=True)]
                            for s in sorted(self.keys)})

    def record(self) -> dict[str, Any]:
        """What the encoder's spec records (``extra``; docs/FORMATS.md)."""
        return {"question_probe": self.probe, "question_template": self.template, "questions_sha256": self.sha256,
                "question_rows": {s: self.count(s) for s in sorted(self.keys)}}


def question_probe(probe: str):
    """The spec of ``--probe``: a Level 3 question probe, else one line."""

    spec = get_probe(probe)
    if not isinstance(spec, QuestionSpec) or is_volume_probe(spec):
        raise ConfigError(f"--probe {spec.name}: a question stage (llm:N+q) reads Level 3 questions about "
                          "one slice; name a level3 probe")
    return spec


def question_rows(build, probe: str, splits: list[str]) -> QuestionRows:
    """The questions of ``probe`` (a full name, Level 3) on ``splits`` of ``build``, each with
    the plain prompt ``spar-probe vqa`` asks it with; a split without any is left out."""

    spec = question_probe(probe)
    keys, slices, texts = {}, {}, {}
    for split in splits:
        qs = load_questions(build, spec, [split])
        if not len(qs):  # a split without such questions is not cached (fit then holds out train patients)
            continue
        keys[split] = np.asarray(qs.key, dtype=str)
        slices[split] = np.asarray(qs.row, dtype=np.int64)
        texts[split] = tuple(plain_prompt(qs, i).text for i in range(len(qs)))
    if not keys:
        raise ConfigError(f"{build.root}: no {spec.name} questions on {', '.join(splits)}; nothing to cache")
    return QuestionRows(spec.name, spec.level, template_version(qs.probe), keys, slices, texts)

