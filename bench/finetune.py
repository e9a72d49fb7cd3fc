"""Benchmark encoder training: ``spar-probe finetune``'s loop vs the bare forward+backward.

    python bench/finetune.py                                  # CPU, resnet10t at 224 on a small phantom build
    python bench/finetune.py --data shards/ --encoder timm:vit_small_patch16_224 --batch 64
    python bench/finetune.py --device cuda --encoder timm:resnet50 --batch 128 --workers 8

On the same batches of the same build, it times

* bare: the encoder's forward (preprocessing included) + a mean-of-pooled loss + backward +
  an AdamW step, on uint8 batches already on the device - what the hardware allows;
* finetune: one epoch of the finetune loop (:class:`spar_bench.probes.finetune.loop.Trainer`):
  the DataLoader reading the HDF5 shards, targets and questions, the head, the probe's loss,
  gradient clipping, the schedule;

and prints both in images/s, their ratio (the data pipeline's and the loop's overhead; aim
at least 0.9 on a GPU), the compute precision and the process's peak RSS. Then one more epoch
with a :class:`spar_bench.probes.stopwatch.Stopwatch` says where the loop's time goes: read +
decompression and collation (reader workers), waiting for data, targets and questions (host
prep), host-to-device copy, forward (encoder, head and loss), backward, optimizer step, and
the rest, in seconds and shares of that epoch's wall time (on CUDA each stage is synchronised,
so this epoch is slower than the untimed ones; ``--no-breakdown`` skips it). Weights are
random (``--init scratch``): throughput does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from cache import _sync, make_build, peak_rss_mib  # noqa: E402


def bare(trainer, batches, build, level: str, split: str, reps: int) -> float:
    """img/s of forward + backward + step on the given batches, images preloaded on the device."""
    import torch

    from spar_bench.probes.finetune.model import encode

    enc, dev, encoding = trainer.enc, trainer.dev, trainer.encoding
    images = [torch.from_numpy(build.images(level, split, b)).to(dev) for b in batches]
    params = [p for p in enc.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    enc.module.train()

    def one(x):
        with encoding.autocast():
            _, pooled = encode(enc, x)
        pooled.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one(images[0])  # warm-up
    _sync(dev)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for x in images:
            one(x)
        _sync(dev)
        best = max(best, sum(len(b) for b in batches) / (time.perf_counter() - t0))
    return best


def finetune_epoch(trainer, tr, batches, reps: int) -> float:
    """img/s of the finetune loop over the same batches (best of ``reps`` epochs)."""
    best = 0.0
    for _ in range(reps):
        trainer.state.batch = 0
        t0 = time.perf_counter()
        trainer.train_epoch(tr, batches)
        _sync(trainer.dev)
        best = max(best, sum(len(b) for b in batches) / (time.perf_counter() - t0))
    return best


def timed_epoch(trainer, tr, batches) -> tuple[float, object]:
    """One more epoch with a Stopwatch: ``(wall s, stopwatch)``."""
    from spar_bench.probes.stopwatch import Stopwatch

    trainer.stopwatch, trainer.state.batch = Stopwatch(trainer.dev), 0
    t0 = time.perf_counter()
    try:
        trainer.train_epoch(tr, batches)
        _sync(trainer.dev)
        return time.perf_counter() - t0, trainer.stopwatch
    finally:
        trainer.stopwatch = None


def setup(args, data: Path):
    """A Trainer of the encoder + an mlp head on ``args.probe`` of build ``data`` (no run folder use)."""
    from spar_bench.builder.shards import Build
    from spar_bench.probes.finetune.config import FinetuneConfig
    from spar_bench.probes.finetune.data import epoch_batches
    from spar_bench.probes.finetune.encoding import load_encoding, new_head, parse_model_args
    from spar_bench.probes.finetune.loop import Split, Trainer
    from spar_bench.probes.runs.inputs import build_splits
    from spar_bench.probes.tasks import get_probe

    cfg = FinetuneConfig(batch_size=args.batch, device=args.device, compute=args.compute,
                         workers=args.workers, max_epochs=1)
    build = Build(data)
    spec = get_probe(args.probe)
    from spar_bench.probes.runs.spec import RunSpec

    run = RunSpec(features=str(data), probe=args.probe, head="mlp", train=cfg.train_config())
    tr = build_splits(build, run).tr
    encoding, precision = load_encoding(args.encoder, build, 0, cfg, weights=None, init="scratch",
                                    model_kwargs=parse_model_args(args.model_args))
    trs = Split(tr, spec.level, "train")
    head = new_head(encoding, "mlp", spec, "pooled", 0, {}, trs)[0]
    trainer = Trainer(encoding, head, "pooled", 0, Path(tempfile.mkdtemp()), {}, progress=False)
    batches = epoch_batches(tr.rows, args.batch, 0, 0)[: args.batches]
    trainer.schedule(len(batches))
    return trainer, trs, batches, build, precision


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoder", default="timm:resnet10t")
    ap.add_argument("--model-args", default=None, help="JSON for timm.create_model")
    ap.add_argument("--data", default=None, help="a build folder (default: make a small phantom one)")
    ap.add_argument("--probe", default="level1.localisation")
    ap.add_argument("--n", type=int, default=96, help="images of the default small build")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=6, help="batches timed per repeat")
    ap.add_argument("--repeats", type=int, default=2, help="repeats (best is kept)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--compute", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                    help="skip the timed epoch that says where the time goes")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data, how = (Path(args.data), "given build") if args.data else make_build(Path(tmp), args.n)
        trainer, tr, batches, build, precision = setup(args, data)
        lv, sp = tr.level, tr.split
        r_bare = bare(trainer, batches, build, lv, sp, args.repeats)
        r_ft = finetune_epoch(trainer, tr, batches, args.repeats)
        wall, sw = timed_epoch(trainer, tr, batches) if args.breakdown else (0.0, None)
    from spar_bench.probes.finetune.encoding import published_encoder

    out = {"encoder": published_encoder(args.encoder, trainer.encoding.enc.spec), "model_args": args.model_args, "device": str(trainer.dev),
           "compute": precision.dtype, "compute_reason": precision.reason, "threads": torch.get_num_threads(),
           "workers": trainer.encoding.loading.workers, "build": how, "probe": args.probe,
           "batch": args.batch, "images_timed": int(sum(len(b) for b in batches)),
           "bare_img_s": round(r_bare, 2), "finetune_img_s": round(r_ft, 2),
           "ratio_finetune_over_bare": round(r_ft / r_bare, 3), "peak_rss_mib": round(peak_rss_mib(), 1)}
    if sw is not None:
        out["breakdown"] = {"wall_s": wall, "stages": [list(r) for r in sw.rows(wall)]}
    for k, v in out.items():
        if k != "breakdown":
            print(f"{k:>26}: {v}")
    if sw is not None:
        print(f"\nwhere the time goes (a timed epoch; untimed ratio finetune/bare {out['ratio_finetune_over_bare']:.2f})")
        print(sw.table(wall, "finetune"))
    if trainer.dev.type == "cpu":
        print("GPU numbers: python bench/finetune.py --device cuda --batch 128 --batches 20 --workers 4 "
              "--encoder timm:resnet50")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
