"""What a plan will cost: images to encode, runs to train, questions to ask, and the time that
takes on this machine class (2 CPU cores) and on one GPU, from the benches' measured rates.

The rates are those of ``docs/SCALE.md`` and the benches (``bench/cache.py``,
``bench/finetune.py``, ``bench/heads.py``; the GPU figures from one H200): an estimate to plan
with, not a promise. A rate the benches have not measured for an encoder falls back to the
row of its family.
"""

from __future__ import annotations

from .plan import Plan, Step

#: images/s of a feature cache, by a substring of the encoder spec: (2 CPU cores fp32, one GPU bf16)
CACHE_RATES: tuple[tuple[str, float, float], ...] = (
    ("resnet50", 13.0, 2537.0),
    ("resnet18", 40.0, 6000.0),
    ("resnet10t", 60.0, 8000.0),
    ("vit_base_patch32", 22.0, 6789.0),
    ("vit_small", 22.0, 6000.0),
    # EfficientNet-Lite0 (the demo's): 27-31 images per CPU-s at one thread (bf16 on an AMX CPU,
    # bench/demo.py; fp32 channels-last on AVX2 about 24), one process per core (issue 45); the GPU
    # figure is a guess until bench/gpu.py measures it
    ("efficientnet", 45.0, 3000.0),
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
#: bootstrap: the demo's 16 runs of 964 images took 85 CPU-s a sweep, issue 45) and per image it
#: trains on (a WORD-sized build of 26,558 images: about 20 s a run on the CPU, 4 s on the GPU, with
#: early stopping), per image trained end to end, per MLLM question (all its asks)
UNIT_SECONDS = {
    "runs": (2.0, 0.5),
    "run_images": (20.0 / 26558, 4.0 / 26558),
    "questions": (2.0, 0.05),
}
#: CPU cores of each machine class (2-core machine, the GPU machine): a build's processes
#: (its ``jobs``) share them; ``build_seconds`` (one process, measured per source in
#: ``sizes.json``) divide by min(jobs, cores)
CORES = (2, 16)


def cache_rate(spec: str, model_args: dict | None = None) -> tuple[float, float]:
    """Images/s (volumes/s for a 3-D encoder) of ``spec`` on 2 CPU cores and on one GPU."""
    from .plan import encoder_kind

    if encoder_kind(spec) == "3d":
        size = float((model_args or {}).get("input_size", 128))
        scale = min(50.0, (128.0 / max(size, 1.0)) ** 3)
        cpu, gpu = next((c, g) for key, c, g in CACHE_RATES_3D if key in spec)
        return cpu * scale, gpu * scale
    for key, cpu, gpu in CACHE_RATES:
        if key in spec:
            return cpu, gpu
    return CACHE_RATES[-1][1:]


def _rate(plan: Plan, enc: str) -> tuple[float, float]:
    e = plan.experiment.encoders.get(enc)
    return cache_rate(e.spec, e.model_args) if e is not None else cache_rate("")


def step_seconds(plan: Plan, step: Step) -> tuple[float, float]:
    """Estimated seconds of ``step`` on 2 CPU cores and on one GPU."""
    cpu = gpu = 0.0
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
        elif unit in UNIT_SECONDS:
            c, g = UNIT_SECONDS[unit]
            if step.kind == "vqa" and plan.experiment.mllms[step.id[4:].split("@")[0]].model.startswith(("dummy", "oracle")):
                c = g = 0.001  # no model: answers are computed
            cpu, gpu = cpu + amount * c, gpu + amount * g
    return cpu, gpu


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
            if unit in ("run_images", "build_seconds") or (s.kind == "eval" and unit in ("images", "volumes")
                                        and s.id.startswith("eval:heads")):
                continue
            key = f"{unit} to encode" if unit in ("images", "volumes") else {"runs": "runs to train",
                                                                   "train_images": "images trained on",
                                                                   "questions": "questions to ask",
                                                                   "cases": "cases to build"}.get(unit, unit)
            out[key] = out.get(key, 0.0) + amount
    return out
