"""``hf:PATH_OR_ID``: a transformers image-text model through its processor and chat template.

* A local folder (``save_pretrained`` output) loads with ``local_files_only=True`` and is
  identified by the sha256 of its files; a hub id needs ``--revision`` (a commit) and is
  identified by id + revision; ``HF_HUB_OFFLINE=1`` is honoured.
* Constrained answering (default): the chat-templated prompt is followed by each option's
  letter and the option with the highest log-likelihood (summed over the letter's tokens)
  is the answer. When every letter is one token after the prompt, one forward pass of the
  prompt scores all options (read at the last position); otherwise each prompt+letter is
  scored. Batches are right-padded, so positions and causal attention of real tokens are
  those of an unbatched pass.
* ``--generate``: greedy decoding (left-padded batches), the text is parsed strictly.
* Tokenization: the chat template applied once, BOS exactly once (:mod:`.chat`: as lmms-eval's
  ``llava_hf`` does for a template without BOS).
* Level 4 volumes: a processor with a ``video_processor`` (Qwen2-VL style) takes a
  ``--volume-as video`` request as ``videos=`` (its frames in order, a ``{"type": "video"}``
  chat part); any other processor refuses a video in one line (``montage``/``views`` are
  plain images).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_file

from .base import Backend, BackendOptions, Reply, Request
from .chat import add_special_tokens, render


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "hf: models need transformers; pip install 'spar-bench[transformers]'"
        ) from None
    return transformers


def model_source(rest: str, revision: str | None) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """``(source, from_pretrained kwargs, identity, slug)`` of ``hf:<rest>``."""
    local = Path(rest)
    if local.is_dir():
        ident = {"kind": "dir", "name": local.resolve().name, "sha256": sha256_file(local),
                 "revision": revision}
        # the hash keeps two local models of one folder name out of each other's run folders
        return str(local), {"local_files_only": True}, ident, f"hf-{local.resolve().name}-{ident['sha256'][:8]}"
    if "/" not in rest or rest.startswith((".", "/", "~")):
        raise ConfigError(f"model hf:{rest}: neither a model folder nor a hub id 'org/name'")
    if not revision:
        raise ConfigError(f"model hf:{rest}: pass --revision <commit> to pin the hub weights")
    kw: dict[str, Any] = {"revision": revision}
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        kw["local_files_only"] = True
    return rest, kw, {"kind": "hub", "repo": rest, "revision": revision}, "hf-" + rest.replace("/", "-")


def preferred_size(image_processor) -> int | None:
    """The square input size an image processor resizes to (crop, height or shortest edge);
    None for a dynamic-resolution processor (Qwen2-VL style: ``merge_size``, whose size bounds
    are pixel counts, not sides), which takes any size."""
    if image_processor is None or getattr(image_processor, "merge_size", None) is not None:
        return None
    for attr in ("crop_size", "size"):
        s = getattr(image_processor, attr, None)
        if attr == "crop_size" and not getattr(image_processor, "do_center_crop", False):
            continue
        if isinstance(s, int):
            return s
        for key in ("height", "shortest_edge"):  # a dict, or transformers' SizeDict
            v = s.get(key) if isinstance(s, dict) else getattr(s, key, None)
            if v:
                return int(v)
    return None


def _shown(r: Request) -> str:
    return "video" if r.frames is not None else "image" if r.image is not None else "text"


class HFBackend(Backend):
    def __init__(self, rest: str, options: BackendOptions):
        import torch

        tf = _transformers()
        src, kw, self.identity, self.name = model_source(rest, options.revision)
        dtype = getattr(torch, options.dtype)
        auto = getattr(tf, "AutoModelForImageTextToText", None) or tf.AutoModelForVision2Seq
        try:
            self.processor = tf.AutoProcessor.from_pretrained(src, **kw)
            self.model = auto.from_pretrained(src, dtype=dtype, **kw).to(options.device).eval()
        except (OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"model hf:{rest}: cannot load {src}: {first}") from None
        self.tok = getattr(self.processor, "tokenizer", self.processor)
        if getattr(self.processor, "chat_template", None) is None:
            raise ConfigError(f"model hf:{rest}: the processor has no chat template")
        self.preferred_size = preferred_size(getattr(self.processor, "image_processor", None))
        self.takes_video = getattr(self.processor, "video_processor", None) is not None
        self.mode = options.mode
        self.device = options.device
        self.batch_size = options.batch_size
        self.max_new_tokens = options.max_new_tokens
        # "bos": the tokenization rule (chat.py); answers cached before it (no BOS) are not reused
        self.decoding = {"mode": self.mode, "dtype": options.dtype, "scoring": "letter-loglik", "bos": "once"}
        if self.mode == "generate":
            self.decoding = {"mode": self.mode, "dtype": options.dtype, "greedy": True,
                             "max_new_tokens": self.max_new_tokens, "bos": "once"}

    # -- inputs ------------------------------------------------------------------------
    def prompt_text(self, r: Request) -> str:
        shown = [{"type": "video"}] if r.frames is not None else [{"type": "image"}] if r.image is not None else []
        return render(self.processor, shown + [{"type": "text", "text": r.text}])

    def encode(self, texts: list[str], reqs: list[Request], padding_side: str):
        """Processor outputs for a batch (``reqs``: each text's request; all with an image,
        all with a video, or all with neither)."""
        self.tok.padding_side = padding_side
        kw: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True,
                              "add_special_tokens": add_special_tokens(self.processor, texts)}
        if any(r.frames is not None for r in reqs):
            kw["videos"] = [list(r.frames) for r in reqs]
        elif any(r.image is not None for r in reqs):
            kw["images"] = [r.image for r in reqs]
        return self.processor(**kw).to(self.device)

    def letter_ids(self, prompts: list[str], letters: list[tuple[str, ...]]) -> list[list[list[int] | None]]:
        """Per prompt and letter, the token ids the letter adds after the prompt; None where
        appending it changes the prompt's own tokens (one batched tokenizer call each way)."""
        base = self.tok(prompts, add_special_tokens=False)["input_ids"]
        full = self.tok([p + L for p, ls in zip(prompts, letters, strict=True) for L in ls],
                        add_special_tokens=False)["input_ids"]
        out, at = [], 0
        for a, ls in zip(base, letters, strict=True):
            row = []
            for b in full[at: at + len(ls)]:
                row.append(list(b[len(a):]) if b[: len(a)] == a and len(b) > len(a) else None)
            out.append(row)
            at += len(ls)
        return out

    # -- answering ---------------------------------------------------------------------
    def answer(self, requests: list[Request]) -> list[Reply]:
        out: list[Reply | None] = [None] * len(requests)
        if not self.takes_video and any(r.frames is not None for r in requests):
            raise ConfigError(f"model {self.name}: its processor takes no video; use --volume-as montage or views")
        for kind in ("video", "image", "text"):  # a processor batch is all-video, all-image or all-text
            idx = [i for i, r in enumerate(requests) if _shown(r) == kind]
            if not idx:
                continue
            part = [requests[i] for i in idx]
            got = self._generate(part) if self.mode == "generate" else self._constrained(part)
            for i, rep in zip(idx, got, strict=True):
                out[i] = rep
        return out  # type: ignore[return-value]

    def _constrained(self, reqs: list[Request]) -> list[Reply]:
        prompts = [self.prompt_text(r) for r in reqs]
        conts = self.letter_ids(prompts, [r.letters for r in reqs])
        if all(c is not None and len(c) == 1 for cs in conts for c in cs):
            scores = self._last_position(prompts, reqs, conts)
        else:
            scores = self._full_sequences(prompts, reqs, conts)
        return [Reply(choice=max(range(len(s)), key=lambda j, s=s: (s[j], -j)), scores=tuple(s))
                for s in scores]

    def _last_position(self, prompts, reqs, conts) -> list[list[float]]:
        import torch

        enc = self.encode(prompts, reqs, "right")
        with torch.inference_mode():
            logits = self.model(**enc).logits
        last = enc["attention_mask"].sum(dim=1) - 1
        logp = torch.log_softmax(logits[torch.arange(logits.shape[0]), last].float(), dim=-1)
        return [[float(logp[b, c[0]]) for c in cs] for b, cs in enumerate(conts)]

    def _full_sequences(self, prompts, reqs, conts) -> list[list[float]]:
        """Each prompt+letter scored whole; the letter's tokens are the last real ones."""
        import torch

        texts, shown, spans = [], [], []
        for p, r, cs in zip(prompts, reqs, conts, strict=True):
            for L, ids in zip(r.letters, cs, strict=True):
                if ids is None:
                    raise ConfigError(f"model {self.name}: option letter {L!r} merges with the prompt's last token")
                texts.append(p + L)
                shown.append(r)
                spans.append(len(ids))
        enc = self.encode(texts, shown, "right")
        with torch.inference_mode():
            logp = torch.log_softmax(self.model(**enc).logits.float(), dim=-1)
        ends = enc["attention_mask"].sum(dim=1)
        flat = []
        for b, k in enumerate(spans):
            pos = torch.arange(int(ends[b]) - k, int(ends[b]))
            tgt = enc["input_ids"][b, pos]
            flat.append(float(logp[b, pos - 1, tgt].sum()))
        out, at = [], 0
        for r in reqs:
            out.append(flat[at: at + len(r.letters)])
            at += len(r.letters)
        return out

    def _generate(self, reqs: list[Request]) -> list[Reply]:
        import torch

        enc = self.encode([self.prompt_text(r) for r in reqs], reqs, "left")
        with torch.inference_mode():
            gen = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False)
        new = gen[:, enc["input_ids"].shape[1]:]
        texts = self.tok.batch_decode(new, skip_special_tokens=True)
        return [Reply(text=t) for t in texts]

    def close(self) -> None:
        self.model = None


def load_hf(rest: str, options: BackendOptions) -> HFBackend:
    return HFBackend(rest, options)
