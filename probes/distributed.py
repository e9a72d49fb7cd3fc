"""Feature caching across processes under ``torchrun``: each rank writes its own part file.

    torchrun --nproc_per_node 4 -m spar_bench.probes.cli cache --encoder ... --out cache/x.h5

Rules (eva's embedding writer collided across ranks on one file and then deadlocked under
DDP; these rules make that impossible):

* The plan's batches are numbered once, in the build's order (level, split, row); batch ``b``
  belongs to rank ``b % world``. The assignment depends on nothing but the plan, the batch
  size and the world size, so a rank that is restarted finds the same batches.
* Rank ``r`` writes only ``OUT.part-r-of-W`` (same layout as a cache, ``done`` set for its own
  rows), resumable like any cache. No two ranks open the same file for writing.
* After a gloo ``monitored_barrier`` (which names a rank that never arrives), rank 0 merges
  the parts into ``OUT.merging``, checks that every row is done exactly once, marks it
  complete, renames it to ``OUT`` and deletes the parts. A failed rank therefore leaves no
  ``OUT``, only parts that a rerun of the same command resumes.
* Every rank dies with torchrun (:func:`die_with_launcher`), even when torchrun is killed.

The merged cache holds the same arrays and metadata as a one-process cache of the same
arguments (tested with 2 CPU processes on gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from spar_bench.errors import ConfigError, IntegrityError
from spar_bench.procs import die_with_parent

#: Attributes of a part file that the merged cache does not carry.
PART_ATTRS = ("part_rank", "part_world", "part_complete")


@dataclass(frozen=True)
class Ranks:
    """This process's place in a ``torchrun`` job (``world == 1``: not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        """From torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (absent: one process)."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local = int(os.environ.get("LOCAL_RANK", str(rank)))
        except ValueError:
            raise ConfigError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun)") from None
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
        return cls(rank, world, local)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def owns(self, batch_index: int) -> bool:
        """Whether batch number ``batch_index`` of the plan is this rank's."""
        return batch_index % self.world == self.rank


def die_with_launcher() -> None:
    """Under torchrun, make this rank die with its launcher (:func:`spar_bench.procs.die_with_parent`).

    torchrun starts each rank in a session of its own: a Ctrl-C or SIGTERM reaches torchrun,
    which passes SIGTERM on (each rank exits 143 after its cleanup), but a SIGKILL of torchrun
    would leave the ranks running under PID 1. Outside torchrun (``TORCHELASTIC_RUN_ID``
    unset) nothing changes.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        die_with_parent()


def part_path(out: Path, ranks: Ranks) -> Path:
    """``cache/x.h5`` -> ``cache/x.h5.part-1-of-4`` (one file per rank)."""
    return out.with_name(f"{out.name}.part-{ranks.rank}-of-{ranks.world}")


def all_parts(out: Path, world: int) -> list[Path]:
    return [part_path(out, Ranks(r, world, r)) for r in range(world)]


def barrier(ranks: Ranks, timeout_s: float) -> None:
    """Wait for every rank (gloo, so it works beside CUDA too); names a rank that fails."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise IntegrityError(f"rank {ranks.rank}: a rank did not finish its part ({e}); "
                             "rerun the same command to resume") from None


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` runs of sorted row indices."""
    if rows.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts)]


def _copy_group(src, dst, done: np.ndarray) -> None:
    """Copy the rows ``done`` of every layer of one level/split group."""
    for name, lg in src.items():
        if not name.startswith("layer"):
            continue
        out = dst.require_group(name)
        for ds_name, ds in lg.items():
            if ds_name not in out:
                out.create_dataset(ds_name, shape=ds.shape, dtype=ds.dtype, chunks=ds.chunks)
            for lo, hi in _runs(np.flatnonzero(done)):
                out[ds_name][lo:hi] = ds[lo:hi]


def merge_parts(out: Path, parts: list[Path]) -> Path:
    """Merge the part files of a distributed cache into ``out`` (see module doc); return it."""
    import h5py

    from spar_bench.h5files import open_h5

    tmp = out.with_name(out.name + ".merging")
    with open_h5(tmp, "w") as dst:  # a full disk: one clean OSError naming tmp
        for i, part in enumerate(parts):
            with h5py.File(part, "r") as src:
                if not src.attrs.get("part_complete"):
                    raise IntegrityError(f"{part}: part of rank {i} is unfinished; rerun to resume")
                if i == 0:
                    for k, v in src.attrs.items():
                        if k not in PART_ATTRS:
                            dst.attrs[k] = v
                _merge_part(src, dst, part)
        _check_all_done(dst, out)
        dst.attrs["complete"] = True
    os.replace(tmp, out)
    for part in parts:
        part.unlink()
    return out


def _merge_part(src, dst, part: Path) -> None:
    import h5py

    for lv, lg in src.items():
        for sp, g in lg.items():
            done = g["done"][()]
            key = f"{lv}/{sp}"
            if key not in dst:
                d = dst.create_group(key)
                d.create_dataset("key", data=g["key"][()], dtype=h5py.string_dtype())
                d.create_dataset("done", shape=done.shape, dtype=bool, fillvalue=False)
            have = dst[key]["done"][()]
            if (have & done).any():
                raise IntegrityError(f"{part}: rows of {key} written by two ranks")
            _copy_group(g, dst[key], done)
            dst[key]["done"][...] = have | done


def _check_all_done(dst, out: Path) -> None:
    for lv, lg in dst.items():
        for sp, g in lg.items():
            missing = int((~g["done"][()]).sum())
            if missing:
                raise IntegrityError(f"{out}: {lv}/{sp} has {missing} rows no rank wrote")
