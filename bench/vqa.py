"""Benchmark: the ``hf:`` MLLM backend against a bare batched forward, and CircularEval's cost.

    python bench/vqa.py                              # tiny random LLaVA + phantom, temp dir
    python bench/vqa.py --work /tmp/bv --hidden 256 --questions 256 --batch-size 16
    python bench/vqa.py --model /models/llava-folder --device cuda --dtype bfloat16

Measured side by side in one run, on the same questions (Level 3, original slices of a
small phantom build, options in class order, with the image):

1. ``backend``   - ``HFBackend.answer`` in batches (chat template, processor, letter
   log-likelihoods, the choice): questions per second;
2. ``bare``      - the same model on the same inputs written as a plain research loop:
   one ``apply_chat_template`` + processor call per batch, one forward, argmax over the
   option letters' logits at the last position (no checks, no fallbacks);
3. ``forward``   - the forward pass alone on pre-encoded batches (the floor);
4. ``circular``  - seconds of rotation 0 vs all rotations of the same questions for a
   2-option (relative_position) and an 8-option (orientation) probe;
5. ``rescore``   - ``run_probe`` on the val split: first run (asks the model) vs a rerun
   served by the response cache.

Prints questions/s, the ratios, and the peak RSS of the process. Random weights: timing only.
``--clock cpu`` times by the process's CPU seconds instead of the wall clock: on a machine
shared with other jobs, the wall clock measures the neighbours' load; with ``--threads 1``,
CPU seconds are what a quiet core would take.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np


def prepare(work: Path, n_cases: int) -> Path:
    """A phantom Level 3 build under ``work`` (reused when there)."""
    from spar_bench.builder.cli import cli as build_cli
    from spar_bench.clitools import run_cli

    shards = work / "shards"
    if not (shards / "manifest.json").is_file():
        assert run_cli(build_cli, ["phantom", "--out", str(work / "ph"), "--n", str(n_cases),
                                   "--overwrite"]) == 0  # fmt: skip
        assert run_cli(build_cli, ["--source", "phantom", "--root", str(work / "ph"), "--out",
                                   str(shards), "--levels", "level3", "--no-hf", "--overwrite"]) == 0  # fmt: skip
    return shards


def requests_for(build, probe: str, n: int, size: int, rotation: int | None = 0):
    """Requests of the first ``n`` original questions of ``probe`` (train split): one rotation,
    or every rotation when ``rotation`` is None."""
    from spar_bench.probes.tasks import get_probe
    from spar_bench.probes.vqa.base import Request, to_pil
    from spar_bench.probes.vqa.prompts import render, rotations
    from spar_bench.probes.vqa.questions import load_questions

    qs = load_questions(build, get_probe(f"level3.{probe}"), ["train"])
    idx = np.flatnonzero(~qs.is_mirror)[:n]
    imgs = build.images("level3", "train", qs.row[idx])
    orders = rotations(qs.spec.n_classes)
    out = []
    for i, img in zip(idx, imgs, strict=True):
        pil = to_pil(img, size)
        for order in orders if rotation is None else [orders[rotation]]:
            p = render(probe, int(qs.organ_a[i]), int(qs.organ_b[i]), int(qs.axis[i]), order)
            out.append(Request(str(qs.key[i]), p.text, p.letters, p.options, pil))
    return out


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def timed(fn, *args) -> float:
    t0 = clock()
    fn(*args)
    return clock() - t0


def in_batches(fn, reqs, bs):
    for lo in range(0, len(reqs), bs):
        fn(reqs[lo:lo + bs])


def bare_loop(be, reqs, bs: int) -> None:
    """What a research script does: template, processor, forward, argmax over the letters."""
    import torch

    tok = be.processor.tokenizer
    letter_ids = [tok(L, add_special_tokens=False)["input_ids"][-1] for L in reqs[0].letters]
    for lo in range(0, len(reqs), bs):
        part = reqs[lo:lo + bs]
        texts = [be.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r.text}]}],
            add_generation_prompt=True, tokenize=False) for r in part]
        tok.padding_side = "right"
        enc = be.processor(text=texts, images=[r.image for r in part], return_tensors="pt",
                           padding=True, add_special_tokens=False).to(be.device)
        with torch.inference_mode():
            logits = be.model(**enc).logits
        last = enc["attention_mask"].sum(1) - 1
        logits[torch.arange(len(part)), last][:, letter_ids].argmax(-1).tolist()


def forward_only(be, reqs, bs: int) -> float:
    import torch

    encs = [be.encode([be.prompt_text(r) for r in reqs[lo:lo + bs]], reqs[lo:lo + bs], "right")
            for lo in range(0, len(reqs), bs)]
    t0 = clock()
    with torch.inference_mode():
        for enc in encs:
            be.model(**enc)
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--model", default=None, help="hf model folder (default: a tiny random LLaVA)")
    ap.add_argument("--hidden", type=int, default=64, help="width of the tiny model")
    ap.add_argument("--n-cases", type=int, default=6)
    ap.add_argument("--questions", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="wall seconds, or the process's CPU seconds (a machine shared with other jobs)")
    args = ap.parse_args()
    import torch

    global clock
    clock = CLOCK[args.clock]

    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="spar-bench-vqa-"))
    work.mkdir(parents=True, exist_ok=True)
    run(args, work)


def run(args, work: Path) -> None:
    from spar_bench.builder.shards import Build
    from spar_bench.probes.vqa import BackendOptions
    from spar_bench.probes.vqa.predictor import backend_of
    from spar_bench.probes.vqa.tiny import make_tiny_llava

    build = Build(prepare(work, args.n_cases))
    model = Path(args.model) if args.model else work / f"tiny-llava-{args.hidden}"
    if not args.model and not (model / "config.json").is_file():
        make_tiny_llava(model, hidden=args.hidden)
    opts = BackendOptions(batch_size=args.batch_size, device=args.device, dtype=args.dtype, data=str(build.root))
    be = backend_of(f"hf:{model}", opts)  # the one the run of rescore() asks, loaded once
    bs = args.batch_size
    reqs = requests_for(build, "relative_position", args.questions, args.image_size)
    n = len(reqs)
    in_batches(be.answer, reqs[:bs], bs)  # warm-up: lazy imports, first allocations
    t_backend = timed(in_batches, be.answer, reqs, bs)
    t_bare = timed(bare_loop, be, reqs, bs)
    t_fwd = forward_only(be, reqs, bs)
    print(f"model {model.name} ({args.device}, {args.dtype}), {n} questions, batch {bs}, "
          f"{args.threads} thread(s), {args.clock} clock")
    print(f"  backend  {n / t_backend:8.1f} q/s   ({t_backend:.2f} s)")
    print(f"  bare     {n / t_bare:8.1f} q/s   ({t_bare:.2f} s)   backend/bare time ratio {t_backend / t_bare:.2f}")
    print(f"  forward  {n / t_fwd:8.1f} q/s   ({t_fwd:.2f} s)   backend/forward time ratio {t_backend / t_fwd:.2f}")
    circular(be, build, args)
    rescore(f"hf:{model}", opts, work)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MiB")


def circular(be, build, args) -> None:
    """Seconds for rotation 0 vs every rotation of the same questions."""
    bs, k = args.batch_size, max(8, args.questions // 4)
    for probe in ("relative_position", "orientation"):
        one = requests_for(build, probe, k, args.image_size)
        every = requests_for(build, probe, k, args.image_size, rotation=None)
        t1 = timed(in_batches, be.answer, one, bs)
        tn = timed(in_batches, be.answer, every, bs)
        print(f"  circular {probe}: {len(one)} q rotation 0 {t1:.2f} s, all {len(every) // len(one)} "
              f"rotations {tn:.2f} s: x{tn / t1:.2f} the cost")


def rescore(model: str, opts, work: Path) -> None:
    """A run on the val split asking the model, then the same run from the response cache."""
    from spar_bench.probes.runs.session import run
    from spar_bench.probes.vqa.ask import AskConfig
    from spar_bench.probes.vqa.cache import ResponseCache
    from spar_bench.probes.vqa.predictor import MllmSpec

    cfg = AskConfig(splits=("val",), n_boot=200)
    cache_path = work / "bench-cache.sqlite"
    cache_path.unlink(missing_ok=True)
    spec = MllmSpec(model, opts.data, "level3.relative_position", cfg, opts, str(cache_path))
    t_first = timed(run, spec, work / "runs", overwrite=True)
    t_again = timed(run, spec, work / "runs", overwrite=True)
    with ResponseCache(cache_path) as cache:
        n = len(cache)
    print(f"  rescore  session.run val ({n} answers incl. rotations, blind, mirrors): "
          f"first {t_first:.2f} s, from cache {t_again:.2f} s (x{t_first / t_again:.1f} faster)")


if __name__ == "__main__":
    main()
