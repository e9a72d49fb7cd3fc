"""``dummy`` and ``dummy:<letter>``: answers without a model, for tests and prompt dry runs.

* ``dummy`` answers a seeded random option (the seed, the question key -- or, without
  the image, the prompt itself -- and the option order decide it, so reruns are identical);
* ``dummy:<letter>`` always answers that letter (``dummy:A``: the first displayed option,
  a position bias that CircularEval exposes). A question with fewer options has no such
  letter: the answer is the bare letter all the same, which names no option, so it is
  unparseable and counts wrong, as a real model's would (``dummy:C`` scores on the 3-option
  probes and answers nothing on the 2-option ones). Only letters some Level 3 question
  has are accepted (``A`` to the largest probe's last letter); ``dummy:Z`` is refused.

In ``--generate`` mode the answer is a sentence ("The correct answer is (B).") that goes
through the strict parser, like a real model's.
"""

from __future__ import annotations

import string

import numpy as np

from spar_bench.builder.schema import LEVEL3_CLASS_NAMES
from spar_bench.errors import ConfigError
from spar_bench.seeding import derive_seed

from .base import Backend, BackendOptions, Reply, Request


def letters_asked() -> str:
    """``A`` to the last option letter of the Level 3 probe with the most options."""

    return string.ascii_uppercase[:max(len(v) for v in LEVEL3_CLASS_NAMES.values())]


class DummyBackend(Backend):
    def __init__(self, rest: str = "", *, mode: str = "constrained", seed: int = 0):
        known = letters_asked()
        if rest and (len(rest) != 1 or rest.upper() not in known):
            raise ConfigError(f"model dummy:{rest}: expected dummy or dummy:<letter> with a letter of "
                              f"{known[0]}..{known[-1]} (no Level 3 question has more options), e.g. dummy:A")
        self.fixed = rest.upper() or None
        self.seed = int(seed)
        self.mode = mode
        self.name = "dummy" + (f"-{self.fixed}" if self.fixed else "")
        self.identity = {"kind": "dummy", "fixed": self.fixed, "seed": None if self.fixed else self.seed}
        self.decoding = {"mode": mode}
        self.batch_size = 256
        self.random_init = True

    def _pick(self, r: Request) -> int | None:
        """The displayed position answered; None for a fixed letter the question lacks."""
        if self.fixed:
            return r.letters.index(self.fixed) if self.fixed in r.letters else None
        # blind: the prompt decides (byte-identical blind prompts get one answer, as at temperature 0)
        s = derive_seed(self.seed, "dummy", r.text if r.blind else r.key, r.blind, *r.options)
        return int(np.random.default_rng(s).integers(len(r.options)))

    def answer(self, requests: list[Request]) -> list[Reply]:
        out = []
        for r in requests:
            p = self._pick(r)
            letter = r.letters[p] if p is not None else self.fixed
            if self.mode == "generate":
                out.append(Reply(text=f"The correct answer is ({letter})."))
            else:  # no such option: the bare letter, which the parser reads as no option
                out.append(Reply(text="" if p is not None else str(letter), choice=p))
        return out


def load_dummy(rest: str, options: BackendOptions) -> DummyBackend:
    return DummyBackend(rest, mode=options.mode, seed=options.seed)
