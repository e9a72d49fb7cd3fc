"""A tiny, randomly initialised LLaVA saved to a folder, for tests and ``bench/vqa.py``.

Nothing is downloaded: the word-level tokenizer is trained here on the prompts'
own words, the chat template is written here, and the weights are random (seeded). Its
answers mean nothing; it exercises the ``hf:`` backend end to end (processor, chat
template, image tokens, log-likelihood scoring, generation) in seconds on a CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %} <image>"
    "{% else %} {{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def _vocabulary() -> list[str]:
    from spar_bench.builder.schema import LEVEL3_CLASS_NAMES, ORGANS

    from .prompts import (BLIND_NOTE, CENTRE, CONVENTION_HINT, FRAME, INSTRUCTION, OPTION_TEXT, PIXEL_SIZE,
                          QUESTIONS, organ_text)

    text = " ".join([CONVENTION_HINT, BLIND_NOTE, CENTRE, PIXEL_SIZE, FRAME, INSTRUCTION, *QUESTIONS.values(),
                     *OPTION_TEXT.values(), "0 1 2 3 4 5 6 7 8 9",
                     *(organ_text(i) for i in range(len(ORGANS))),
                     *(n for names in LEVEL3_CLASS_NAMES.values() for n in names),
                     "the correct answer is user assistant options"])
    words = set(re.findall(r"\w+|[^\w\s]", text)) | set("ABCDEFGH")
    return ["<pad>", "<unk>", "<s>", "</s>", "<image>", *sorted(words)]


def make_tiny_llava(path: str | Path, seed: int = 0, hidden: int = 32, image_size: int = 32) -> Path:
    """Save a tiny random LLaVA (model, processor, tokenizer, chat template) into ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    words = _vocabulary()
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>",
                                   extra_special_tokens={"image_token": "<image>"})
    patch = image_size // 4
    proc = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                           crop_size={"height": image_size, "width": image_size}),
        tokenizer=fast, patch_size=patch, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                              num_attention_heads=2, image_size=image_size, patch_size=patch)
    text = LlamaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=1024, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab["<image>"],
                      vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    path = Path(path)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path
