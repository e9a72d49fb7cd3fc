"""The encoder interface shared by every family: a JSON spec, preprocessing and token extraction.

An :class:`Encoder` turns a batch of grey ``uint8`` images ``(B, 224, 224)`` into, per requested
layer, ``tokens (B, T, D)`` and ``pooled (B, D)``. A 3-D (volumetric) encoder, one whose spec has a
3-entry ``input_size`` (:attr:`EncoderSpec.volumetric`), takes ``uint8`` volumes ``(B, S, S, S)``
(Level 4) instead; its token grids ``(B, D', H', W', C)`` are flattened z-major to ``(B, T, C)``
and the grid of each layer is recorded in ``spec.extra["layer_grids"]``. Everything a report needs to say what the
features are (weights, random init, preprocessing, token layout) lives in its :class:`EncoderSpec`.

Torch is imported inside functions only: ``spar-probe --help`` must stay cheap.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_file

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: How a pooled vector is made from a layer's tokens.
POOLED_KINDS = ("cls", "mean-patch", "avgpool", "first")

#: metadata key of a SPAR-Bench encoder export in its safetensors header (a JSON object:
#: the encoder spec, timm ``model_args`` and ``training``, how the weights were trained).
EXPORT_META_KEY = "spar_bench"

#: ImageNet statistics, the default of timm and most encoders.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class EncoderSpec:
    """Everything that defines an encoder's features. JSON-serialisable (``to_json``).

    Frozen: a loader that learns a field by running the network (token grid, width) makes a
    new spec with :func:`dataclasses.replace` and gives it to the encoder.

    ``n_prefix`` tokens (CLS, registers) come first, then ``grid[0] * grid[1]`` patch tokens
    in row-major order (a CNN feature map flattened the same way, with ``n_prefix = 0``).
    A 3-D encoder has ``input_size`` ``(S, S, S)`` and ``grid`` ``(D', H', W')`` (layer -1's;
    ``extra["layer_grids"]`` has every layer's), its patch tokens in row-major (z, row, col)
    order.
    ``weights`` is ``{"kind": "file"|"dir", "name", "sha256"}`` (a local file or folder by its
    base name and content hash, never its path: :func:`weights_record`), ``{"kind": "hub",
    "repo", "revision"}``, ``{"kind": "builtin"}`` or ``{"kind": "random-init"}``. ``name`` of
    an encoder loaded from a local path is portable too (:func:`local_name`).
    """

    name: str
    family: str
    input_size: tuple[int, ...] = (224, 224)  # (S, S, S) for a 3-D encoder
    in_chans: int = 3
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    interpolation: str = "bilinear"
    patch_size: int | None = None  # ViT patch size, or CNN feature stride
    n_prefix: int = 0
    grid: tuple[int, ...] | None = None
    dim: int | None = None
    pooled: str = "mean-patch"
    n_layers: int | None = None  # number of selectable intermediate layers
    weights: dict[str, Any] = field(default_factory=lambda: {"kind": "random-init"})
    random_init: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int | None:
        if self.grid is None:
            return None
        return self.n_prefix + math.prod(self.grid)

    @property
    def volumetric(self) -> bool:
        """Whether this is a 3-D encoder: it takes ``uint8 (B, S, S, S)`` volumes (Level 4)."""
        return len(self.input_size) == 3

    def layer_grid(self, layer: int) -> tuple[int, ...] | None:
        """The token grid of ``layer`` (a 3-D encoder's ``layer_grids``; else ``grid``)."""
        grids = self.extra.get("layer_grids") or {}
        got = grids.get(str(int(layer)))
        return tuple(int(g) for g in got) if got is not None else self.grid

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["input_size"] = list(self.input_size)
        d["grid"] = list(self.grid) if self.grid is not None else None
        d["mean"], d["std"] = list(self.mean), list(self.std)
        d["n_tokens"] = self.n_tokens
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def preprocessing(self) -> dict[str, Any]:
        """The preprocessing, as recorded in a cache."""
        if self.volumetric:
            return {
                "input": "uint8 volume (B, S, S, S) (z, row, col) -> float [0, 1]",
                "channels": self.in_chans,
                "resize_to": list(self.input_size),
                "interpolation": "trilinear (align_corners=False, no antialiasing)",
                "crop": "none",
                "mean": list(self.mean),
                "std": list(self.std),
            }
        return {
            "input": "uint8 grey (B, 224, 224) -> float [0, 1]",
            "channels": self.in_chans,
            "resize_to": list(self.input_size),
            "interpolation": self.interpolation,
            "crop": "none (a mosaic must not lose tiles)",
            "mean": list(self.mean),
            "std": list(self.std),
        }


def require_extra(module: str, extra: str) -> Any:
    """Import an optional dependency, or raise a one-line :class:`ConfigError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"this encoder needs the optional package {module!r} ({e}); "
            f"install it with: pip install 'spar-bench[{extra}]'"
        ) from None


class WeightsGiven(ConfigError):
    """A random initialisation was asked of an encoder whose ``source`` holds its weights.

    The message speaks of ``--random-init`` (``spar-probe cache``); ``spar-probe finetune``
    says ``--init scratch`` instead (:meth:`for_flag`).
    """

    def __init__(self, name: str, source: str, flag: str = "--random-init"):
        self.name, self.source = name, source
        super().__init__(f"encoder {name}: {source} holds the weights; drop {flag}, or point at a "
                         "folder without a checkpoint to build its architecture from random weights")

    def for_flag(self, flag: str) -> WeightsGiven:
        return WeightsGiven(self.name, self.source, flag)


def local_name(prefix: str, path: str | Path, sha256: str) -> str:
    """The portable encoder name of a model loaded from the local ``path``:
    ``prefix + <base name>@<first 8 hex of sha256>`` (``hf:tiny_dinov2@1a2b3c4d``).

    The same content gives the same name wherever it lies; two models with one folder name
    but other content get two names (and two run folders). Users pass the path again.
    """
    return f"{prefix}{Path(path).resolve().name}@{sha256[:8]}"


_LOCAL_NAME = re.compile(r"[^/\\]+@[0-9a-f]{8}")


def is_local_name(name: str) -> bool:
    """Whether ``name`` is a portable name of a local model (:func:`local_name`): loading it
    again needs its path (``hf:DIR``, ``open_clip:local-dir:DIR``, ``torchscript:FILE``)."""
    rest = name.partition(":")[2]
    return bool(_LOCAL_NAME.fullmatch(rest.removeprefix("local-dir:")))


def published_name(name: str, weights: dict[str, Any] | None = None) -> str:
    """``name`` as published: an encoder name that holds a local path (caches and runs made
    before names were portable: ``hf:/home/me/tiny``, ``open_clip:local-dir:/x/m``,
    ``torchscript:/x/m.pt``) becomes ``<family>:<base name>[@sha8]``, the hash taken from its
    recorded ``weights``; any other name is returned as is."""
    family, _, rest = name.partition(":")
    prefix = f"{family}:"
    if family == "open_clip" and rest.startswith("local-dir:"):
        prefix, rest = "open_clip:local-dir:", rest[len("local-dir:"):]
    elif family == "hf":
        pathlike = rest.startswith(("/", ".", "~", "\\")) or re.match(r"[A-Za-z]:[/\\]", rest)
        hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", rest)
        if not (pathlike or ((weights or {}).get("kind") == "dir" and not hub_id)):
            return name  # a hub id (org/repo)
    elif family != "torchscript":
        return name
    if not rest or _LOCAL_NAME.fullmatch(rest):
        return name
    base = re.split(r"[/\\]", rest.rstrip("/\\"))[-1] or "model"
    sha = (weights or {}).get("sha256")
    return f"{prefix}{base}@{sha[:8]}" if isinstance(sha, str) and sha else f"{prefix}{base}"


def published_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """A weights record without a local path: an older record's ``path`` becomes ``name``
    (its base name; the sha256 identifies the content)."""
    out = {k: v for k, v in weights.items() if k != "path"}
    if isinstance(weights.get("path"), str):
        out.setdefault("name", re.split(r"[/\\]", weights["path"].rstrip("/\\"))[-1])
    return out


def weights_record(weights: str | Path | None, random_init: bool, name: str) -> dict[str, Any]:
    """The ``weights`` entry of a spec for a local weights file/dir, or random init.

    A file or folder is recorded by its base ``name`` and ``sha256`` (never its path: the
    record is published in caches and runs). Raises :class:`ConfigError` when neither
    weights nor ``--random-init`` were given, so random features can never be produced by
    accident.
    """
    if weights is not None:
        if random_init:
            raise ConfigError(f"encoder {name}: pass either --weights or --random-init, not both")
        p = Path(weights)
        if not p.exists():
            raise ConfigError(f"encoder {name}: weights {p} do not exist")
        ident = {"name": p.resolve().name, "sha256": sha256_file(p)}
        if p.is_dir():
            return {"kind": "dir", **ident}
        record = {"kind": "file", **ident}
        meta = read_export_meta(p)
        if meta and meta.get("training"):
            record["training"] = meta["training"]  # e.g. trained from scratch on build X
        return record
    if not random_init:
        raise ConfigError(
            f"encoder {name}: no weights given; pass --weights PATH (or a pinned hub revision) "
            "or, to probe a randomly initialised network on purpose, --random-init"
        )
    return {"kind": "random-init"}  # built under torch.manual_seed(RANDOM_INIT_SEED) by load_encoder


def read_export_meta(path: str | Path) -> dict[str, Any] | None:
    """The SPAR-Bench metadata (``EXPORT_META_KEY``) of an exported ``.safetensors`` file, or None."""
    p = Path(path)
    if p.suffix != ".safetensors" or not p.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            raw = (f.metadata() or {}).get(EXPORT_META_KEY)
        return json.loads(raw) if raw else None
    except Exception:  # noqa: BLE001 - a foreign or corrupt file carries no SPAR-Bench metadata
        return None


def load_state_dict_file(path: str | Path) -> dict[str, Any]:
    """Load a ``.safetensors`` / ``.pth`` / ``.bin`` / ``.pt`` state dict (unwrapping
    ``{"state_dict": ...}`` / ``{"model": ...}``)."""
    import torch

    p = Path(path)
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p), device="cpu")
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - corrupt or foreign files
        raise ConfigError(f"cannot read weights {p}: {type(e).__name__}: {e}") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise ConfigError(f"weights {p} do not hold a state dict (got {type(sd).__name__})")
    return sd


def check_export(path: str | Path, meta: dict[str, Any] | None, name: str, family: str,
                 module: str = "model") -> None:
    """Refuse a ``spar-probe finetune`` export (its header ``meta``) made for another encoder
    family or another part of the model than ``module``, the part ``name`` loads it into.

    Exports written before the part was recorded carry no ``module``: their weight keys decide.
    """
    if not meta:
        return
    made_by = meta.get("encoder", "?")
    theirs = meta.get("family") or (meta.get("encoder_config") or {}).get("family")
    if theirs and theirs != family:
        raise ConfigError(
            f"{path}: an export of the {theirs} encoder {made_by}, not of a {family} encoder as {name}; "
            f"re-cache it with --encoder {made_by}"
            + (" (its path: a local model's name records none)" if is_local_name(str(made_by)) else "")
        )
    part = meta.get("module")
    if part and part != module:
        raise ConfigError(
            f"{path}: holds the weights of {made_by}'s {part!r}, but {name} loads its {module!r} "
            "(another tower); re-cache it with the encoder the run trained"
        )


def load_into(module: torch.nn.Module, sd: dict[str, Any], path: str | Path, name: str) -> None:
    """Strictly load ``sd`` (a classifier head the encoder does not have may be missing)."""
    own = module.state_dict()
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    unexpected = [k for k in sd if k not in own]
    head = [k for k in unexpected if k.split(".")[0] in ("head", "fc", "classifier", "last_linear")]
    sd = {k: v for k, v in sd.items() if k not in head}
    shapes = [k for k, v in sd.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if shapes:
        k = shapes[0]
        raise ConfigError(
            f"encoder {name}: weights {path} do not fit the model ({len(shapes)} tensors of another "
            f"shape, e.g. {k}: {tuple(sd[k].shape)} in the file, {tuple(own[k].shape)} in the model)"
        )
    missing, unexpected = module.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"encoder {name}: weights {path} do not fit the model "
            f"(missing {len(missing)} e.g. {missing[:3]}, unexpected {len(unexpected)} e.g. {unexpected[:3]})"
        )


def pool_tokens(tokens: torch.Tensor, pooled: str, n_prefix: int) -> torch.Tensor:
    """``(B, T, D) -> (B, D)`` by the spec's pooled-vector definition."""
    if pooled in ("cls", "first"):
        return tokens[:, 0]
    if pooled == "mean-patch":
        return tokens[:, n_prefix:].mean(dim=1)
    if pooled == "avgpool":
        return tokens.mean(dim=1)
    raise ValueError(f"unknown pooled kind {pooled!r}; expected one of {POOLED_KINDS}")


def nchw_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """A CNN feature map ``(B, C, H, W)`` as ``(B, H*W, C)`` tokens, row-major."""
    return x.flatten(2).transpose(1, 2)


def ncdhw_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """A 3-D feature map ``(B, C, D, H, W)`` as ``(B, D*H*W, C)`` tokens, row-major (z slowest)."""
    return x.flatten(2).transpose(1, 2)


def volume_grids(outs: dict[int, Any]) -> dict[str, list[int]]:
    """``{str(layer): [D', H', W']}`` of 3-D feature maps ``(B, C, D', H', W')`` (the spec's
    ``extra["layer_grids"]``)."""
    return {str(v): [int(g) for g in t.shape[2:]] for v, t in outs.items()}


class Encoder:
    """A loaded encoder: preprocessing + ``forward(images, layers)``.

    Subclasses implement :meth:`_layer_tokens`. ``layers`` are indices as the user wrote
    them (``-1`` = the last layer, the default features of the model).
    """

    def __init__(self, spec: EncoderSpec, module: torch.nn.Module):
        self.spec = spec
        self.module = module.eval()
        self.channels_last = False
        for p in self.module.parameters():
            p.requires_grad_(False)

    def use_channels_last(self) -> Encoder:
        """Run a CNN in channels-last memory format (2-3x faster on CPU with bf16)."""
        import torch

        self.module.to(memory_format=torch.channels_last)
        self.channels_last = True
        return self

    def prefer_channels_last(self) -> Encoder:
        """Channels-last for the CNNs of timm and open_clip, where it is faster (on an AVX2 CPU
        in fp32 too: ~1.16x training the calibration's resnet10t at 128 px); others stay as
        they are."""
        if not self.spec.extra.get("vit_like", True) and self.spec.family in ("timm", "open_clip"):
            self.use_channels_last()
        return self

    def to(self, device: torch.device | str) -> Encoder:
        self.module.to(device)
        return self

    @property
    def device(self) -> torch.device:
        import torch

        for p in self.module.parameters():
            return p.device
        return torch.device("cpu")

    def check_layers(self, layers: Sequence[int]) -> list[int]:
        layers = [int(v) for v in layers]
        if not layers:
            raise ConfigError(f"encoder {self.spec.name}: no layers requested")
        n = self.spec.n_layers
        for v in layers:
            if v == -1:
                continue
            if n is None:
                raise ConfigError(
                    f"encoder {self.spec.name}: only layer -1 is available, got {v}"
                )
            if not -n <= v < n:
                raise ConfigError(
                    f"encoder {self.spec.name}: layer {v} out of range; it has {n} layers "
                    f"(use {-n}..{n - 1})"
                )
        if len(set(layers)) != len(layers):
            raise ConfigError(f"encoder {self.spec.name}: layers {layers} repeat an index")
        return layers

    def blank(self, batch: int = 1, device: Any = None) -> torch.Tensor:
        """An all-zero ``uint8`` input of ``batch`` images (``(B, 224, 224)``) or, for a 3-D
        encoder, volumes ``(B, S, S, S)`` at its input size: what a dry forward reads."""
        import torch

        shape = tuple(self.spec.input_size) if self.spec.volumetric else (224, 224)
        return torch.zeros(batch, *shape, dtype=torch.uint8, device=device)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8 (B, H, W)`` (any device) -> normalised float ``(B, C, h, w)``; a 3-D encoder:
        ``uint8 (B, S, S, S)`` -> ``(B, C, s, s, s)`` (:meth:`preprocess_volume`)."""
        import torch
        import torch.nn.functional as F

        if self.spec.volumetric:
            return self.preprocess_volume(images)
        if images.dtype != torch.uint8 or images.ndim != 3:
            raise ValueError(f"expected uint8 (B, H, W) images, got {images.dtype} {tuple(images.shape)}")
        x = images.float().div_(255.0).unsqueeze(1)
        h, w = self.spec.input_size
        if tuple(x.shape[-2:]) != (h, w):
            mode = self.spec.interpolation if self.spec.interpolation in ("bilinear", "bicubic") else "bilinear"
            if self.spec.interpolation == "nearest":
                mode = "nearest"
            kw = {"align_corners": False, "antialias": True} if mode != "nearest" else {}
            x = F.interpolate(x, size=(h, w), mode=mode, **kw)
        x = x.expand(-1, self.spec.in_chans, -1, -1)
        c = self.spec.in_chans
        mean = torch.tensor(_fit(self.spec.mean, c), device=x.device).view(1, c, 1, 1)
        std = torch.tensor(_fit(self.spec.std, c), device=x.device).view(1, c, 1, 1)
        x = (x - mean) / std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def preprocess_volume(self, volumes: torch.Tensor) -> torch.Tensor:
        """``uint8 (B, S, S, S)`` -> float ``(B, C, s, s, s)``: scaled to [0, 1] as the 2-D path
        does, resized trilinearly to ``input_size`` when it differs, normalised by mean/std."""
        import torch
        import torch.nn.functional as F

        if volumes.dtype != torch.uint8 or volumes.ndim != 4:
            raise ValueError(f"encoder {self.spec.name} is 3-D: expected uint8 (B, S, S, S) volumes, "
                             f"got {volumes.dtype} {tuple(volumes.shape)}")
        x = volumes.float().div_(255.0).unsqueeze(1)
        size = tuple(int(v) for v in self.spec.input_size)
        if tuple(x.shape[-3:]) != size:
            x = F.interpolate(x, size=size, mode="trilinear", align_corners=False)
        c = self.spec.in_chans
        x = x.expand(-1, c, -1, -1, -1)
        mean = torch.tensor(_fit(self.spec.mean, c), device=x.device).view(1, c, 1, 1, 1)
        std = torch.tensor(_fit(self.spec.std, c), device=x.device).view(1, c, 1, 1, 1)
        return (x - mean) / std

    def _layer_tokens(self, x: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
        raise NotImplementedError

    def forward(self, images: torch.Tensor, layers: Sequence[int] = (-1,)):
        """``{layer: (tokens (B,T,D), pooled (B,D))}`` for uint8 ``images (B, H, W)``."""
        import torch

        layers = self.check_layers(layers)
        with torch.inference_mode():
            x = self.preprocess(images.to(self.device, non_blocking=True))
            toks = self._layer_tokens(x, layers)
            return {
                v: (toks[v], pool_tokens(toks[v], self.spec.pooled, self.spec.n_prefix))
                for v in layers
            }

    __call__ = forward


def _fit(values: Sequence[float], c: int) -> list[float]:
    values = [float(v) for v in values]
    if len(values) == c:
        return values
    if len(values) == 1:
        return values * c
    if c == 1:
        return [sum(values) / len(values)]
    raise ConfigError(f"mean/std has {len(values)} values but the encoder takes {c} channels")


def encode_tiles(enc: Encoder, mosaics: torch.Tensor, layers: Sequence[int] = (-1,),
                 grid: int = 4) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per-tile encoding of Level 1-2 mosaics: ``{layer: (tokens (B, grid^2 * T, D), pooled (B, grid^2 * D))}``.

    Each mosaic ``(H, W)`` is cut into ``grid x grid`` tiles (tile ``p`` at row ``p // grid``,
    column ``p % grid``, the builder's layout); each tile is resized to the encoder's input
    size by its own preprocessing and encoded alone. Tile ``p``'s ``T`` tokens are rows
    ``p*T .. (p+1)*T - 1`` of the stacked token set; the pooled vector is the tiles' pooled
    vectors side by side in tile order (their mean would not say which tile is where). The
    tiles go through the encoder ``B`` at a time (``grid^2`` forwards of as many images as the
    batch of mosaics), so memory stays that of encoding the mosaics whole.
    """
    import torch

    b, h, w = mosaics.shape
    if h % grid or w % grid:
        raise ValueError(f"a {h}x{w} mosaic does not split into {grid}x{grid} tiles")
    th, tw = h // grid, w // grid
    tiles = mosaics.reshape(b, grid, th, grid, tw).transpose(2, 3).reshape(b * grid * grid, th, tw)
    parts = [enc(tiles[s:s + max(b, 1)], layers) for s in range(0, tiles.shape[0], max(b, 1))]
    out = {}
    for v in parts[0]:
        toks = torch.cat([p[v][0] for p in parts])  # (B * grid^2, T, D), mosaic-major
        pooled = torch.cat([p[v][1] for p in parts])  # (B * grid^2, D)
        out[v] = (toks.reshape(b, -1, toks.shape[-1]), pooled.reshape(b, -1))
    return out


EncoderFactory = Callable[..., Encoder]
"""``factory(rest, *, weights=None, random_init=False, revision=None) -> Encoder``."""


class DummyEncoder(Encoder):
    """Tiny deterministic patch encoder for tests and smoke runs (random-init, no download)."""

    def _layer_tokens(self, x, layers):
        import torch

        m = self.module
        t = m.embed(x).flatten(2).transpose(1, 2)  # (B, 49, D)
        t = torch.cat([t.mean(dim=1, keepdim=True), t], dim=1)  # prefix: a mean "CLS" token
        outs = []
        for blk in m.blocks:
            t = t + torch.tanh(blk(t))
            outs.append(t)
        return {v: outs[v] for v in layers}


def load_dummy(rest: str = "", *, weights: str | None = None, random_init: bool = False,
               revision: str | None = None, dim: int = 16, depth: int = 2) -> DummyEncoder:
    """The ``dummy`` encoder: 32x32 patches of a grey image -> 1 + 7x7 tokens of width 16.

    Its parameters come from ``torch.Generator().manual_seed(0)``: identical everywhere.
    It is always recorded as random-init (its features mean nothing).
    """
    import torch

    if weights is not None:
        raise ConfigError("encoder dummy: takes no --weights (it is a fixed random network)")
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.embed = torch.nn.Conv2d(1, dim, kernel_size=32, stride=32)
    module.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)
    spec = EncoderSpec(
        name="dummy", family="dummy", input_size=(224, 224), in_chans=1, mean=(0.5,), std=(0.25,),
        interpolation="bilinear", patch_size=32, n_prefix=1, grid=(7, 7), dim=dim, pooled="cls",
        n_layers=depth, weights={"kind": "random-init", "note": "fixed seed-0 test network"},
        random_init=True,
    )
    return DummyEncoder(spec, module)
