"""Settings of an encoder-training run and its learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from spar_bench.errors import ConfigError
from spar_bench.fields import check_fields, limited

from ..hardware import COMPUTE_DTYPES
from ..heads import head_defaults
from ..names import parse_heads, parse_probes, parse_seeds
from ..runs.spec import NamedRun, RunSpec, check_options_apply
from ..runs.store import variant_text
from ..train import TrainConfig

#: Options that change no trained weight or score beyond the device's numerics: not in a
#: run's folder name nor in the identity a finished run is checked against (the precision
#: itself is, as ``compute_dtype``).
NOT_NAMED = frozenset({"device", "compute", "workers", "checkpoint_every"})


@dataclass(frozen=True)
class FinetuneConfig:
    """How the encoder and the head train together (recorded in every run's ``config.json``).

    Batches are counted in IMAGES (Level 3: slices, each with all its questions); one
    optimizer step every ``accum`` batches. The learning rate warms up linearly for
    ``warmup_epochs`` then decays along a cosine to 0 at ``max_epochs`` (early stopping
    may end a run sooner; the schedule does not depend on it).
    """

    encoder_lr: float = limited(1e-4, help="Encoder learning rate (AdamW; 0: a frozen encoder).")
    head_lr: float = limited(1e-3, help="Head learning rate (AdamW).")
    weight_decay: float = limited(0.05, help="Weight decay (AdamW).")
    batch_size: int = limited(32, help="Images per batch.")
    accum: int = limited(1, help="Batches per optimizer step.")
    max_epochs: int = limited(20, help="Epochs of the cosine schedule (early stopping may end a run sooner).")
    warmup_epochs: float = limited(1.0, help="Epochs of linear learning-rate warm-up.")
    patience: int = limited(5, help="Early stopping on the validation loss.")
    freeze_blocks: int = limited(0, help="Freeze the stem and the first N blocks.")
    grad_clip: float = limited(1.0, help="Gradient-norm clip, 0 = none.")
    sinkhorn_iters: int = limited(20, help="Sinkhorn iterations of the Level 2 loss.")
    val_fraction: float = limited(0.15, help="Held-out share of train patients without a val split.")
    layer: int = limited(-1, help="Encoder layer whose tokens the head reads.")
    device: str = "auto"
    compute: str = limited("auto", choices=COMPUTE_DTYPES)
    workers: int | None = limited(None, lo=0, flag="--loader-workers")
    checkpoint_every: int = limited(0, help="Also checkpoint every N optimizer steps (0: at epoch ends only).")

    def __post_init__(self) -> None:
        for name in ("batch_size", "accum", "max_epochs"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.encoder_lr < 0 or self.head_lr <= 0:
            raise ConfigError("learning rates must be positive (--encoder-lr may be 0: a frozen encoder)")
        if self.warmup_epochs < 0 or self.freeze_blocks < 0 or self.patience < 1:
            raise ConfigError("--warmup-epochs and --freeze-blocks must be >= 0, --patience >= 1")
        check_fields(self)

    def to_dict(self) -> dict:
        return asdict(self)

    def changed(self) -> dict:
        """The options that change the trained run and differ from their defaults (they name
        the run's folder); where and how it runs (:data:`NOT_NAMED`) is left out."""
        base = FinetuneConfig()
        return {k: v for k, v in self.to_dict().items() if k not in NOT_NAMED and v != getattr(base, k)}

    def train_config(self):
        """The head-training config of ``spar-probe fit`` matching this run (blind baseline)."""

        return TrainConfig(lr=self.head_lr, weight_decay=0.01, batch_size=256, max_epochs=None,
                           sinkhorn_iters=self.sinkhorn_iters, val_fraction=self.val_fraction)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class FinetuneSpec(NamedRun):
    """One finetune run: ``encoder`` (its ``weights``, ``init``, constructor ``model_kwargs`` and hub
    ``revision``) trained end to end with ``head`` (``head_cfg``) on ``probe`` of build ``data``
    (``seed``, :class:`FinetuneConfig`), scored like a head run (``n_boot``, ``controls``,
    ``train_mirrors``). Its head's part is a :class:`~spar_bench.probes.runs.spec.RunSpec`
    (:meth:`head_run`), whose features are the build's images, encoded by the trained encoder.
    """

    kind: ClassVar[str] = "finetune"  # the run kind (spar_bench.probes.kinds.RUN_KINDS)

    encoder: str
    data: str
    probe: str
    head: str = "mlp"
    seed: int = 0
    weights: str | None = None
    init: str = limited("weights", choices=("weights", "scratch"))
    model_kwargs: dict[str, Any] | None = None
    revision: str | None = None
    cfg: FinetuneConfig = field(default_factory=FinetuneConfig)
    head_cfg: dict[str, Any] = field(default_factory=dict)
    n_boot: int = 1000
    controls: bool = True
    train_mirrors: bool = False

    def __post_init__(self) -> None:
        check_fields(self)

    def variant(self) -> str:
        """The training and head options that differ from their defaults (as ``fit``'s
        :meth:`~..runs.spec.RunSpec.variant`): ``encoder_lr=0.01,max_epochs=2``."""

        changed = {**self.cfg.changed(),
                   **{k: v for k, v in self.head_cfg.items() if head_defaults(self.head).get(k) != v}}  # fmt: skip
        return variant_text({**changed, **({"train_mirrors": True} if self.train_mirrors else {})})

    def head_run(self):
        """The head's :class:`~spar_bench.probes.runs.spec.RunSpec` (as ``fit``'s)."""

        return RunSpec(features=str(self.data), probe=self.probe, head=self.head, seed=self.seed,
                       layer=self.cfg.layer, head_options=tuple(self.head_cfg.items()),
                       train=self.cfg.train_config(), controls=self.controls,
                       train_mirrors=self.train_mirrors, n_boot=self.n_boot)  # fmt: skip


def finetune_specs(encoder: str, data: str, probes: Sequence[str] | str, heads: Sequence[str] | str,
                   seeds: Sequence[int] | str, head_options: dict[str, Any] | None = None,
                   **spec: Any) -> list[list[FinetuneSpec]]:
    """The runs of one ``spar-probe finetune`` (an experiment's ``finetune:``/``scratch:`` step):
    per probe (``all``: every probe), its head x seed :class:`FinetuneSpec`, each with ``spec``
    (its other fields: ``cfg``, ``weights``, ``init`` ...); names checked. ``head_options``
    (``d_model`` ...; None: not given) apply as ``fit`` and ``sweep`` apply them: an option none
    of the heads has is one line; one that only some have applies to those."""

    head_list, seed_list = parse_heads(heads), parse_seeds(seeds)
    given = {k: v for k, v in (head_options or {}).items() if v is not None}
    check_options_apply(head_list, given)
    cfgs = {h: {k: v for k, v in given.items() if k in head_defaults(h)} for h in head_list}
    return [[FinetuneSpec(encoder, str(data), p, h, s, head_cfg=cfgs[h], **spec) for h in head_list
             for s in seed_list] for p in parse_probes(probes)]  # fmt: skip
