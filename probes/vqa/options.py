"""One ``spar-probe vqa`` as a library call: its options (:class:`VqaOptions`), checked against
the build, then every question probe asked, one run per probe x seed (:func:`ask_build`: each a
kind ``mllm`` run of :func:`spar_bench.probes.runs.session.execute`), as the CLI and an
experiment's ``vqa:`` step run it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from spar_bench.builder.schema import LEVEL_SPECS
from spar_bench.errors import ConfigError
from spar_bench.fields import check_fields, limited

from ..hardware import COMPUTE_DTYPES, pick_compute, pick_device
from ..names import names_all, parse_seeds, split_list
from ..runs.store import preflight
from ..targets import no_lesions
from ..tasks import get_probe, probe_names
from .base import MODES, BackendOptions
from .cache import ResponseCache, default_cache
from .openai import GUIDED

#: ``--compute`` as an ``hf:`` model's torch dtype (what its runs record as ``decoding.dtype``);
#: the hidden ``--dtype`` (before 0.2) took these names
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def full_probe_name(name: str) -> str:
    """The full name of a short question-probe name: the first level (in registry order) that
    has it (``distance`` is Level 3's; ``adjacency``, ``containment``, ``volume`` are Level 4's)."""

    if "." in name:
        return name
    asking = [p for p in probe_names() if get_probe(p).asks]
    for full in asking:
        if full.split(".", 1)[1] == name:
            return full
    return f"{asking[0].split('.', 1)[0]}.{name}"  # unknown: the registry's error names the close ones


def parse_question_probes(text: tuple[str, ...] | str) -> list[str]:
    """``all`` or question probes (``size`` or ``level3.size``, ``adjacency`` or
    ``level4.adjacency``; repeated or comma-separated), full names."""

    asking = [n for n in probe_names() if get_probe(n).asks]
    if names_all(text):
        return asking
    out = []
    for n in dict.fromkeys(split_list(text)):
        spec = get_probe(full_probe_name(n))
        if not spec.asks:
            raise ConfigError(f"--probe {n}: the MLLM track asks the question probes only "
                              f"({', '.join(asking)})")
        if spec.name not in out:
            out.append(spec.name)
    return out


def options_from(generate: bool, **kw) -> BackendOptions:
    return BackendOptions(mode=MODES[1] if generate else MODES[0], **kw)


def model_placement(model: str, device: str, compute: str) -> dict[str, str]:
    """``--device`` and ``--compute`` as the backend takes them: for an ``hf:`` model (the one
    kind that runs here) a torch device and dtype name, ``auto`` resolved as every command
    resolves it (:func:`~..hardware.pick_device`, :func:`~..hardware.pick_compute`; ``--compute
    fp32`` is ``float32``, as ``--dtype float32`` before); other kinds read neither."""
    if not model.startswith("hf:"):
        return {}

    dev = pick_device(device)
    return {"device": str(dev), "dtype": TORCH_DTYPES[pick_compute(compute, dev).dtype]}


def resolve_image_size(option: str, backend) -> int:
    """``--image-size``: an integer (16..4096), or ``auto`` = the backend's preferred size
    when it is larger than the stored 224 (never a downscale), else 224."""
    if option == "auto":
        return max(224, int(getattr(backend, "preferred_size", None) or 224))
    try:
        size = int(option)
    except ValueError:
        raise ConfigError(f"--image-size {option}: expected an integer or auto") from None
    if not 16 <= size <= 4096:
        raise ConfigError(f"--image-size {size}: expected 16..4096")
    return size


def resolve_volume_as(option: str, backend) -> str:
    """``--volume-as``: ``video``, ``montage`` or ``views``; ``auto`` = ``video`` where the
    model takes video (a Qwen2-VL-style processor), else ``montage``."""
    from ..vqa.volume import check_volume_as

    if check_volume_as(option) == "auto":
        return "video" if getattr(backend, "takes_video", False) else "montage"
    return option


def probes_of_build(probes: list[str], build, every: bool, data: str | Path | None = None) -> list[str]:
    """The probes asked of ``build`` (``--data data``): with ``all`` those of its levels (Level 4 is
    opt-in), and a build with none of them is one line; a probe named of a level the build lacks
    is one line."""

    have = build.levels()
    if every:
        asked = [p for p in probes if get_probe(p).level in have]
        if not asked:
            raise ConfigError(
                f"--data {data or build.root}: the build has no question level (levels: {', '.join(have) or 'none'}); "
                "the MLLM track asks Level 3 (or Level 4) questions: build it with level3 in --levels "
                "(spar-build ... --levels level1,level2,level3, the default) or pass such a build")
        return asked
    for p in probes:
        if get_probe(p).level not in have:
            raise ConfigError(f"--probe {p}: {build.root} has no {get_probe(p).level}; levels: {', '.join(have)}")
    return probes


def check_volume_as_used(volume_as: str, probes: list[str], build, data: str | Path) -> None:
    """``--volume-as`` other than ``auto`` shows Level 4 volumes: with no Level 4 probe asked
    (a build without Level 4, or only slice probes named) it would be ignored, so it is one line."""

    from ..vqa.questions import is_volume_probe

    if volume_as == "auto" or any(is_volume_probe(get_probe(p)) for p in probes):
        return
    if not any(LEVEL_SPECS[lv].volume for lv in build.levels() if lv in LEVEL_SPECS):
        raise ConfigError(f"--volume-as {volume_as}: --data {data} has no level4 (levels: {', '.join(build.levels())}), "
                          "and --volume-as shows Level 4 volumes only; drop it, or build with "
                          "--levels ...,level4 (spar-build)")
    raise ConfigError(f"--volume-as {volume_as}: no Level 4 probe is asked ({', '.join(probes)}), and "
                      "--volume-as shows Level 4 volumes only; drop it or ask a level4 probe")


@dataclass(frozen=True)
class VqaOptions:
    """``spar-probe vqa``'s options but the model, the build and ``out`` (their defaults)."""

    probes: Sequence[str] | str = ("all",)
    splits: str | Sequence[str] = "test"
    revision: str | None = None
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    generate: bool = False
    guided: str = limited("none", choices=GUIDED)
    convention_hint: bool = True
    circular: bool = True
    blind: bool = True
    image_size: str = "224"
    volume_as: str = "auto"
    batch_size: int = limited(8, lo=1)
    max_new_tokens: int = limited(64, lo=1)
    device: str = "auto"
    compute: str = limited("auto", choices=COMPUTE_DTYPES)
    timeout: float = limited(120.0, lo=0.001)
    retries: int = limited(3, lo=0, hi=20)
    concurrency: int = limited(4, lo=1, hi=64)
    seeds: str | Sequence[int] = "0"
    n_boot: int = limited(1000, lo=1, flag="--bootstrap")
    cache_path: str | None = None
    accept_missing: bool = False

    def __post_init__(self) -> None:
        check_fields(self)


def _checked(data: str, opts: VqaOptions):
    """The build, its probes and splits, each checked against it."""
    from spar_bench.builder.shards import Build

    from .volume import check_volume_as

    check_volume_as(opts.volume_as)
    every = names_all(opts.probes)
    probes = parse_question_probes(opts.probes)
    if not (Path(data) / "manifest.json").is_file():
        raise ConfigError(f"--data {data}: no manifest.json; pass a finished build folder")
    build = Build(data)
    probes = probes_of_build(probes, build, every, data)
    check_volume_as_used(opts.volume_as, probes, build, data)
    splits = tuple(split_list(opts.splits))
    for level in sorted({get_probe(p).level for p in probes}):
        for s in splits:
            if s not in build.splits(level):
                raise ConfigError(f"--splits {s}: {data} {level} has splits {', '.join(build.splits(level))}")
    return build, probes, splits


def check_build(data: str, opts: VqaOptions):
    """``(build, probes, splits)`` of ``--data data`` as ``opts`` name them, each checked against
    the build in one line (``spar-probe vqa`` and ``spar-build export`` check alike)."""
    return _checked(data, opts)


def mllm_specs(model: str, data: str, out: str, opts: VqaOptions) -> list[list]:
    """The runs of ``spar-probe vqa`` (``opts``) of ``model`` on build ``data`` as data: one
    :class:`~.predictor.MllmSpec` per probe x seed, grouped by probe (checked against the build in
    one line). The first seed's backend (:func:`~.predictor.backend_of`) resolves ``--image-size
    auto``, ``--volume-as auto`` and the default response cache."""
    from .ask import AskConfig
    from .predictor import MllmSpec, backend_of

    _, probes, splits = _checked(data, opts)
    seeds = parse_seeds(opts.seeds)
    options = options_from(opts.generate, seed=seeds[0], revision=opts.revision, base_url=opts.base_url,
                           api_key_env=opts.api_key_env, batch_size=opts.batch_size,
                           max_new_tokens=opts.max_new_tokens, guided=opts.guided, timeout=opts.timeout,
                           retries=opts.retries, concurrency=opts.concurrency, data=str(data),
                           accept_missing=opts.accept_missing,
                           **model_placement(model, opts.device, opts.compute))  # fmt: skip
    first = backend_of(model, options)
    size, volume_as = resolve_image_size(str(opts.image_size), first), resolve_volume_as(opts.volume_as, first)
    cache = str(opts.cache_path or default_cache(out, first.name))
    return [[MllmSpec(model, str(data), p, AskConfig(splits, opts.convention_hint, opts.circular, opts.blind, size,
                                                     s, opts.n_boot, volume_as), options, cache) for s in seeds]
            for p in probes]  # fmt: skip


def ask_build(model: str, data: str, out: str, opts: VqaOptions,
              progress: Callable[[str], AbstractContextManager] | None = None) -> Iterator[tuple[str, Path | None]]:
    """Ask ``model`` every question probe of build ``data`` (``opts``) into ``out``, one run per
    probe x seed (:func:`mllm_specs` through :func:`~..runs.session.run_all`): yields each probe and
    its run folder (None: no questions on the splits). A finished run made otherwise is refused
    before any question is asked (a damaged response cache too). ``progress(probe)``: a context whose ``(done, total)`` calls
    report the answers (none by default). The backends are closed at the end."""
    from ..runs.session import open_job, run_all
    from .predictor import close_backends

    try:
        groups = mllm_specs(model, data, out, opts)
        ResponseCache(groups[0][0].cache).close()  # a damaged cache is one line, even when every run is kept
        for group in groups:
            for spec in group:
                preflight(open_job(spec, out))
        for spec, rd in run_all(groups, out, progress=progress or False):
            yield spec.probe, rd
    finally:
        close_backends()


def why_skipped(data: str, probe: str, splits: str | Sequence[str]) -> str:
    """Why ``probe`` has no questions on build ``data`` (:func:`ask_build` yielded None):
    ``no lesions in this source (...)`` for a counting probe on a build without lesion masks,
    else ``no questions on <splits>``."""

    try:
        why = no_lesions(json.loads((Path(data) / "manifest.json").read_text()), probe)
    except (OSError, ValueError):
        why = None
    return why or f"no questions on {splits}"
