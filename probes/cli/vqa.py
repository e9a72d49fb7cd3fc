"""``spar-probe vqa``: ask a multimodal LLM the Level 3 (slices) and Level 4 (volumes) questions of a build."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from spar_bench.clitools import old_spelling, wait_option
from spar_bench.errors import ConfigError
from spar_bench.locks import output_lock

from ..vqa.base import MODES, BackendOptions
from ..vqa.openai import GUIDED
from .options import (
    bootstrap_option,
    compute_option,
    device_option,
    names_all,
    parse_seeds,
    probe_option,
    seeds_option,
    split_list,
)

#: ``--compute`` as an ``hf:`` model's torch dtype (what its runs record as ``decoding.dtype``);
#: the hidden ``--dtype`` (before 0.2) took these names
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


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


def model_placement(model: str, device: str, compute: str) -> dict[str, str]:
    """``--device`` and ``--compute`` as the backend takes them: for an ``hf:`` model (the one
    kind that runs here) a torch device and dtype name, ``auto`` resolved as every command
    resolves it (:func:`~..hardware.pick_device`, :func:`~..hardware.pick_compute`; ``--compute
    fp32`` is ``float32``, as ``--dtype float32`` before); other kinds read neither."""
    if not model.startswith("hf:"):
        return {}
    from ..hardware import pick_compute, pick_device

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
    from ..tasks import get_probe

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
    from ..tasks import get_probe
    from ..vqa.questions import is_volume_probe

    if volume_as == "auto" or any(is_volume_probe(get_probe(p)) for p in probes):
        return
    if "level4" not in build.levels():
        raise ConfigError(f"--volume-as {volume_as}: --data {data} has no level4 (levels: {', '.join(build.levels())}), "
                          "and --volume-as shows Level 4 volumes only; drop it, or build with "
                          "--levels ...,level4 (spar-build)")
    raise ConfigError(f"--volume-as {volume_as}: no Level 4 probe is asked ({', '.join(probes)}), and "
                      "--volume-as shows Level 4 volumes only; drop it or ask a level4 probe")


def default_cache(out: str | Path, model: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "model"
    return Path(out) / ".vqa-cache" / f"{slug[-80:]}.sqlite"


@click.command("vqa")
@click.option("--model", required=True, help="hf:PATH_OR_ID, openai:MODEL, dummy[:LETTER] or oracle[:pixels].")
@click.option("--data", required=True, type=click.Path(file_okay=False), help="Build folder.")
@probe_option("Question probe(s) (size or level3.size; level4.volume) or 'all' (those of the build's levels).")
@click.option("--splits", default="test", show_default=True, help="Splits whose questions are asked.")
@click.option("--out", default="runs", show_default=True, type=click.Path(file_okay=False))
@click.option("--revision", default=None, help="Hub revision (required for hf: hub ids).")
@click.option("--base-url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1.")
@click.option("--api-key-env", default="OPENAI_API_KEY", show_default=True,
              help="Environment variable holding the API key (never stored).")
@click.option("--generate", is_flag=True, help="Generate and parse (default for hf: option log-likelihoods).")
@click.option("--guided", type=click.Choice(GUIDED), default="none", show_default=True,
              help="openai: ask the server to decode one of the option letters.")
@click.option("--no-convention-hint", is_flag=True, help="Drop the display-convention sentence.")
@click.option("--no-circular", is_flag=True, help="Skip the option rotations (CircularEval).")
@click.option("--no-blind", is_flag=True, help="Skip the blind (no image) control.")
@click.option("--image-size", default="224", show_default=True,
              help="Upscale the stored 224 slice to this size (bicubic) before the model sees it; "
                   "'auto': the size the model's processor asks for, when larger than 224.")
@click.option("--volume-as", default="auto", show_default=True,
              help="Level 4: send each volume as a 'video' of 16 axial frames, a 'montage' (one grid image of "
                   "them) or 'views' (axial, coronal, sagittal central slices in one image); 'auto': video where "
                   "the model's processor takes video, else montage. --image-size is each slice's side.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1))
@device_option
@compute_option
@old_spelling("--dtype", "--compute", "compute", note=True, type=click.Choice(sorted(TORCH_DTYPES.values())),
              convert={v: k for k, v in TORCH_DTYPES.items()}.get)
@click.option("--timeout", default=120.0, show_default=True, type=float,
              help="Seconds per HTTP request; the back-off waits of one question (Retry-After honoured, "
                   "capped) count against it too.")
@click.option("--retries", default=3, show_default=True, type=click.IntRange(0, 20))
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 64))
@seeds_option()
@old_spelling("--seed", "--seeds", "seeds", note=True, type=int, convert=str)
@bootstrap_option
@click.option("--cache", "cache_path", default=None, type=click.Path(dir_okay=False),
              help="Response cache (default OUT/.vqa-cache/<model>.sqlite).")
@wait_option
def vqa_command(model, data, probes, splits, out, revision, base_url, api_key_env, generate, guided,
                no_convention_hint, no_circular, no_blind, image_size, volume_as, batch_size, max_new_tokens,
                device, compute, timeout, retries, concurrency, seeds, n_boot, cache_path):
    """Ask a multimodal LLM every Level 3 (and Level 4) question; score it like a probe head
    (one run per probe x seed)."""
    from spar_bench.builder.shards import Build

    from ..runs.session import RunOptions, execute, open_job
    from ..runs.store import preflight
    from ..tasks import get_probe
    from ..vqa import load_backend
    from ..vqa.ask import AskConfig
    from ..vqa.cache import ResponseCache
    from ..vqa.predictor import MllmSpec
    from ..vqa.volume import check_volume_as

    check_volume_as(volume_as)
    every = names_all(probes)
    probes = parse_question_probes(probes)
    if not (Path(data) / "manifest.json").is_file():
        raise ConfigError(f"--data {data}: no manifest.json; pass a finished build folder")
    build = Build(data)
    probes = probes_of_build(probes, build, every, data)
    check_volume_as_used(volume_as, probes, build, data)
    split_list = tuple(s.strip() for s in splits.split(",") if s.strip())
    for level in sorted({get_probe(p).level for p in probes}):
        for s in split_list:
            if s not in build.splits(level):
                raise ConfigError(f"--splits {s}: {data} {level} has splits {', '.join(build.splits(level))}")
    seed_list = parse_seeds(seeds)
    click.get_current_context().with_resource(output_lock(out, what="spar-probe vqa"))  # before a model loads
    kw = dict(revision=revision, base_url=base_url, api_key_env=api_key_env, batch_size=batch_size,
              max_new_tokens=max_new_tokens, guided=guided, timeout=timeout, retries=retries,
              concurrency=concurrency, data=str(data), **model_placement(model, device, compute))
    backends = backends_by_seed(lambda seed: load_backend(model, options_from(generate, seed=seed, **kw)), seed_list)
    first = backends[seed_list[0]]
    shown = resolve_image_size(image_size, first), resolve_volume_as(volume_as, first)
    cfgs = {s: AskConfig(split_list, not no_convention_hint, not no_circular, not no_blind, shown[0], s, n_boot,
                         shown[1]) for s in seed_list}  # fmt: skip
    saved = 0
    with ResponseCache(cache_path or default_cache(out, first.name)) as cache:
        jobs = {(s, p): open_job(MllmSpec(backends[s], build, p, cfgs[s], cache), out)
                for p in probes for s in seed_list}  # fmt: skip
        for job in jobs.values():  # a finished run made otherwise is refused before any question is asked
            preflight(job)
        for (s, p), job in jobs.items():
            with _Progress(p) as progress:
                if job is not None:
                    job.spec = MllmSpec(backends[s], build, p, cfgs[s], cache, progress)
                rd = None if job is None else execute(job, RunOptions())
            if rd is None:
                click.echo(f"{p}: no questions on {', '.join(split_list)}; skipped", err=True)
                continue
            saved += _echo(p, rd)
    for backend in {id(b): b for b in backends.values()}.values():
        backend.close()
    if saved:
        click.echo(f"byte-identical prompts asked once: {saved} requests saved")


def backends_by_seed(load, seeds: list[int]) -> dict:
    """The backend of each seed (``load(seed)``): one per seed where its answers depend on the
    seed (its identity records one: ``dummy``), else one for all (an ``hf:`` model loads once)."""
    first = load(seeds[0])
    if "seed" not in first.identity:
        return dict.fromkeys(seeds, first)
    return {seeds[0]: first, **{s: load(s) for s in seeds[1:]}}


class _Progress:
    """A tqdm bar on stderr over the answers not yet in the cache (none when all are)."""

    def __init__(self, probe: str):
        self.probe, self.bar = probe, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.probe, unit="answer", leave=False)
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def _echo(probe: str, rd: Path) -> int:
    """Print a probe's scores; return the requests its deduplication saved."""
    m = json.loads((rd / "metrics.json").read_text())
    f = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    circ = m.get("circular") or {}
    blind = (m["controls"].get("blind") or {}).get("accuracy")
    click.echo(f"{probe}: accuracy={f(m['test']['accuracy'])} parse={f(m['parse_rate'])} "
               f"circular={f(circ.get('strict'))} blind={f(blind)} "
               f"mirror={f((m.get('mirror') or {}).get('accuracy'))}"
               + (f" flipped={f((m.get('flipped') or {}).get('accuracy'))}" if "flipped" in m else "") + f" -> {rd}")
    return int((m.get("requests") or {}).get("deduplicated", 0))
