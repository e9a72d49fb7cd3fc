"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

from pathlib import Path


class SparError(Exception):
    """Base class of every error SPAR-Bench reports to a user."""


class ConfigError(SparError):
    """A bad option, a missing data folder, a refused output directory, ..."""


class CaseError(SparError):
    """A problem with one input case. The message names the case, the file and the problem.

    ``CaseError("word_0014", "labelsTs/word_0014.nii.gz", "contains NaN")`` reads
    ``case word_0014: labelsTs/word_0014.nii.gz: contains NaN``.
    """

    def __init__(self, case_id: str, path: str | Path | None, problem: str):
        self.case_id, self.path, self.problem = case_id, (str(path) if path else None), problem
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"case {case_id}: {where}{problem}")


class IntegrityError(SparError):
    """Written output does not match its manifest (checksums, counts, fingerprints)."""


class RunFailed(SparError):
    """A run of a batch failed (e.g. a sweep finished with failed runs): exit status 1, not 2.

    The inputs and options were valid; a usage or input error stays a :class:`ConfigError` (exit 2).
    """
