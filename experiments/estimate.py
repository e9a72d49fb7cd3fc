"""What a plan will cost: images to encode, runs to train, questions to ask, and the time that
takes on this machine class (2 CPU cores) and on one GPU, from the benches' measured rates.

The rates are those of ``docs/SCALE.md`` and the benches (``bench/cache.py``,
``bench/finetune.py``, ``bench/heads.py``; the GPU figures from one H200): an estimate to plan
with, not a promise. A rate the benches have not measured for an encoder falls back to the
row of its family.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from spar_bench.errors import ConfigError
from spar_bench.probes.encoders.mllm_family import parse_stage, split_name

from .plan import Plan, Step, encoder_kind

#: images/s of a feature cache, by a substring of the encoder spec: (2 CPU cores fp32, one GPU bf16)
CACHE_RATES: tuple[tuple[str, float, float], ...] = (
    ("resnet50", 13.0, 2537.0),
    ("resnet18", 40.0, 6000.0),
    ("resnet10t", 60.0, 8000.0),
    ("vit_base_patch32", 22.0, 6789.0),
    ("vit_small", 22.0, 6000.0),
    # EfficientNet-Lite0 (the demo's): a cache step of 508 images in 8.1-8.8 s (its imports and
    # weights included; 80 images/s beside STEP_START) on an AMX CPU (bf16, bench/demo.py), its
    # batches over one process per core (issue 45; fp32 on AVX2 about 0.6 of that); the GPU figure
    # is a guess until bench/gpu.py measures it
    ("efficientnet", 80.0, 3000.0),
    ("dinov2", 4.5, 1500.0),
    ("rad-dino", 4.5, 1500.0),
    ("", 20.0, 2500.0),
)
#: volumes/s of a 3-D encoder's cache at input_size 128, by a substring of the spec: (2 CPU cores
#: fp32, one GPU bf16). Rough: monai:resnet10 random-init measured about 0.1 vol/s on a loaded
#: 2-core machine (12.7 s a volume); the GPU figures are guesses until bench/cache3d.py is run
#: there. Scaled by (128 / input_size)^3 for a smaller ``model_args.input_size``, at most x50.
CACHE_RATES_3D: tuple[tuple[str, float, float], ...] = (
    ("monai:resnet", 0.3, 100.0),
    ("", 0.2, 50.0),
)
#: per unit, (2 CPU cores, one GPU): seconds per head run (its set-up, its blind control and its
#: bootstrap; an MLP head's, a transformer head's is :data:`HEAD_RUN_FACTOR` times that: the demo's
#: 8 MLP runs of 508 images take 8.2-9.0 s on 2 idle cores, its step's start and the per-image
#: share below included, 17.4-19.0 CPU-s; 8 transformer runs about twice that, issue 45) and per image it
#: trains on (a WORD-sized build of 26,558 images: about 20 s a run on the CPU, 4 s on the GPU, with
#: early stopping), per image trained end to end, per MLLM question (all its asks)
UNIT_SECONDS = {
    "runs": (0.55, 0.5),
    "run_images": (20.0 / 26558, 4.0 / 26558),
    "questions": (2.0, 0.05),
    # the organ-map computation models' training, per pixel or voxel of every image of every epoch
    # (run kinds organmaps, organmaps3d: Trains). 2-D: the calibration's narrow ResNet-10 at 128 px
    # trained 130 images/s on 2 threads (docs/RESULTS.md "calibrated"); 3-D: the half-width ResNet-10
    # about 0.7 M voxels/s on a loaded 2-core machine, at 32^3 (two seeds x 150 epochs x 48 volumes
    # in about 12 min) and at 64^3 (ct-foundation: 40 epochs x 12 volumes, about 3 min a seed). The
    # GPU figures are guesses (30x and 100x) until a GPU run measures them.
    "map_pixels": (1.0 / (130 * 128 * 128), 1.0 / (30 * 130 * 128 * 128)),
    "map_voxels": (1.0 / 0.7e6, 1.0 / 7e7),
}
#: CPU cores of each machine class (2-core machine, the GPU machine): a build's processes
#: (its ``jobs``) share them; ``build_seconds`` (one process, measured per source in
#: ``sizes.json``) divide by min(jobs, cores)
CORES = (2, 16)
#: a head run's cost beside an MLP's (``runs`` above), by head (others: 1): a token head's fixed
#: PCA and attention
HEAD_RUN_FACTOR = {"transformer": 2.0}
#: seconds every step pays on (2 CPU cores, one GPU) before its work: its process, Python's and
#: torch's imports, reading the plan; a report reads every run and draws its plots: 4.5 s the demo's
STEP_START = (2.0, 2.0)
REPORT_SECONDS = (2.5, 2.5)
#: docs/RESULTS.md's 2-D calibration run (the preset's defaults) on 2 CPU cores: its phantom builds
#: (2 x 1,000 + 40 cases of 96 x 96 x 16 voxels, one process) and the rest (2 seeds of recall, 16
#: epochs at most, and of organ maps, 10 epochs, on 1,000 cases; the frozen probes, the readout,
#: the bootstrap): 1,841 + 4,289 s (``conditions`` of ../shared/data/calibration-rerun's file)
CALIBRATION_REFERENCE = {"build_s": 1841.4, "train_s": 4289.3, "cases": 2 * 1000 + 40, "train_cases": 1000,
                         "in_plane": 96, "slices": 16, "seeds": 2, "epochs": 16 + 10}
#: the phantom grid of a calibration that names none (the ``small`` preset: 160 in-plane, 40-60 slices)
CALIBRATION_DEFAULT_GRID = (160, 50)


def cache_rate(spec: str, model_args: dict | None = None) -> tuple[float, float]:
    """Images/s (volumes/s for a 3-D encoder) of ``spec`` on 2 CPU cores and on one GPU."""

    if encoder_kind(spec) == "3d":
        size = float((model_args or {}).get("input_size", 128))
        scale = min(50.0, (128.0 / max(size, 1.0)) ** 3)
        cpu, gpu = next((c, g) for key, c, g in CACHE_RATES_3D if key in spec)
        return cpu * scale, gpu * scale
    for key, cpu, gpu in CACHE_RATES:
        if key in spec:
            return cpu, gpu
    return CACHE_RATES[-1][1:]


#: FLOP/s an MLLM stage cache reaches: 2 CPU cores fp32 (about 25 GFLOP/s a core) and one H200
#: in bf16 (a sixth of its dense peak: batch 8-32 of a 7-8 B model, attention included)
MLLM_FLOPS = (5e10, 1.5e14)
#: the LM tokens of an ``llm:N`` prompt beside the image (``+q``: the question, its options and
#: instruction, about 150 more)
MLLM_PROMPT_TOKENS = {False: 16, True: 170}


def mllm_cache_rate(spec: str) -> tuple[float, float]:
    """``(images/s on 2 CPU cores, images/s on one GPU)`` of an
    ``mllm:DIR@STAGE`` cache, priced by the model's parameter count (the safetensors headers of
    DIR) and the tokens each image runs through: the vision tower's parameters over its patches,
    and for ``llm:N`` also N/L of the language model's over the image and prompt tokens
    (2 FLOP a parameter a token). A folder without a config or weights is refused in one line,
    so ``--dry-run`` stops on it."""

    folder_text, stage_text = split_name(spec.removeprefix("mllm:"))
    stage, layer = parse_stage(stage_text, spec)
    folder = Path(folder_text)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not (folder / "config.json").is_file() or not files:
        raise ConfigError(f"encoder {spec}: {folder} holds no config.json and *.safetensors weights; point it at "
                          "the model's save_pretrained folder (download it first)")
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    if not text or not vision:
        raise ConfigError(f"encoder {spec}: {folder}/config.json is not an image-text model's (no text_config and "
                          "vision_config); point it at a vision-language model's folder")
    params = sum(_safetensors_params(f) for f in files)
    d, n_lm = int(text.get("hidden_size", 4096)), int(text.get("num_hidden_layers", 32))
    lm = min(params, 12 * n_lm * d * d + 2 * int(text.get("vocab_size", 32000)) * d)
    side = int(vision.get("image_size", 336)) // max(int(vision.get("patch_size", 14)), 1)
    patches = max(side * side, 64)
    flops = 2.0 * (params - lm) * patches
    if stage == "llm":
        depth = (layer if layer >= 0 else n_lm + 1 + layer) / max(n_lm, 1)
        flops += 2.0 * lm * depth * (patches + MLLM_PROMPT_TOKENS[stage_text.endswith("+q")])
    return MLLM_FLOPS[0] / flops, MLLM_FLOPS[1] / flops


def _safetensors_params(path: Path) -> int:
    """Parameters in one safetensors file, from its JSON header (no tensor is read)."""

    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    return sum(math.prod(v["shape"]) for k, v in head.items() if k != "__metadata__")


def _rate(plan: Plan, enc: str) -> tuple[float, float]:
    e = plan.experiment.encoders.get(enc)
    if e is not None and e.spec.startswith("mllm:"):
        return mllm_cache_rate(e.spec)
    return cache_rate(e.spec, e.model_args) if e is not None else cache_rate("")


def step_seconds(plan: Plan, step: Step) -> tuple[float, float]:
    """Estimated seconds of ``step`` on 2 CPU cores and on one GPU (idle machines: the wall time of
    a step whose work keeps both cores busy, its own start included)."""
    cpu, gpu = STEP_START
    if step.kind == "report":
        cpu, gpu = cpu + REPORT_SECONDS[0], gpu + REPORT_SECONDS[1]
    for unit, amount in step.cost:
        if unit in ("images", "volumes"):
            enc = step.id.split(":", 1)[1].split("@")[0]
            if step.kind == "eval":
                enc = step.id.split(":")[2].split("@")[0]  # eval:<mode>:<encoder>@<build>
            if step.kind == "eval" and step.id.startswith("eval:heads"):
                continue  # heads on a cache: the cache step paid for the images
            c, g = _rate(plan, enc)
            cpu, gpu = cpu + amount / c, gpu + amount / g
        elif unit == "train_images":  # forward + backward + step: about a third of the forward's rate
            c, g = _rate(plan, step.id.split(":", 1)[1])
            cpu, gpu = cpu + amount * 3 / c, gpu + amount * 2.3 / g  # GPU: the loop's 0.44 of bare (bench/finetune.py)
        elif unit == "build_seconds":
            jobs = max(1, int(step.specs[-1][1].get("options", {}).get("jobs") or 1))
            cpu, gpu = cpu + amount / min(jobs, CORES[0]), gpu + amount / min(jobs, CORES[1])
        elif unit == "calibration_seconds":  # seconds on 2 CPU cores (calibration_seconds); the GPU: not measured
            cpu, gpu = cpu + amount, gpu + amount
        elif unit in UNIT_SECONDS:
            c, g = UNIT_SECONDS[unit]
            if unit == "runs":
                c *= head_factor(step)
            if step.kind == "vqa" and plan.experiment.mllms[step.id[4:].split("@")[0]].model.startswith(("dummy", "oracle")):
                c = g = 0.002  # no model: answers are computed (the demo's 1,352 in about 3 s)
            cpu, gpu = cpu + amount * c, gpu + amount * g
    return cpu, gpu


def calibration_seconds(cfg) -> float:
    """A 2-D calibration's seconds on 2 CPU cores (:class:`~.calibration.CalibrationConfig`
    ``cfg``), scaled from :data:`CALIBRATION_REFERENCE`: its builds by cases and voxels (over
    ``jobs`` processes), its training by seeds, training cases, slices and epochs. Rough: the
    reference is one run, and the scaling is linear."""
    ref = CALIBRATION_REFERENCE
    in_plane, slices = cfg.in_plane or CALIBRATION_DEFAULT_GRID[0], cfg.slices or CALIBRATION_DEFAULT_GRID[1]
    cases = sum(cfg.layout_cases().values())
    build = (ref["build_s"] * cases / ref["cases"] * (in_plane / ref["in_plane"]) ** 2 * slices / ref["slices"]
             / min(cfg.jobs, CORES[0]))
    epochs = cfg.epochs + (cfg.organ_maps or cfg.epochs)
    train = (ref["train_s"] * len(cfg.seeds) / ref["seeds"] * cfg.cases / ref["train_cases"]
             * slices / ref["slices"] * epochs / ref["epochs"])
    return build + train


def head_factor(step: Step) -> float:
    """The mean :data:`HEAD_RUN_FACTOR` of the heads a step's sweeps train (1 without any)."""
    heads = [h for kind, rec in step.specs if kind == "sweep" for h in rec.get("heads") or ()]
    return sum(HEAD_RUN_FACTOR.get(str(h), 1.0) for h in heads) / len(heads) if heads else 1.0


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def totals(plan: Plan, steps: list[Step]) -> dict[str, float]:
    """Units summed over ``steps`` (images to encode, runs to train, questions to ask ...)."""
    out: dict[str, float] = {}
    for s in steps:
        for unit, amount in s.cost:
            if unit in ("run_images", "build_seconds", "calibration_seconds") or (s.kind == "eval" and unit in ("images", "volumes")
                                        and s.id.startswith("eval:heads")):
                continue
            key = f"{unit} to encode" if unit in ("images", "volumes") else {"runs": "runs to train",
                                                                   "train_images": "images trained on",
                                                                   "questions": "questions to ask",
                                                                   "cases": "cases to build"}.get(unit, unit)
            out[key] = out.get(key, 0.0) + amount
    return out
