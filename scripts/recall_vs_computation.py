"""Recall versus computation: the command line over ``spar_bench.experiments.calibration``.

    python scripts/recall_vs_computation.py --out runs/rvc            # the docs/RESULTS.md table
    python scripts/recall_vs_computation.py --out /tmp/rvc --quick    # a smoke run (minutes)
    # issue 26: the three reference models on the eight probes of Levels 1-3 (docs/RESULTS.md, "calibrated")
    python scripts/recall_vs_computation.py --out runs/rvc-cal --calibrate --seeds 0,1 --cases 1000 \
        --eval-cases 40 --in-plane 96 --slices 16 --l3-stride 2 --samples 1 --train-mirrors \
        --epochs 16 --patience 5 --head coordpool --organ-maps 10 --organ-map-dice 1 --threads 2
    # a rerun (another machine) against the table of docs/RESULTS.md
    python scripts/recall_vs_computation.py --check runs/rvc-cal/calibration.json

What is built, trained and scored, and what each output holds: the module doc of
``spar_bench.experiments.calibration``; ``--check``'s criterion: ``spar_bench.experiments.calibration_check``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spar_bench.experiments.calibration import (
    HEAD,
    L3_STRIDE,
    PROBES,
    TRAIN_ON,
    configs,
    run_experiment,
)
from spar_bench.experiments.calibration_check import Refused, check_command

#: the reference table of docs/RESULTS.md, as written by ``--calibrate`` (``--check`` compares a rerun with it)
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "calibration.json"
__all__ = ["REFERENCE", "configs", "main", "parse_args"]


def data_options(ap: argparse.ArgumentParser) -> None:
    """The phantom builds' options."""
    ap.add_argument("--out", default="runs/rvc")
    ap.add_argument("--cases", type=int, default=100, help="phantom cases of each training layout")
    ap.add_argument("--eval-cases", type=int, default=24,
                    help="phantom cases of the mirrored layout (and of canonical when no model trains on it)")
    ap.add_argument("--in-plane", type=int, default=None, help="phantom in-plane voxels (default: 160, 'small')")
    ap.add_argument("--slices", type=int, default=None, help="phantom slices per case (default: 40-60, 'small')")
    ap.add_argument("--l3-stride", type=int, default=L3_STRIDE, help="Level 3 on every Nth slice")
    ap.add_argument("--samples", type=int, default=4, help="Level 1 mosaics per case")
    ap.add_argument("--questions", type=int, default=16, help="Level 3 questions per probe and slice")
    ap.add_argument("--seed", type=int, default=0, help="the phantoms' seed")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes that render and build the phantoms (the bytes do not depend on it)")


def training_options(ap: argparse.ArgumentParser) -> None:
    """The trained models' options."""
    ap.add_argument("--train-on", default=",".join(TRAIN_ON), help="comma-separated layouts to train on")
    ap.add_argument("--probes", default=",".join(PROBES), help="comma-separated probes")
    ap.add_argument("--model-args", default=None,
                    help="JSON merged into the encoder's timm model args (e.g. '{\"coord_channels\": true}')")
    ap.add_argument("--head", default=HEAD)
    ap.add_argument("--train-mirrors", action="store_true",
                    help="train on the mirrored counterfactuals of the training slices too (augmentation)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--seeds", default="0", help="comma-separated training seeds (table: mean +- std)")
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--device", default="cpu",
                    help="where the encoders train and encode, in fp32: cpu (default), cuda[:N] or auto; the "
                         "probe heads and the organ-map readout stay on the CPU")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine more threads only contend)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 cases, 2 epochs")


def calibration_options(ap: argparse.ArgumentParser) -> None:
    """``--calibrate`` and ``--check``."""
    ap.add_argument("--calibrate", action="store_true",
                    help="issue 26: recall (canonical), computation (random) and the oracle on every probe of "
                         "--score; the encoders train end to end on --probes (default: relative position)")
    ap.add_argument("--organ-maps", type=int, default=0, metavar="EPOCHS",
                    help="calibration: the computation model's encoder learns organ maps of the random layouts "
                         "for EPOCHS epochs (128 px input), and every probe is a frozen --head probe of it; "
                         "0: it trains end to end on --probes like the recall model")
    ap.add_argument("--organ-map-dice", type=float, default=0.0, metavar="W",
                    help="calibration: the organ-map loss is the BCE plus W times a soft Dice term, which weighs "
                         "every organ present in a slice alike, small ones too (0: the BCE alone)")
    ap.add_argument("--score", default="all",
                    help="calibration: comma-separated probes scored (all: the eight of Levels 1-3)")
    ap.add_argument("--check", default=None, metavar="CALIBRATION_JSON",
                    help="compare a rerun's calibration.json with --against (the table of docs/RESULTS.md) and exit: "
                         "untrained cells the same, trained cells within the cross-machine tolerance (seeds and "
                         "bootstrap), every conclusion of the reference kept; status 1 if not")
    ap.add_argument("--against", default=str(REFERENCE), metavar="JSON",
                    help="the reference of --check (default: docs/calibration.json, the table of docs/RESULTS.md)")


def checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked (a bad value: exit 2 with one line) and with the defaults that depend on others."""
    if args.organ_maps < 0 or args.organ_map_dice < 0:
        ap.error("--organ-maps and --organ-map-dice must be >= 0")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    if not args.check:  # a bad or absent device fails here, not after the phantoms are built
        from spar_bench.errors import ConfigError
        from spar_bench.probes.hardware import pick_device

        try:
            pick_device(args.device)
        except ConfigError as e:
            ap.error(str(e))
    if args.calibrate and args.probes == ",".join(PROBES):
        args.probes = "level3.relative_position"
    if args.quick:
        args.cases, args.eval_cases, args.samples, args.epochs, args.bootstrap = 6, 6, 2, 2, 20
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for add in (data_options, training_options, calibration_options):
        add(ap)
    return checked(ap, ap.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        return check_command(Path(args.check), Path(args.against))
    return run_experiment(args)


def entry(argv: list[str] | None = None) -> int:
    """The script's exit status: an input ``--check`` cannot compare is its line on stderr and 2
    (an input error), a comparison that failed 1."""
    try:
        return main(argv)
    except Refused as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(entry())
