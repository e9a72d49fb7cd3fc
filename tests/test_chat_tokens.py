"""One tokenization rule (probes/vqa/chat.py): ``spar-probe vqa --model hf:``, the stage encoder
and lmms-eval's own call on an exported task give the same token ids for the same question, BOS
exactly once, under a tokenizer that adds BOS and under a template that writes ``{{ bos_token }}``.

lmms-eval's call, reproduced (lmms-eval 0.7.3, ``lmms_eval/models/chat/llava_hf.py``,
``generate_until``): ``text = processor.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)`` with the exported task's message (its image, then
``doc_to_text`` = the exported question), then ``processor(images=visuals, text=text,
return_tensors="pt")`` (the tokenizer's default special tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spar_bench.probes.encoders import load_encoder
from spar_bench.probes.encoders.mllm_family import chat_prompt
from spar_bench.probes.vqa.base import BackendOptions, Request
from spar_bench.probes.vqa.hf import HFBackend
from spar_bench.probes.vqa.tiny import CHAT_TEMPLATE, LLAVA_15_TEMPLATE, make_tiny_llava

from helpers import images

pytest.importorskip("transformers")

QUESTION = "Is the centre of the liver to the patient's left of the centre of the spleen?\nOptions:\nA. yes\nB. no"
#: a template that writes the BOS token itself (as Gemma 3's and MedGemma's do)
BOS_TEMPLATE = "{{ bos_token }}" + CHAT_TEMPLATE


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {"llava15": make_tiny_llava(root / "llava15", chat_template=LLAVA_15_TEMPLATE, bos=True),
            "bos-template": make_tiny_llava(root / "bos", chat_template=BOS_TEMPLATE, bos=True)}


def _image():
    from PIL import Image

    return Image.fromarray(np.full((224, 224, 3), 90, np.uint8))


def _vqa_ids(folder: Path) -> list[int]:
    backend = HFBackend(str(folder), BackendOptions(mode="generate"))
    r = Request("k", QUESTION, ("A", "B"), ("yes", "no"), _image())
    return backend.encode([backend.prompt_text(r)], [r], "left")["input_ids"][0].tolist()


def _lmms_eval_ids(folder: Path) -> list[int]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(images=[_image()], text=text, return_tensors="pt")["input_ids"][0].tolist()


def _stage_ids(folder: Path, stage: str, question: str | None = None) -> list[int]:
    enc = load_encoder(f"mllm:{folder}@{stage}")
    if question is not None:  # the stage encoder asked the question as vqa asks it (image first)
        enc.prompt = chat_prompt(enc.processor, question)
    if stage.endswith("+q"):
        with enc.asking([QUESTION]):
            return enc.preprocess(images(1))["input_ids"][0].tolist()
    return enc.preprocess(images(1))["input_ids"][0].tolist()


def _bos(folder: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True).bos_token_id


def test_vqa_stage_and_lmms_eval_give_the_same_ids_under_a_bos_tokenizer(folders) -> None:
    folder = folders["llava15"]
    bos = _bos(folder)
    vqa, lmms = _vqa_ids(folder), _lmms_eval_ids(folder)
    assert vqa == lmms and vqa[0] == bos and vqa.count(bos) == 1
    assert _stage_ids(folder, "llm:1", QUESTION) == vqa
    for stage in ("llm:1", "llm:1+q"):  # the stage's own prompts: BOS once too
        ids = _stage_ids(folder, stage)
        assert ids[0] == bos and ids.count(bos) == 1, stage


def test_a_template_that_writes_bos_gets_it_once(folders) -> None:
    """Gemma 3 / MedGemma style: the template's BOS, none added; lmms-eval's call adds a second."""
    folder = folders["bos-template"]
    bos = _bos(folder)
    vqa = _vqa_ids(folder)
    assert vqa[0] == bos and vqa.count(bos) == 1
    assert _stage_ids(folder, "llm:1", QUESTION) == vqa
    for stage in ("llm:1", "llm:1+q"):
        assert _stage_ids(folder, stage).count(bos) == 1, stage
    assert load_encoder(f"mllm:{folder}@llm:1").spec.extra["bos"] == "template"  # an older cache won't resume
    assert "bos" not in load_encoder(f"mllm:{folders['llava15']}@llm:1").spec.extra
    assert _lmms_eval_ids(folder)[:2] == [bos, bos]  # why vqa does not copy that call blindly
