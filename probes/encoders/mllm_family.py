"""``mllm:DIR@STAGE``: the token features of a local HF vision-language model at one stage.

Where does an MLLM lose what its images show? The same frozen heads, blind baselines and
controls as for any encoder, on the features of one model at each stage of its pipeline:

* ``vision``: the vision tower's output, as the projector reads it (LLaVA: the hidden state of
  ``vision_feature_layer``, without CLS under the ``default`` strategy; Qwen2-VL / Qwen2.5-VL:
  the last block's patch tokens before the 2x2 merger, put back in row-major order;
  PaliGemma and others: the tower's ``last_hidden_state``);
* ``projector``: the visual tokens the language model receives (``get_image_features``'s
  ``pooler_output``: LLaVA's MLP, Qwen's patch merger, PaliGemma's linear map);
* ``llm:N``: the language model's hidden state after layer ``N`` (``0``: its input
  embeddings; negative counts from the end) at the image-token positions, the image shown
  with the neutral prompt :data:`NEUTRAL_PROMPT` through the model's own chat template;
* ``llm:N+q``: the same with the probe's question in the prompt instead: the user message
  ``spar-probe vqa`` sends with the image (options included), through the same chat template,
  placed BEFORE the image in the user's turn. ``spar-probe vqa`` puts it after the image, but in
  a causal LM no token after the image changes the image tokens' hidden states: asked that
  way, every layer's image tokens are exactly the neutral stage's (a prefix-LM such as
  PaliGemma, whose image and prompt attend to each other, is the exception). Its features
  depend on (image, question), so its cache is made for one probe, a row per question
  (``spar-probe cache --probe PROBE``; :mod:`spar_bench.probes.question_rows`); the texts of a
  batch are given with :meth:`MllmEncoder.asking`.

Images go through the model's own processor (as ``spar-probe vqa --model hf:DIR`` shows them):
a 224 x 224 grey image, as RGB. Qwen's dynamic resolution therefore sees one fixed size and
one token grid, recorded in the spec (``grid``; ``extra["vision_grid"]``, ``extra["image_tokens"]``).
Local folders only (``save_pretrained`` output, loaded with ``local_files_only=True``);
``--random-init`` builds the folder's architecture with random weights, and only from a
folder that holds no weights. Each stage caches one layer (``-1``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_file

from ..vqa.chat import add_special_tokens, render, tokenizer_of
from .base import Encoder, EncoderSpec, WeightsGiven, local_name, require_extra, weights_record

#: the prompt shown with the image for the ``llm:N`` stages (no question: what the LM holds of
#: the image before it is asked anything)
NEUTRAL_PROMPT = "Describe the image."
#: the stages of ``mllm:DIR@STAGE`` (``llm:N`` with N a layer index; ``+q``: the question in the prompt)
STAGES = ("vision", "projector", "llm:N", "llm:N+q")
#: the suffix of a stage that reads the probe's question with the image
ASKS = "+q"
_STAGE = re.compile(r"(vision|projector)|llm:(-?\d+)(?:\+q)?")
#: processor outputs that are text, not pixels (kept from ``get_image_features``)
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels")
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def parse_stage(text: str, name: str = "mllm") -> tuple[str, int | None]:
    """``"vision"`` -> ``("vision", None)``, ``"llm:8"`` (and ``"llm:8+q"``) -> ``("llm", 8)``;
    anything else one line (:func:`asks_question` tells ``+q``)."""
    m = _STAGE.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"encoder {name}: unknown stage {text!r}; use one of {', '.join(STAGES)} "
                          "(e.g. mllm:DIR@vision, mllm:DIR@llm:16, mllm:DIR@llm:16+q)")
    return (m.group(1), None) if m.group(1) else ("llm", int(m.group(2)))


def asks_question(stage: str) -> bool:
    """Whether a stage (``llm:8+q``) reads the probe's question with the image."""
    return stage.strip().endswith(ASKS)


def split_name(rest: str) -> tuple[str, str]:
    """``"DIR@llm:8"`` -> ``("DIR", "llm:8")`` (the last ``@`` splits)."""
    folder, sep, stage = rest.rpartition("@")
    if not sep or not folder:
        raise ConfigError(f"encoder mllm:{rest}: name a stage, as mllm:DIR@STAGE with STAGE one of "
                          f"{', '.join(STAGES)}")
    return folder, stage


class MllmEncoder(Encoder):
    """One stage of an image-text model: ``preprocess`` runs its processor (image + chat
    prompt), ``_layer_tokens`` the model up to that stage."""

    def __init__(self, spec: EncoderSpec, model: Any, processor: Any, prompt: str):
        super().__init__(spec, model)
        self.processor, self.prompt = processor, prompt
        self.stage, self.llm_layer = parse_stage(spec.extra["stage"], spec.name)
        self.asks = asks_question(spec.extra["stage"])
        self.texts: tuple[str, ...] | None = None  # a ``+q`` stage's user messages of the batch

    def to(self, device) -> MllmEncoder:
        """Move to ``device`` in :func:`stage_dtype`'s precision: bf16 weights on a GPU (a 7-8 B
        model in 14-16 GB, as ``spar-probe vqa`` loads it; recorded as ``weights_dtype`` in the
        spec), fp32 on the CPU (nothing recorded: the spec of a CPU cache is as before)."""
        import torch

        dtype = stage_dtype(device)
        self.module.to(device=torch.device(device), dtype=dtype)
        extra = {k: v for k, v in self.spec.extra.items() if k != "weights_dtype"}
        self.spec = replace(self.spec, extra={**extra, **({"weights_dtype": "bfloat16"} if dtype == torch.bfloat16 else {})})
        return self

    def ask(self, rows) -> None:
        """Make this ``+q`` stage the encoder of one probe's questions (a
        :class:`~spar_bench.probes.question_rows.QuestionRows`): recorded in its spec."""
        if not self.asks:
            raise ConfigError(f"encoder {self.spec.name}: --probe applies to the question stages "
                              "(mllm:DIR@llm:N+q) only; drop it")
        self.spec = replace(self.spec, extra={**self.spec.extra, **rows.record()})

    @contextmanager
    def asking(self, texts: Sequence[str]) -> Iterator[None]:
        """Encode the next batch with these user messages, one per image (a ``+q`` stage)."""
        self.texts = tuple(texts)
        try:
            yield
        finally:
            self.texts = None

    def _prompts(self, n: int) -> list[str]:
        if not self.asks:
            return [self.prompt] * n
        if self.texts is None or len(self.texts) != n:
            raise ConfigError(f"encoder {self.spec.name}: the question stage needs the question of each of its "
                              f"{n} images; make its cache with `spar-probe cache --probe PROBE`")
        return [chat_prompt(self.processor, t, question_first=True) for t in self.texts]

    def preprocess(self, images):  # type: ignore[override] - a processor batch, not a tensor
        if images.dtype.is_floating_point or images.ndim != 3:
            raise ValueError(f"expected uint8 (B, H, W) images, got {images.dtype} {tuple(images.shape)}")
        rgb = images.cpu().unsqueeze(-1).expand(-1, -1, -1, 3).numpy()
        tok = getattr(self.processor, "tokenizer", None)
        if tok is not None:  # prompts of several lengths: right-padded, real tokens placed as unbatched
            tok.padding_side = "right"
        # one image per prompt, nested: Gemma 3's processor counts images per sample
        texts = self._prompts(len(rgb))
        enc = self.processor(text=texts, images=[[im] for im in rgb], return_tensors="pt", padding=True,
                             add_special_tokens=add_special_tokens(self.processor, texts))
        enc.pop("labels", None)  # PaliGemma's processor adds them: no loss is wanted
        enc = enc.to(self.device)
        dtype = next(self.module.parameters()).dtype
        for k, v in enc.items():  # pixels in the weights' precision (bf16 on a GPU)
            if v.is_floating_point():
                enc[k] = v.to(dtype)
        return enc

    def _layer_tokens(self, x, layers):
        if self.stage == "llm":
            return {-1: llm_tokens(self.module, x, self.llm_layer)}
        pix = {k: v for k, v in x.items() if k not in _TEXT_KEYS}
        out = self.module.model.get_image_features(**pix, output_hidden_states=self.stage == "vision")
        b = int(x["input_ids"].shape[0])
        if self.stage == "projector":
            import torch

            feats = out.pooler_output
            feats = torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats
            return {-1: feats.reshape(b, -1, feats.shape[-1])}
        return {-1: vision_tokens(self.module, out, pix, b)}


def stage_dtype(device):
    """The precision a stage encoder's weights take on ``device``: bf16 on CUDA, fp32 elsewhere."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def llm_tokens(model: Any, enc: Any, layer: int):
    """The LM's hidden state ``layer`` at the image-token positions: ``(B, n_image_tokens, D)``."""
    out = model(**enc, output_hidden_states=True, return_dict=True, logits_to_keep=1)
    hs = out.hidden_states[layer]
    mask = enc["input_ids"] == image_token_id(model.config)
    n = int(mask[0].sum())
    return hs[mask].reshape(hs.shape[0], n, hs.shape[-1])


def image_token_id(config: Any) -> int:
    for key in ("image_token_id", "image_token_index"):
        v = getattr(config, key, None)
        if v is not None:
            return int(v)
    raise ConfigError(f"model type {config.model_type}: its config names no image token")


def vision_tokens(model: Any, out: Any, pix: dict[str, Any], b: int):
    """The vision tower's output as the projector reads it, ``(B, T, D)``, row-major."""
    import torch

    cfg = model.config
    if cfg.model_type in ("qwen2_vl", "qwen2_5_vl"):
        return qwen_patches(model, out.last_hidden_state, pix["image_grid_thw"])
    layer = getattr(cfg, "vision_feature_layer", None)
    if layer is None or out.hidden_states is None:
        return out.last_hidden_state
    layers = [layer] if isinstance(layer, int) else list(layer)
    feats = torch.cat([out.hidden_states[v] for v in layers], dim=-1)
    if getattr(cfg, "vision_feature_select_strategy", "default") == "default":
        feats = feats[:, 1:]
    return feats.reshape(b, -1, feats.shape[-1])


def qwen_patches(model: Any, hidden, grid_thw):
    """Qwen2(.5)-VL's pre-merger patch tokens ``(sum t*h*w, D)`` as ``(B, h*w, D)`` in row-major
    (row, col) order: the processor lists them merge window by merge window (and Qwen2.5-VL's
    tower reorders them into attention windows)."""
    import torch

    visual = model.model.visual
    m = int(visual.spatial_merge_size)
    d = hidden.shape[-1]
    if model.config.model_type == "qwen2_5_vl":
        from transformers.vision_utils import get_vision_window_index

        index, _ = get_vision_window_index(grid_thw, spatial_merge_size=m, window_size=visual.window_size,
                                           patch_size=visual.patch_size)
        hidden = hidden.reshape(-1, m * m, d)[torch.argsort(index)].reshape(-1, d)
    out, at = [], 0
    for t, h, w in grid_thw.tolist():
        n = t * h * w
        x = hidden[at:at + n].reshape(t, h // m, w // m, m, m, d).permute(0, 1, 3, 2, 4, 5)
        out.append(x.reshape(t * h * w, d))
        at += n
    return torch.stack(out)


# --------------------------------------------------------------------------- loading
def chat_prompt(processor: Any, text: str, *, question_first: bool = False) -> str:
    """One image and ``text`` as the user's turn of the processor's chat template: the image
    first (as ``spar-probe vqa --model hf:DIR`` sends it), or, ``question_first``, the text
    first (the ``llm:N+q`` stage: the image tokens attend to it; :func:`question_first_prompt`)."""
    if question_first:
        return question_first_prompt(processor, text)[0]
    return render(processor, [{"type": "image"}, {"type": "text", "text": text}])


#: a word no template writes: where the user's text goes while the image's place is found
_SLOT = "SPARQUESTIONSLOT"


def question_first_prompt(processor: Any, text: str) -> tuple[str, str]:
    """``(prompt, how)``: the user's turn with ``text`` BEFORE the image, whatever the chat
    template does with the content's order. ``how``: ``template`` (the template keeps the order
    given) or ``spliced``: a template that writes every image first (LLaVA-1.5's: "Render all
    images first") is rendered with the text alone and the image's own rendering (the text the
    template writes for an image part, e.g. ``<image>\\n``) is put after the question. A
    ConfigError (one line) when neither puts the image token after the question."""
    token = _image_token(processor)
    asked = render(processor, [{"type": "text", "text": _SLOT}, {"type": "image"}])
    if _question_first(asked, token):
        return asked.replace(_SLOT, text), "template"
    alone = render(processor, [{"type": "text", "text": _SLOT}])
    shown = render(processor, [{"type": "image"}, {"type": "text", "text": _SLOT}])
    head = len(_common_prefix(alone, shown))
    tail = len(_common_prefix(alone[head:][::-1], shown[head:][::-1]))
    image = shown[head:len(shown) - tail]
    spliced = alone.replace(_SLOT, _SLOT + "\n" + image.strip(), 1) if image.strip() else alone
    if _SLOT in alone and _question_first(spliced, token):
        return spliced.replace(_SLOT, text), "spliced"
    raise ConfigError(f"the chat template cannot put the question before the image (it writes {token!r} "
                      "elsewhere): this model has no llm:N+q stage; probe llm:N")


def _image_token(processor: Any) -> str:
    token = getattr(processor, "image_token", None) or getattr(tokenizer_of(processor), "image_token", None)
    if not token:
        raise ConfigError("the processor names no image token: the question stage cannot find the image")
    return str(token)


def _question_first(prompt: str, token: str) -> bool:
    return _SLOT in prompt and token in prompt and prompt.index(_SLOT) < prompt.index(token)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _chat_prompt(processor: Any, name: str) -> str:
    if getattr(processor, "chat_template", None) is None:
        raise ConfigError(f"encoder {name}: the processor has no chat template (save one with the model)")
    return chat_prompt(processor, NEUTRAL_PROMPT)


def _recorded_prompt(processor: Any, neutral: str, stage: str, name: str) -> dict[str, Any]:
    """The chat-templated prompt of an LM stage (``{question}`` where a ``+q`` stage puts each
    row's question; None for the vision and projector stages, which read no text) and, for a
    ``+q`` stage, whether the question precedes the image tokens (so a causal LM's image tokens
    can attend to it) and how (:func:`question_first_prompt`)."""
    if not stage.startswith("llm"):
        return {"prompt": None}
    if not asks_question(stage):
        return {"prompt": neutral}
    try:
        prompt, how = question_first_prompt(processor, "{question}")
    except ConfigError as e:
        raise ConfigError(f"encoder {name}: {e}") from None
    return {"prompt": prompt, "question_before_image": True, "question_placement": how}


def _load(folder: Path, name: str, random_init: bool) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, processor, weights record)`` of a local folder; random weights only when asked."""
    tf = require_extra("transformers", "transformers")
    has_weights = any(any(folder.glob(p)) for p in _WEIGHT_FILES)
    if random_init and has_weights:
        raise WeightsGiven(name, f"folder {folder}")
    if not random_init and not has_weights:
        raise ConfigError(f"encoder {name}: {folder} holds no weights (*.safetensors, *.bin); point at a "
                          "save_pretrained folder, or pass --random-init to probe a random network on purpose")
    import torch

    auto = getattr(tf, "AutoModelForImageTextToText", None) or tf.AutoModelForVision2Seq
    kw = {"local_files_only": True}
    # bf16 where a GPU will run it (half the host memory of fp32); MllmEncoder.to sets the device's precision
    dtype = stage_dtype("cuda" if torch.cuda.is_available() else "cpu")
    try:
        processor = tf.AutoProcessor.from_pretrained(str(folder), **kw)
        if random_init:
            model = auto.from_config(tf.AutoConfig.from_pretrained(str(folder), **kw))
            record = {"kind": "random-init", "config_from": weights_record(folder, False, name)}
        else:
            model = auto.from_pretrained(str(folder), dtype=dtype, **kw)
            record = weights_record(folder, False, name)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"encoder {name}: cannot load {folder} as an image-text model: {first}") from None
    return model.to(dtype).eval(), processor, record


def _token_layout(model: Any, processor: Any, prompt: str, stage: str) -> dict[str, Any]:
    """The token grids and the vision tower's width from one processor call on a blank image
    and one pass of the tower (its patches may outnumber the LM's tokens: Qwen's 2x2 merger,
    InternVL's pixel shuffle, Gemma 3's pooling); the LM is not run."""
    import torch

    enc = processor(text=[prompt], images=[[np.zeros((224, 224, 3), np.uint8)]], return_tensors="pt",
                    add_special_tokens=add_special_tokens(processor, [prompt]))
    n_img = int((enc["input_ids"] == image_token_id(model.config)).sum())
    cfg = model.config
    n_prefix = int(getattr(cfg, "vision_feature_select_strategy", "default") == "full")
    pix = {k: v for k, v in enc.items() if k not in _TEXT_KEYS}
    with torch.inference_mode():
        vis = vision_tokens(model, model.model.get_image_features(**pix, output_hidden_states=True), pix, 1)
    if "image_grid_thw" in enc:  # Qwen2-VL: dynamic resolution, here one fixed 224 input
        _, h, w = (int(v) for v in enc["image_grid_thw"][0])
        m = int(model.model.visual.spatial_merge_size)
        grid, vision = (h // m, w // m), (h, w)
    else:
        grid = _square(n_img - n_prefix, cfg.model_type, "image tokens")
        vision = _square(int(vis.shape[1]) - n_prefix, cfg.model_type, "patches")
    return {"grid": vision if stage == "vision" else grid, "n_prefix": n_prefix, "image_tokens": n_img,
            "vision_grid": list(vision), "lm_grid": list(grid), "vision_dim": int(vis.shape[-1])}


def _square(n: int, model_type: str, what: str) -> tuple[int, int]:
    side = math.isqrt(n)
    if side * side != n:
        raise ConfigError(f"model type {model_type}: {n} {what} of a 224 image are not a square grid "
                          "(an image tiled into crops?); this model is not supported by mllm: yet")
    return (side, side)


def load_mllm(rest: str, *, weights: str | None = None, random_init: bool = False,
              revision: str | None = None) -> MllmEncoder:
    """Factory of ``mllm:DIR@STAGE`` (the module docstring)."""
    folder_text, stage_text = split_name(rest)
    stage, layer = parse_stage(stage_text, f"mllm:{rest}")
    folder = Path(folder_text)
    if weights is not None or revision is not None:
        raise ConfigError(f"encoder mllm:{rest}: takes no --weights or --revision; name the model's folder")
    if not folder.is_dir():
        raise ConfigError(f"encoder mllm:{rest}: {folder} is not a folder; mllm: loads local save_pretrained "
                          "folders only (download the model first)")
    model, processor, record = _load(folder, f"mllm:{rest}", random_init)
    prompt = _chat_prompt(processor, f"mllm:{rest}")
    n_lm = int(model.config.get_text_config().num_hidden_layers)
    if layer is not None and not -(n_lm + 1) <= layer <= n_lm:
        raise ConfigError(f"encoder mllm:{rest}: layer {layer} out of range; the language model has "
                          f"{n_lm} layers (llm:0 is its input, llm:{n_lm} its last)")
    layout = _token_layout(model, processor, prompt, stage)
    sha = (record.get("config_from") or record)["sha256"]
    name = local_name("mllm:", folder, sha) + f"@{stage_text}"
    dim = layout["vision_dim"] if stage == "vision" else int(model.config.get_text_config().hidden_size)
    spec = EncoderSpec(
        name=name, family="mllm", input_size=(224, 224), in_chans=3, mean=(0.0,), std=(1.0,),
        interpolation="the model's processor", patch_size=None, n_prefix=layout["n_prefix"],
        grid=tuple(layout["grid"]), dim=dim, pooled="mean-patch", n_layers=None,
        weights=record, random_init=record["kind"] == "random-init",
        extra={"stage": stage_text, "llm_layer": layer, "model_type": model.config.model_type,
               "config_sha256": sha256_file(folder / "config.json"),
               **_recorded_prompt(processor, prompt, stage_text, name), "image_tokens": layout["image_tokens"],
               "vision_grid": layout["vision_grid"], "lm_grid": layout["lm_grid"], "lm_layers": n_lm,
               "preprocessing": "the model's processor on the 224x224 grey image as RGB",
               # the template writes BOS itself: none is added (before, a second one was)
               **({} if add_special_tokens(processor, [prompt]) else {"bos": "template"})},
    )
    return MllmEncoder(spec, model, processor, prompt)
