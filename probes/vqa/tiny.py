"""Tiny, randomly initialised LLaVA, Qwen2-VL and PaliGemma models saved to a folder, for tests and
``bench/vqa.py``.

Nothing is downloaded: the word-level tokenizer is trained here on the prompts'
own words, the chat template is written here, and the weights are random (seeded). Its
answers mean nothing; it exercises the ``hf:`` backend end to end (processor, chat
template, image tokens, log-likelihood scoring, generation) in seconds on a CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

from spar_bench.builder.schema import LEVEL3_CLASS_NAMES, ORGANS

from . import prompts as P

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %} <image>"
    "{% else %} {{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


#: llava-hf/llava-1.5-7b-hf's chat template, as its chat_template.json ships it (the same text is
#: the LLaVA processor's template in transformers' tests/models/llava/test_processing_llava.py,
#: prepare_processor_dict): every image of a turn is written before its text.
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def _vocabulary(volume: bool = False, special: tuple[str, ...] = ("<image>",)) -> list[str]:
    """Special tokens, then the prompts' words (``volume``: the Level 4 prompts' too)."""

    parts = [P.CONVENTION_HINT, P.BLIND_NOTE, P.CENTRE, P.PIXEL_SIZE, P.FRAME, P.INSTRUCTION, *P.QUESTIONS.values(),
             *P.OPTION_TEXT.values(), "0 1 2 3 4 5 6 7 8 9", *(P.organ_text(i) for i in range(len(ORGANS))),
             *(n for names in LEVEL3_CLASS_NAMES.values() for n in names),
             "the correct answer is user assistant options"]
    if volume:
        parts += [*P.VOLUME_SHOWN.values(), *P.VOLUME_CONVENTION.values(), P.VOLUME_SCALE, P.BLIND_NOTE_VOLUME,
                  P.CENTRE_VOLUME, *P.VOLUME_QUESTIONS.values(), "about 3+"]
    words = set(re.findall(r"\w+|[^\w\s]", " ".join(parts))) | set("ABCDEFGH")
    return ["<pad>", "<unk>", "<s>", "</s>", *special, *sorted(words)]


def _word_tokenizer(words: list[str], extra: dict[str, str], bos: bool = False):
    """A fast word-level tokenizer over ``words`` (``extra``: the processor's named special
    tokens); ``bos``: it adds ``<s>`` in front of every text, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", words.index("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", extra_special_tokens=extra)


def _letters_only(model, letters: list[int], silent: list[int]) -> None:
    """Zero the language head but for ``letters`` and the input embeddings of ``silent``."""
    import torch

    head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    keep = torch.zeros(head.shape[0], 1)
    keep[letters] = 1.0
    with torch.no_grad():
        head.mul_(keep)
        emb[silent] = 0.0


def make_tiny_llava(path: str | Path, seed: int = 0, hidden: int = 32, image_size: int = 32,
                    letters_only: str = "", chat_template: str = CHAT_TEMPLATE, bos: bool = False) -> Path:
    """Save a tiny random LLaVA (model, processor, tokenizer, chat template) into ``path``.

    ``letters_only`` (e.g. ``"ABC"``): a greedy one-token answer is one of these letters or
    nothing (answers that parse, for tests that compare scores, not only texts): the language
    head scores only them (every other token's logit is 0), and the generation prompt's own
    tokens (``assistant :``) embed to 0, so which letter comes from what the last position reads
    of the question and the image (weakly, a random model: with and without an image often
    differ, two images seldom). ``chat_template``: another template (LLaVA-1.5's real one, in
    tests); ``bos``: the tokenizer adds ``<s>`` (as Llama's does)."""
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    words = _vocabulary()
    vocab = {w: i for i, w in enumerate(words)}
    fast = _word_tokenizer(words, {"image_token": "<image>"}, bos)
    patch = image_size // 4
    proc = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                           crop_size={"height": image_size, "width": image_size}),
        tokenizer=fast, patch_size=patch, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template)
    vision = CLIPVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                              num_attention_heads=2, image_size=image_size, patch_size=patch)
    text = LlamaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=1024, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=vocab["<image>"],
                      vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    if letters_only:
        _letters_only(model, [vocab[c] for c in letters_only], [vocab["assistant"], vocab[":"]])
    path = Path(path)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


#: Qwen2-VL's vision tokens, as its chat template writes them.
QWEN_SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %} <|vision_start|> <|image_pad|> <|vision_end|>"
    "{% elif c['type'] == 'video' %} <|vision_start|> <|video_pad|> <|vision_end|>"
    "{% else %} {{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def make_tiny_qwen2_vl(path: str | Path, seed: int = 0, hidden: int = 32, pixels: int = 56) -> Path:
    """Save a tiny random Qwen2-VL (model, image and video processors, word-level tokenizer
    over the Level 3 and Level 4 prompts, chat template) into ``path``: the ``hf:`` video path
    (``--volume-as video``) end to end. Frames are resized to about ``pixels`` x ``pixels``."""
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    words = _vocabulary(volume=True, special=QWEN_SPECIAL)
    vocab = {w: i for i, w in enumerate(words)}
    fast = _word_tokenizer(words, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    px = {"min_pixels": pixels * pixels, "max_pixels": pixels * pixels, "patch_size": 14, "merge_size": 2,
          "temporal_patch_size": 2}
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**px), tokenizer=fast,
                            video_processor=Qwen2VLVideoProcessor(**px), chat_template=QWEN_CHAT_TEMPLATE)
    text = {"vocab_size": len(words), "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    vision = {"depth": 2, "embed_dim": hidden, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
                        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                        vision_end_token_id=vocab["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    path = Path(path)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


def make_tiny_paligemma(path: str | Path, seed: int = 0, hidden: int = 32, image_size: int = 32) -> Path:
    """Save a tiny random PaliGemma (SigLIP tower, linear projector, Gemma; processor with the
    word-level tokenizer and the chat template) into ``path``: a third family of
    ``mllm:DIR@STAGE`` (``image_size / 4`` squared image tokens)."""
    import torch
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    words = _vocabulary()
    vocab = {w: i for i, w in enumerate(words)}
    patch = image_size // 4
    images = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    images.image_seq_length = (image_size // patch) ** 2  # PaliGemmaProcessor reads it from here
    proc = PaliGemmaProcessor(image_processor=images, tokenizer=_word_tokenizer(words, {"image_token": "<image>"}),
                              chat_template=CHAT_TEMPLATE)
    vision = SiglipVisionConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                num_attention_heads=2, image_size=image_size, patch_size=patch)
    text = GemmaConfig(vocab_size=len(words), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, pad_token_id=0,
                       bos_token_id=2, eos_token_id=3)
    cfg = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_id=vocab["<image>"], projection_dim=hidden)
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(cfg).eval()
    path = Path(path)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path
