"""Which device and which compute precision: detected from the machine, never assumed.

bf16 autocast is 2.5-4x faster than fp32 on CPUs with native bf16 (AMX, AVX512-BF16) and about
30x SLOWER on CPUs without it (AVX2 only), where it is emulated. ``--compute auto`` therefore
asks the CPU, and where the CPU cannot be asked (the detection functions are private torch
APIs and may move), times one small bf16 and fp32 matmul and takes bf16 only when it is
clearly faster. The choice and its reason are recorded with every output (a cache's
``compute_dtype`` and ``compute_reason`` attributes). Caches made either way stay
interchangeable: features are stored in ``--dtype`` whatever the compute precision.

``SPAR_CPU_BF16=native|none`` replaces the CPU's answer (the feature probes and the timing) with
a stated one: tests fake either kind of CPU with it, and the fast subset runs with bf16 forced on
(``SPAR_CPU_BF16=native``) on a CPU without it to find code that silently assumes fp32.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from spar_bench.errors import ConfigError

COMPUTE_DTYPES = ("auto", "fp32", "bf16", "fp16")
#: CPU feature probes of torch (private API: looked up by name, absent ones are skipped).
CPU_BF16_PROBES = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
#: bf16 must beat fp32 by this factor in the timing fallback.
TIMED_MARGIN = 1.2
#: the environment variable that states the CPU's bf16 instead of asking it (tests, CI)
FORCE_ENV = "SPAR_CPU_BF16"
FORCE_VALUES = {"native": True, "none": False}


@dataclass(frozen=True)
class Precision:
    """A compute precision and why it was chosen (both recorded)."""

    dtype: str
    reason: str


def pick_device(device: str):
    """``auto`` -> CUDA when available, else CPU; ``cuda[:N]`` must exist."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda[:N]; got {device!r}")
    return torch.device(device)


def forced_precision() -> Precision | None:
    """The CPU precision ``SPAR_CPU_BF16`` states (``native``: bf16, ``none``: fp32), else None."""
    value = os.environ.get(FORCE_ENV, "").strip()
    if not value:
        return None
    if value not in FORCE_VALUES:
        raise ConfigError(f"{FORCE_ENV}={value}: must be {' or '.join(FORCE_VALUES)} (or unset)")
    return Precision("bf16" if FORCE_VALUES[value] else "fp32", f"stated by {FORCE_ENV}={value}")


def cpu_bf16_features() -> dict[str, bool] | None:
    """``{"AMX": bool, "AVX512-BF16": bool}`` from torch's CPU probes; None if torch has none."""
    import torch

    found = {}
    for name, attr in CPU_BF16_PROBES:
        probe = getattr(torch.cpu, attr, None)
        if probe is not None:
            found[name] = bool(probe())
    return found or None


def time_matmul(dtype_name: str, n: int = 256, reps: int = 5) -> float:
    """Best-of-``reps`` seconds for one ``n x n`` matmul in ``dtype_name`` on the CPU."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_precision(
    features: Callable[[], dict[str, bool] | None] = cpu_bf16_features,
    timer: Callable[[str], float] = time_matmul,
) -> Precision:
    """bf16 where this CPU has it natively, else fp32 (``features``/``timer`` for tests); what
    ``SPAR_CPU_BF16`` states, when set, instead of either."""
    forced = forced_precision()
    if forced is not None:
        return forced
    found = features()
    if found is not None:
        native = [name for name, ok in found.items() if ok]
        if native:
            return Precision("bf16", f"CPU has native bf16 ({', '.join(native)})")
        return Precision("fp32", f"CPU lacks {' and '.join(found)}: bf16 would be emulated")
    t_bf16, t_fp32 = timer("bf16"), timer("fp32")
    timing = f"timed a matmul: bf16 {t_bf16 * 1e3:.2f} ms, fp32 {t_fp32 * 1e3:.2f} ms"
    if t_bf16 * TIMED_MARGIN < t_fp32:
        return Precision("bf16", timing)
    return Precision("fp32", timing)


def pick_compute(compute: str, device) -> Precision:
    """The autocast precision for ``device``: ``compute`` itself, or the detected one for auto."""
    import torch

    if compute not in COMPUTE_DTYPES:
        raise ConfigError(f"--compute must be one of {', '.join(COMPUTE_DTYPES)}; got {compute!r}")
    if compute != "auto":
        if compute == "fp16" and device.type == "cpu":
            raise ConfigError("--compute fp16 is CUDA-only; use bf16 or fp32 on CPU")
        return Precision(compute, "asked for with --compute")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", "CUDA device supports bf16")
        return Precision("fp16", "CUDA device lacks bf16")
    return cpu_precision()
