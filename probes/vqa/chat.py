"""One tokenization rule for every MLLM path: ``spar-probe vqa --model hf:``, the stage encoders
(``mllm:DIR@STAGE``) and, through lmms-eval, the ``lmms-eval`` export.

The model's chat template is applied once, to text (``tokenize=False``), and the text is
tokenized with the BOS token exactly once:

* a template that writes no BOS (LLaVA-1.5's, Qwen's): the tokenizer adds its own, if it adds
  one (``add_special_tokens=True``). That is lmms-eval 0.7.3's own call: its ``llava_hf`` chat
  model (``lmms_eval/models/chat/llava_hf.py``, ``generate_until``) renders
  ``processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` and
  calls ``processor(images=..., text=text, return_tensors="pt")`` with the tokenizer's default,
  so the exported tasks and ``vqa`` see the same ids;
* a template that writes ``{{ bos_token }}`` itself (Gemma 3 / MedGemma): the text already
  starts with it, so nothing is added (``add_special_tokens=False``); lmms-eval's call would
  add a second one there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spar_bench.errors import ConfigError


def render(processor: Any, content: list[dict[str, Any]]) -> str:
    """The user's turn ``content`` through the processor's chat template, with the generation
    prompt, as text."""
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def tokenizer_of(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def add_special_tokens(processor: Any, texts: Sequence[str]) -> bool:
    """``add_special_tokens`` for chat-templated ``texts``: False when the template wrote the
    BOS token (every text starts with it), True otherwise (the tokenizer adds its own, if any)."""
    bos = getattr(tokenizer_of(processor), "bos_token", None)
    starts = [bool(bos) and t.startswith(bos) for t in texts]
    if any(starts) and not all(starts):
        raise ConfigError("chat prompts of one batch disagree on the BOS token: some start with it, some not")
    return not (starts and all(starts))
