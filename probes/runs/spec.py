"""A run is one object: :class:`RunSpec`, shared by ``fit``, ``sweep`` and ``eval``.

A run spec is frozen and JSON-serialisable (:meth:`RunSpec.to_dict`,
:meth:`RunSpec.from_dict`): what is trained (``probe``, ``head`` and its options), on
what (``features``: a feature cache; ``data``: its build; ``layer``), how
(:class:`~spar_bench.probes.train.TrainConfig`, ``seed``, ``train_mirrors``) and how it
is scored (``controls``, ``n_boot``). ``spar-probe fit`` makes one per probe x seed,
``spar-probe sweep`` one per probe x head x seed x grid point, both from the same
options (:data:`OPTIONS`); each run writes it to its ``config.json`` under ``"run"``, and
``spar-probe eval`` rebuilds the head from it. Runs of other kinds (finetuning an
encoder, asking an MLLM) extend it with their own fields.

Options that change the trained head and differ from their defaults name the run's
folder: ``OUT/<encoder>/<probe>/<head>[,<key>=<value>...]/seed<k>`` (:meth:`RunSpec.variant`),
so the points of a grid never overwrite each other, and a run with default options keeps
the plain ``<head>`` folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from spar_bench.errors import ConfigError

from ..tasks import get_probe
from ..train import TrainConfig
from .store import run_folder, variant_text


def proj_width(text: str | int) -> int | str:
    """A ``proj_dim`` value: a PCA width >= 1, or ``"none"`` (also ``0``): no PCA."""
    t = str(text).strip().lower()
    if t in ("none", "0"):
        return "none"
    if not t.isdigit():
        raise ValueError(f"expected a width >= 1 or 'none', got {text!r}")
    return int(t)


proj_width.__name__ = "width >= 1 or none"


@dataclass(frozen=True)
class Option:
    """One run option: where it goes (``train``, ``head`` or ``run``) and its type."""

    name: str
    where: str
    type: type
    help: str


#: Every option a run takes, by the name used in ``--grid KEY=...`` (CLI flag: ``--key-name``).
OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("lr", "train", float, "Learning rate (AdamW)."),
    Option("weight_decay", "train", float, "Weight decay (AdamW)."),
    Option("batch_size", "train", int, "Items per batch."),
    Option("max_epochs", "train", int, "Hard ceiling on epochs; early stopping (--patience) ends runs before it."),
    Option("patience", "train", int, "Early-stopping patience in epochs."),
    Option("val_fraction", "train", float, "Held-out share of train patients without a val split."),
    Option("sinkhorn_iters", "train", int, "Sinkhorn iterations of the Level 2 loss."),
    Option("grad_clip", "train", float, "Gradient-norm clip, 0 = none."),
    Option("proj_dim", "head", proj_width, "Token heads: width of the fixed PCA projection, or 'none' "
                                          "(no PCA: every channel, centred and scaled)."),
    Option("d_model", "head", int, "Token heads: model width."),
    Option("n_layers", "head", int, "transformer: layers."),
    Option("n_heads", "head", int, "Token heads: attention heads."),
    Option("hidden", "head", int, "mlp: hidden width."),
    Option("dropout", "head", float, "mlp and token heads: dropout."),
    Option("q_dim", "head", int, "Pooled heads: width of each question embedding."),
    Option("layer", "run", int, "Cached layer to read."),
    Option("train_mirrors", "run", bool, "Also train on mirrored counterfactual samples."),
)}  # fmt: skip
ALIASES = {"wd": "weight_decay", "layers": "n_layers", "epochs": "max_epochs"}


def option_help(opt: Option) -> str:
    """``opt.help`` with the option's default where it is declared: :class:`TrainConfig` (a
    train option), the head classes' ``DEFAULTS`` (a head option) or :class:`RunSpec`.

    A head option's defaults import the head classes (torch): the CLI asks for this text only
    when ``--help`` shows it (:class:`~spar_bench.clitools.LazyHelpOption`).
    """
    if opt.where == "train":
        default = getattr(TrainConfig(), opt.name)
    elif opt.where == "head":
        default = head_option_defaults(opt.name)
    else:
        default = None if opt.type is bool else RunSpec.__dataclass_fields__[opt.name].default
    return opt.help if default is None else f"{opt.help} [default: {default}]"


def head_option_defaults(name: str) -> str:
    """Head option ``name``'s default from the head classes' ``DEFAULTS``: ``128``, or per head
    where they differ (``64 transformer, 128 attnpool/coordpool``)."""
    from ..heads import HEADS, head_defaults

    by_value: dict[Any, list[str]] = {}
    for head in HEADS.names():
        if name in head_defaults(head):
            by_value.setdefault(head_defaults(head)[name], []).append(head)
    if len(by_value) == 1:
        return str(next(iter(by_value)))
    return ", ".join(f"{value} {'/'.join(heads)}" for value, heads in by_value.items())


class NamedRun:
    """What every run kind's spec shares (:class:`RunSpec`, :class:`PredictorSpec`,
    :class:`~spar_bench.probes.finetune.config.FinetuneSpec`,
    :class:`~spar_bench.probes.vqa.predictor.MllmSpec`): its ``kind``, ``probe`` and ``seed``, the
    options that name its folder (:meth:`variant`), the head it names (:meth:`head_name`), and from
    them its folder (:meth:`slug`, :meth:`run_dir`) and the naming part of its identity
    (:meth:`identity`). What the spec cannot know before its inputs are opened (the model's
    published name, the build's fingerprint) is given as ``model`` here and added by the record
    (:class:`~.record.RunRecord`)."""

    kind: ClassVar[str]
    probe: str
    seed: int

    def variant(self) -> str:
        """``k=v,...``: the options that change the run, differ from their defaults and are named
        neither by the model nor by the head ("" for none)."""
        return ""

    def head_name(self) -> str:
        """The run's head as its folder names it (``mlp``, ``prior``, ``vqa-loglik``)."""
        return self.head  # type: ignore[attr-defined]

    def slug(self, model: str) -> str:
        """``<model>/<probe>/<head>[,variant]/seed<k>``: the run's folder under OUT."""
        return self.run_dir("", model).as_posix()

    def run_dir(self, out: str | Path, model: str) -> Path:
        """``OUT/<model>/<probe>/<head>[,variant]/seed<k>``."""
        return run_folder(out, model, self.probe, self.head_name(), self.variant(), self.seed)

    def identity(self, model: str) -> dict[str, Any]:
        """The fields that name the run: two specs with equal identities write one folder."""
        return {"kind": self.kind, "model": model, "probe": self.probe, "head": self.head_name(),
                "variant": self.variant(), "seed": self.seed}


@dataclass(frozen=True)
class RunSpec(NamedRun):
    """One run: probe x head (+ options) x seed on one feature cache.

    ``features`` is the feature cache the head reads; a run that encodes images itself
    (``spar-probe finetune``) records its build there and keeps its encoder's settings
    beside the spec.
    """

    kind: ClassVar[str] = "head"  # the run kind (spar_bench.probes.kinds.RUN_KINDS)

    features: str
    probe: str
    head: str = "mlp"
    seed: int = 0
    layer: int = -1
    data: str | None = None
    head_options: tuple[tuple[str, Any], ...] = ()
    train: TrainConfig = field(default_factory=TrainConfig)
    controls: bool = True
    train_mirrors: bool = False
    n_boot: int = 1000
    preset: str | None = None  # a --preset that filled options (spar_bench.presets); never changes the head
    preset_overridden: tuple[str, ...] = ()  # the preset's options given explicitly instead

    def __post_init__(self) -> None:
        from ..heads import head_defaults

        get_probe(self.probe)
        defaults = head_defaults(self.head)
        unknown = sorted(set(dict(self.head_options)) - set(defaults))
        if unknown:
            raise ConfigError(f"head {self.head!r} has no option(s) {unknown}; options: {sorted(defaults)}")
        object.__setattr__(self, "head_options", tuple(sorted(dict(self.head_options).items())))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if self.n_boot < 1:
            raise ConfigError(f"--bootstrap must be at least 1, got {self.n_boot}")

    @property
    def head_config(self) -> dict[str, Any]:
        return dict(self.head_options)

    @property
    def spec(self):
        """The probe's :class:`~spar_bench.probes.tasks.ProbeSpec`."""

        return get_probe(self.probe)

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; :meth:`from_dict` gives the same spec back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["head_options"] = dict(self.head_options)
        d["train"] = self.train.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"run spec has unknown field(s) {unknown}; known: {sorted(names)}")
        kw = dict(d)
        kw["head_options"] = tuple(sorted((kw.get("head_options") or {}).items()))
        kw["train"] = TrainConfig(**kw.get("train", {}))
        kw["preset_overridden"] = tuple(kw.get("preset_overridden") or ())
        return cls(**kw)

    # ------------------------------------------------------------------ naming
    def variant(self) -> str:
        """The options that change the trained head and differ from their defaults: ``k=v,...``."""
        from ..heads import head_defaults

        base = RunSpec(self.features, self.probe, self.head)
        changed = {k: v for k, v in self.head_options if head_defaults(self.head)[k] != v}
        for f in dataclasses.fields(TrainConfig):
            v = getattr(self.train, f.name)
            if f.name != "device" and v != getattr(base.train, f.name):
                changed[f.name] = v
        for name in ("layer", "train_mirrors"):
            if getattr(self, name) != getattr(base, name):
                changed[name] = getattr(self, name)
        return variant_text(changed)


@dataclass(frozen=True)
class PredictorSpec(NamedRun):
    """A run of a predictor that reads a build, not a feature cache (a reference predictor such
    as the constant prior, the oracles, 3-D organ maps; run by :func:`~.session.run`).

    It has what the evaluation and the split rule read of a :class:`RunSpec` (``probe``,
    ``seed``, ``controls``, ``n_boot``, ``train_mirrors``, ``train.val_fraction``); ``head``
    names the predictor in the run folder (``prior``, ``mllm``) and ``features`` the build it reads.
    """

    probe: str
    head: str
    seed: int = 0
    features: str = ""
    controls: bool = True
    train_mirrors: bool = False
    n_boot: int = 1000
    train: TrainConfig = field(default_factory=TrainConfig)
    ci_min_patients: int = 1  # fewer patients: no interval (``null``; an MLLM's runs: 2)
    #: the kind's own options (``predictors.NAME.options``; e.g. ``organmaps3d``'s training)
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_probe(self.probe)
        if self.n_boot < 1:
            raise ConfigError(f"--bootstrap must be at least 1, got {self.n_boot}")

    @property
    def spec(self):
        return get_probe(self.probe)

    @property
    def kind(self) -> str:
        """The run kind: the predictor ``head`` names (``prior``, ``oracle``)."""
        return self.head

    def to_dict(self) -> dict[str, Any]:
        return {"probe": self.probe, "head": self.head, "seed": self.seed, "features": Path(self.features).name,
                "controls": self.controls, "train_mirrors": self.train_mirrors, "n_boot": self.n_boot,
                "val_fraction": self.train.val_fraction,
                **({"options": {k: v for k, v in self.options.items() if k not in ("device", "threads")}} if self.options else {})}  # fmt: skip


# ---------------------------------------------------------------------- options
def option_name(key: str) -> str:
    """The canonical option name of ``key`` (``wd`` -> ``weight_decay``); unknown keys suggest."""
    k = key.strip().replace("-", "_")
    k = ALIASES.get(k, k)
    if k not in OPTIONS:
        close = difflib.get_close_matches(k, [*OPTIONS, *ALIASES], n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"unknown run option {key!r}.{hint} Options: {', '.join(OPTIONS)}")
    return k


def parse_value(name: str, text: str) -> Any:
    """``text`` as the type of option ``name`` (``--grid`` values)."""
    opt = OPTIONS[name]
    t = text.strip()
    if opt.type is bool:
        if t.lower() in ("1", "true", "yes", "on"):
            return True
        if t.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true/false, got {text!r}")
    try:
        return opt.type(t)
    except ValueError:
        raise ConfigError(f"{name}: expected {opt.type.__name__}, got {text!r}") from None


def parse_grid(items: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """``("lr=1e-3,3e-4", "wd=0,0.01")`` -> the 4 option dicts of the cartesian product."""
    axes: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values.strip():
            raise ConfigError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. lr=1e-3,3e-4)")
        name = option_name(key)
        if name in axes:
            raise ConfigError(f"--grid names {name!r} twice")
        axes[name] = [parse_value(name, v) for v in values.split(",") if v.strip()]
    return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


def make_run(features: str, probe: str, head: str, seed: int, options: dict[str, Any], *,
             data: str | None = None, controls: bool = True, n_boot: int = 1000,
             device: str = "cpu", strict: bool = True) -> RunSpec:  # fmt: skip
    """A :class:`RunSpec` from option values (``None`` = default).

    Head options the head does not have are an error when ``strict`` (``fit``: one head),
    and skipped otherwise (``sweep``: they apply to the heads that have them; see
    :func:`check_options_apply`).
    """
    from ..heads import head_defaults

    train, head_opts, run = {"device": device}, {}, {}
    for key, value in options.items():
        if value is None:
            continue
        name = option_name(key)
        where = OPTIONS[name].where
        if where == "head" and name not in head_defaults(head):
            if strict:
                raise ConfigError(f"--{name.replace('_', '-')}: head {head!r} has no option {name!r}; "
                                  f"its options: {', '.join(sorted(head_defaults(head)))}")  # fmt: skip
            continue
        {"train": train, "head": head_opts, "run": run}[where][name] = value
    return RunSpec(features=str(features), probe=probe, head=head, seed=seed, data=data,
                   head_options=tuple(head_opts.items()), train=TrainConfig(**train),
                   controls=controls, n_boot=n_boot, **run)  # fmt: skip


def check_options_apply(heads: list[str], options: dict[str, Any]) -> None:
    """Every head option set must belong to at least one of ``heads``."""
    from ..heads import head_defaults

    have = set().union(*(head_defaults(h) for h in heads))
    for key, value in options.items():
        name = option_name(key)
        if value is not None and OPTIONS[name].where == "head" and name not in have:
            raise ConfigError(f"--{name.replace('_', '-')}: none of the heads {', '.join(heads)} has it")


def with_preset(run: RunSpec, record: dict | None) -> RunSpec:
    """``run`` marked with the preset that filled its options (recorded in config.json's ``run``)."""
    if record is None:
        return run
    return run.replace(preset=record["name"], preset_overridden=tuple(record["overridden"]))
