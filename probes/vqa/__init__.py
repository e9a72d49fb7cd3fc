"""The MLLM track: Level 3 (slice) and Level 4 (volume) questions asked to multimodal LLMs
(``spar-probe vqa``; a volume is shown as a video, a montage or three views: :mod:`.volume`).

Backends are named ``<kind>[:<rest>]`` and live in one lazy registry, so listing them
imports neither torch nor transformers:

* ``hf:PATH_OR_ID`` - a local transformers image-text model (processor + chat template);
  constrained answers by default (each option's log-likelihood), ``--generate`` to parse;
* ``openai:MODEL`` - an OpenAI-compatible chat server (``--base-url``): vLLM, SGLang,
  llama.cpp, Ollama;
* ``dummy`` / ``dummy:A`` - seeded or fixed answers, for tests and dry runs.
* ``oracle`` / ``oracle:pixels`` - answers recomputed from the build's masks and geometry
  (needs ``--data``): proves every question answerable from its image.
* ``answers:FILE`` (``--answers FILE``) - another harness's answers to ``spar-build export``
  (:mod:`.answers`; the export: :mod:`.export`).

Modules: :mod:`.prompts` (versioned templates), :mod:`.parse` (strict parser),
:mod:`.cache` (response cache), :mod:`.questions` (questions from a build),
:mod:`.run` (asking, scoring, run folders), :mod:`.cli` (the command).
"""

from __future__ import annotations

from spar_bench.errors import ConfigError
from spar_bench.registry import Registry, UnknownNameError

from .base import Backend, BackendOptions

BACKENDS: Registry = Registry("MLLM backend")
BACKENDS.register_lazy("dummy", "spar_bench.probes.vqa.dummy:load_dummy")
BACKENDS.register_lazy("oracle", "spar_bench.probes.vqa.oracle:load_oracle")
BACKENDS.register_lazy("hf", "spar_bench.probes.vqa.hf:load_hf", extra="transformers")
BACKENDS.register_lazy("openai", "spar_bench.probes.vqa.openai:load_openai")
BACKENDS.register_lazy("answers", "spar_bench.probes.vqa.answers:load_answers")


def load_backend(spec: str, options: BackendOptions) -> Backend:
    """The backend of ``spec`` (``hf:/models/x``, ``openai:qwen2-vl``, ``dummy``)."""
    kind, _, rest = spec.partition(":")
    try:
        factory = BACKENDS.get(kind)
    except UnknownNameError as e:
        raise ConfigError(f"--model {spec}: {e}") from None
    return factory(rest, options)


__all__ = ["BACKENDS", "Backend", "BackendOptions", "load_backend"]
