"""``spar-build merge``: phase 2 of a build over the folders of ``spar-build ... --partition I/N``.

The partitions are read and cross-checked (:func:`~spar_bench.builder.partition.read_partitions`),
their spill files gathered into ``OUT.tmp/cases``, and the one-machine build's phase 2
(:func:`~spar_bench.builder.build.write_outputs`) writes the build: byte-identical to
``spar-build`` without ``--partition`` (same options, same seed). See :mod:`.partition`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from spar_bench.clitools import wait_option
from spar_bench.errors import ConfigError, IntegrityError
from spar_bench.outputs import check_target, claim, disk_full_is_an_error, remove

from .build import BuildConfig, CaseRecord, owned_work, write_outputs
from .options import jobs_option, pop_jobs
from .partition import gather_cases, read_partitions


def config_from_recorded(recorded: dict[str, Any], **runtime: Any) -> BuildConfig:
    """The BuildConfig whose ``recorded()`` is ``recorded`` (checked), with runtime fields."""
    fields = dict(recorded, **runtime)
    fields["sources"], fields["roots"] = tuple(fields["sources"]), tuple(fields["roots"])
    try:
        config = BuildConfig(**fields)
    except TypeError as e:
        raise ConfigError(f"partition config is not one this builder knows ({e}); merge with the "
                          "spar-bench version that built the partitions") from None
    if config.recorded() != recorded:
        raise IntegrityError("partition config does not round-trip; merge with the spar-bench "
                             "version that built the partitions")
    return config


def merge(parts: list[Path], out: Path, *, workers: int = 1, overwrite: bool = False,
          quiet: bool = False) -> Path:
    """Phase 2 over every partition's cases: the build a one-machine run would have written.

    Like a build: ``OUT.lock`` keeps a second writer away, a full disk is one line.
    """
    from spar_bench.locks import output_lock

    with disk_full_is_an_error(out, rerun="rerun the same merge"), output_lock(out, what="build (spar-build merge)"):
        return _merge(parts, Path(out), workers=workers, overwrite=overwrite, quiet=quiet)


def _merge(parts: list[Path], out: Path, *, workers: int, overwrite: bool, quiet: bool) -> Path:
    from .writers.manifest import owned_build

    if not parts:
        raise ConfigError("merge: give the partition folders, e.g. spar-build merge parts/* --out OUT")
    records = read_partitions(parts)
    config = config_from_recorded(records[0]["config"], out=str(out), workers=workers)
    work = out.parent / (out.name + ".tmp")
    for target, option in ((out, "--out"), (work, "work folder")):
        check_target(target, inputs=parts, option=option)
    claim(out, overwrite=overwrite, owned=owned_build, what="build")
    if claim(work, overwrite=True, owned=owned_work, what="work folder (OUT.tmp)", option="work folder"):
        remove(work)  # phase 2 always starts over from the partitions' spills
    gather_cases(parts, records, work / "cases")
    (work / "config.json").write_text(json.dumps(config.recorded(), sort_keys=True, indent=2),
                                      encoding="utf-8")
    ordered = sorted(_case_records(records), key=lambda r: (r.source, r.case_id))
    if [[r.source, r.case_id] for r in ordered] != records[0]["selection"]:
        raise IntegrityError("the partitions' cases do not add up to their selection; rebuild "
                             "the partitions with the same options")
    origins = {(s, c): o for s, c, o in records[0]["origins"]}
    return write_outputs(config, ordered, records[0]["sources"], origins, work, out, quiet=quiet)


def _case_records(records: list[dict[str, Any]]) -> list[CaseRecord]:
    """Every partition's case records; IntegrityError on one this builder cannot read."""
    out = []
    for rec in records:
        for r in rec["records"]:
            case = CaseRecord.from_json(r)
            if case is None:
                raise IntegrityError("a partition's case record is not one this builder knows; merge "
                                     "with the spar-bench version that built the partitions")
            out.append(case)
    return out


@click.command("merge")
@click.argument("parts", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The merged build folder.")
@jobs_option("Processes for the Parquet conversion (never change a byte).")
@click.option("--overwrite", is_flag=True, help="Replace an existing build at --out.")
@wait_option  # OUT.lock is taken by merge()
def merge_command(parts: tuple[Path, ...], out: Path, overwrite: bool, **jobs: int | None) -> None:
    """Merge the folders of `spar-build ... --partition I/N` into one build (byte-identical
    to a one-machine build with the same options)."""
    path = merge(list(parts), out, workers=pop_jobs(jobs), overwrite=overwrite)
    click.echo(f"\nbuild written to {path}")
