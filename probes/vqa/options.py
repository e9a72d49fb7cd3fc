"""One ``spar-probe vqa`` as a library call: its options (:class:`VqaOptions`), checked against
the build, then every question probe asked (:func:`ask_build`; the asking itself is
:mod:`.run`), as the CLI and an experiment's ``vqa:`` step run it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from spar_bench.errors import ConfigError

from ..names import names_all, split_list
from .base import MODES, BackendOptions


def full_probe_name(name: str) -> str:
    """The full name of a short question-probe name: the first level (in registry order) that
    has it (``distance`` is Level 3's; ``adjacency``, ``containment``, ``volume`` are Level 4's)."""
    from ..tasks import get_probe, probe_names

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
    from ..tasks import get_probe, probe_names

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
    from .volume import check_volume_as

    if check_volume_as(option) == "auto":
        return "video" if getattr(backend, "takes_video", False) else "montage"
    return option


def probes_of_build(probes: list[str], build, every: bool) -> list[str]:
    """The probes asked of ``build``: with ``all`` those of its levels (Level 4 is opt-in);
    a probe named of a level the build lacks is one line."""
    from ..tasks import get_probe

    have = build.levels()
    if every:
        return [p for p in probes if get_probe(p).level in have]
    for p in probes:
        if get_probe(p).level not in have:
            raise ConfigError(f"--probe {p}: {build.root} has no {get_probe(p).level}; levels: {', '.join(have)}")
    return probes


def default_cache(out: str | Path, model: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "model"
    return Path(out) / ".vqa-cache" / f"{slug[-80:]}.sqlite"


@dataclass(frozen=True)
class VqaOptions:
    """``spar-probe vqa``'s options but the model, the build and ``out`` (their defaults)."""

    probes: Sequence[str] | str = ("all",)
    splits: str | Sequence[str] = "test"
    revision: str | None = None
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    generate: bool = False
    guided: str = "none"
    convention_hint: bool = True
    circular: bool = True
    blind: bool = True
    image_size: str = "224"
    volume_as: str = "auto"
    batch_size: int = 8
    max_new_tokens: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    timeout: float = 120.0
    retries: int = 3
    concurrency: int = 4
    seed: int = 0
    n_boot: int = 1000
    cache_path: str | None = None


def _checked(data: str, opts: VqaOptions):
    """The build, its probes and splits, each checked against it."""
    from spar_bench.builder.shards import Build

    from ..tasks import get_probe
    from .volume import check_volume_as

    check_volume_as(opts.volume_as)
    every = names_all(opts.probes)
    probes = parse_question_probes(opts.probes)
    if not (Path(data) / "manifest.json").is_file():
        raise ConfigError(f"--data {data}: no manifest.json; pass a finished build folder")
    build = Build(data)
    probes = probes_of_build(probes, build, every)
    splits = tuple(split_list(opts.splits))
    for level in sorted({get_probe(p).level for p in probes}):
        for s in splits:
            if s not in build.splits(level):
                raise ConfigError(f"--splits {s}: {data} {level} has splits {', '.join(build.splits(level))}")
    return build, probes, splits


def ask_build(model: str, data: str, out: str, opts: VqaOptions,
              progress: Callable[[str], AbstractContextManager] | None = None) -> Iterator[tuple[str, Path | None]]:
    """Ask ``model`` every question probe of build ``data`` (``opts``) into ``out``: yields
    each probe and its run folder (None: no questions on the splits). A finished run made
    otherwise is refused before any question is asked. ``progress(probe)``: a context whose
    ``(done, total)`` calls report the answers (none by default)."""
    from . import load_backend
    from .cache import ResponseCache
    from .run import AskConfig, check_finished, run_dir, run_identity, run_probe

    build, probes, splits = _checked(data, opts)
    backend = load_backend(model, options_from(
        opts.generate, seed=opts.seed, revision=opts.revision, base_url=opts.base_url, api_key_env=opts.api_key_env,
        device=opts.device, dtype=opts.dtype, batch_size=opts.batch_size, max_new_tokens=opts.max_new_tokens,
        guided=opts.guided, timeout=opts.timeout, retries=opts.retries, concurrency=opts.concurrency,
        data=str(data)))  # fmt: skip
    try:
        cfg = AskConfig(splits, opts.convention_hint, opts.circular, opts.blind,
                        resolve_image_size(str(opts.image_size), backend), opts.seed, opts.n_boot,
                        resolve_volume_as(opts.volume_as, backend))  # fmt: skip
        for p in probes:
            check_finished(run_dir(backend, p, out, cfg), run_identity(backend, build, p, cfg))
        with ResponseCache(opts.cache_path or default_cache(out, backend.name)) as cache:
            for p in probes:
                with (progress(p) if progress else nullcontext(None)) as bar:
                    rd = run_probe(backend, build, p, out, cfg, cache, bar)
                yield p, rd
    finally:
        backend.close()
