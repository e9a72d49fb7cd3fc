"""``dummy`` and ``dummy:<letter>``: answers without a model, for tests and prompt dry runs.

* ``dummy`` answers a seeded random option (the seed, the question key, the image flag
  and the option order decide it, so reruns are identical);
* ``dummy:A`` always answers the first displayed option (a position bias that
  CircularEval exposes).

In ``--generate`` mode the answer is a sentence ("The correct answer is (B).") that goes
through the strict parser, like a real model's.
"""

from __future__ import annotations

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.seeding import derive_seed

from .base import Backend, BackendOptions, Reply, Request


class DummyBackend(Backend):
    def __init__(self, rest: str = "", *, mode: str = "constrained", seed: int = 0):
        if rest and (len(rest) != 1 or not rest.isalpha()):
            raise ConfigError(f"model dummy:{rest}: expected dummy or dummy:<letter>, e.g. dummy:A")
        self.fixed = rest.upper() or None
        self.seed = int(seed)
        self.mode = mode
        self.name = "dummy" + (f"-{self.fixed}" if self.fixed else "")
        self.identity = {"kind": "dummy", "fixed": self.fixed, "seed": None if self.fixed else self.seed}
        self.decoding = {"mode": mode}
        self.batch_size = 256
        self.random_init = True

    def _pick(self, r: Request) -> int:
        if self.fixed:
            return r.letters.index(self.fixed) if self.fixed in r.letters else 0
        s = derive_seed(self.seed, "dummy", r.key, r.image is None, *r.options)
        return int(np.random.default_rng(s).integers(len(r.options)))

    def answer(self, requests: list[Request]) -> list[Reply]:
        out = []
        for r in requests:
            p = self._pick(r)
            if self.mode == "generate":
                out.append(Reply(text=f"The correct answer is ({r.letters[p]})."))
            else:
                out.append(Reply(choice=p))
        return out


def load_dummy(rest: str, options: BackendOptions) -> DummyBackend:
    return DummyBackend(rest, mode=options.mode, seed=options.seed)
