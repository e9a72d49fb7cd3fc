"""``spar-probe vqa``: ask a multimodal LLM the Level 3 (slices) and Level 4 (volumes) questions of a build."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from spar_bench.clitools import field_options, given, old_spelling, wait_option
from spar_bench.errors import ConfigError
from spar_bench.locks import output_lock

from ..names import names_all
from ..vqa.options import (  # noqa: F401 - the CLI's parsers are the library's
    TORCH_DTYPES,
    VqaOptions,
    ask_build,
    default_cache,
    full_probe_name,
    options_from,
    parse_question_probes,
    probes_of_build,
    resolve_image_size,
    resolve_volume_as,
    why_skipped,
)
from .options import (
    bootstrap_option,
    compute_option,
    device_option,
    out_option,
    probe_option,
    seeds_option,
)


@click.command("vqa")
@click.option("--model", default=None, help="hf:PATH_OR_ID, openai:MODEL, dummy[:LETTER] or oracle[:pixels].")
@click.option("--answers", multiple=True, type=click.Path(dir_okay=False),
              help="Instead of --model: another harness's answers to spar-build export (VLMEvalKit's "
                   "prediction .xlsx/.tsv/.csv, lmms-eval's --log_samples .jsonl); repeat it for several files "
                   "(VLMEvalKit's answers to <probe>.tsv and <probe>.blind.tsv).")
@click.option("--accept-missing", is_flag=True,
              help="--answers: report a variant the files have no answers for as not measured instead of "
                   "refusing the run.")
@click.option("--data", required=True, type=click.Path(file_okay=False), help="Build folder.")
@probe_option("Question probe(s) (size or level3.size; level4.volume) or 'all' (those of the build's levels).",
              cls=VqaOptions)
@field_options(VqaOptions, "splits", helps={"splits": "Splits whose questions are asked."})
@out_option()
@click.option("--revision", default=None, help="Hub revision (required for hf: hub ids).")
@click.option("--base-url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1.")
@field_options(VqaOptions, "api_key_env", helps={"api_key_env": "Environment variable holding the API key (never stored)."})
@click.option("--generate", is_flag=True, help="Generate and parse (default for hf: option log-likelihoods).")
@field_options(VqaOptions, "guided", helps={"guided": "openai: ask the server to decode one of the option letters."})
@click.option("--no-convention-hint", is_flag=True, help="Drop the display-convention sentence.")
@click.option("--no-circular", is_flag=True, help="Skip the option rotations (CircularEval).")
@click.option("--no-blind", is_flag=True, help="Skip the blind (no image) control.")
@field_options(VqaOptions, "image_size", "volume_as", "batch_size", "max_new_tokens", helps={
    "image_size": "Upscale the stored 224 slice to this size (bicubic) before the model sees it; 'auto': the size "
                  "the model's processor asks for, when larger than 224.",
    "volume_as": "Level 4: send each volume as a 'video' of 16 axial frames, a 'montage' (one grid image of them) "
                 "or 'views' (axial, coronal, sagittal central slices in one image); 'auto': video where the "
                 "model's processor takes video, else montage. --image-size is each slice's side."})  # fmt: skip
@device_option(VqaOptions)
@compute_option(VqaOptions)
@old_spelling("--dtype", "--compute", "compute", note=True, type=click.Choice(sorted(TORCH_DTYPES.values())),
              convert={v: k for k, v in TORCH_DTYPES.items()}.get)
@field_options(VqaOptions, "timeout", "retries", "concurrency", types={"timeout": click.FLOAT}, helps={
    "timeout": "Seconds per HTTP request; the back-off waits of one question (Retry-After honoured, capped) count "
               "against it too."})  # fmt: skip
@seeds_option(VqaOptions)
@old_spelling("--seed", "--seeds", "seeds", note=True, type=int, convert=str)
@bootstrap_option(VqaOptions)
@click.option("--cache", "cache_path", default=None, type=click.Path(dir_okay=False),
              help="Response cache (default OUT/.vqa-cache/<model>.sqlite).")
@wait_option
def vqa_command(model, answers, accept_missing, data, probes, out, revision, base_url, generate, no_convention_hint,
                no_circular, no_blind, device, compute, seeds, n_boot, cache_path, **kw):
    """Ask a multimodal LLM every Level 3 (and Level 4) question; score it like a probe head
    (one run per probe x seed)."""
    answers = os.pathsep.join(answers) if answers else None
    model = _model_of(model, answers)
    if answers is not None and names_all(probes):  # the probes the file answers, not every probe
        from ..vqa.answers import probes_answered

        probes = tuple(probes_answered(answers))
    opts = VqaOptions(probes=probes, revision=revision, base_url=base_url, generate=generate,
                      convention_hint=not no_convention_hint, circular=not no_circular, blind=not no_blind,
                      device=device, compute=compute, seeds=seeds, n_boot=n_boot, cache_path=cache_path,
                      accept_missing=accept_missing, **given(kw))  # fmt: skip
    click.get_current_context().with_resource(output_lock(out, what="spar-probe vqa"))  # before a model loads
    saved = 0
    for p, rd in ask_build(model, data, out, opts, _Progress):
        if rd is None:
            click.echo(f"{p}: {why_skipped(data, p, opts.splits)}; skipped", err=True)
            continue
        saved += _echo(p, rd)
    if saved:
        click.echo(f"byte-identical prompts asked once: {saved} requests saved")


def _model_of(model: str | None, answers: str | None) -> str:
    """``--model``, or ``answers:FILE`` for ``--answers FILE``; exactly one of them."""

    if (model is None) == (answers is None):
        raise ConfigError("spar-probe vqa: give --model (a model to ask) or --answers FILE (another harness's "
                          "answers to spar-build export), exactly one")
    return model if answers is None else f"answers:{answers}"


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


def _pct(score, key: str = "accuracy") -> str:
    """A score's ``key`` in %, ``n/a`` when absent, ``not measured`` for answers missing (:mod:`..measured`)."""
    from ..measured import NOT_MEASURED, is_unmeasured

    if is_unmeasured(score):
        return NOT_MEASURED
    v = score.get(key) if isinstance(score, dict) else None
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _echo(probe: str, rd: Path) -> int:
    """Print a probe's scores; return the requests its deduplication saved."""
    m = json.loads((rd / "metrics.json").read_text())
    c = m["controls"]
    click.echo(f"{probe}: accuracy={_pct(m['test'])} parse={_pct(c, 'parse_rate')} "
               f"circular={_pct(c.get('circular'), 'strict')} blind={_pct(c.get('blind'))} "
               f"mirror={_pct(m.get('mirror'))}"
               + (f" flipped={_pct(m.get('flipped'))}" if "flipped" in m else "") + f" -> {rd}")
    for v, why in (m.get("not_measured") or {}).items():
        click.echo(f"{probe}: {v} not measured ({why})", err=True)
    missing = int((m.get("requests") or {}).get("missing", 0))
    if missing:
        click.echo(f"{probe}: {missing} of {m['requests']['answers']} answers missing from --answers: "
                   "counted unanswered", err=True)
    return int((m.get("requests") or {}).get("deduplicated", 0))
