"""Names that become paths, and paths that must stay inside their folder.

Two independent defences keep every write of an experiment inside its ``OUT``:

* :func:`check_name`: a name that becomes a file or folder name (an experiment's, a build's,
  an encoder's, an MLLM's, a predictor's ...) is checked where it is declared. Allowed
  (:data:`NAME_FORM`): ASCII letters, digits, ``_``, ``-`` and ``.``, starting with a letter
  or a digit, without ``..``, at most :data:`MAX_NAME` characters. So ``qwen2.5-vl-7b`` and
  ``b.v2`` are names; ``../x``, ``/abs``, ``.hidden``, ``a/b``, ``a@b``, ``""`` and a
  look-alike such as the fullwidth solidus ``\\uff0f`` are not.
* :func:`confined`: a path about to be written is resolved (symlinks followed) and must lie
  under the resolved root, so a symlinked folder inside ``OUT`` that points elsewhere is
  never written through, whatever the names were.

Both refuse in one line (:class:`~spar_bench.errors.ConfigError`, exit 2).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from spar_bench.errors import ConfigError

#: the longest name (a file name's limit is 255 bytes; a name is joined to others in one)
MAX_NAME = 100
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: the allowed form, as the one-line refusals state it
NAME_FORM = (f"a name is 1-{MAX_NAME} ASCII letters, digits, '_', '-' or '.', starting with a letter or "
             "a digit, without '..' (e.g. rad-dino, qwen2.5-vl-7b)")  # fmt: skip


def name_problem(value: object) -> str | None:
    """What keeps ``value`` from being a name (None: it is one)."""
    if not isinstance(value, str):
        return f"{value!r} is not text"
    if not value:
        return "an empty name"
    if len(value) > MAX_NAME:
        return f"{value[:20]!r}... is {len(value)} characters long"
    if _NAME.fullmatch(value) and ".." not in value:
        return None
    bad = next((c for c in value if not (c.isascii() and (c.isalnum() or c in "_.-"))), None)
    if bad is not None:
        what = {"/": "a '/'", "\\": "a '\\'", "@": "an '@' (it joins names)", ":": "a ':' (it joins names)"}
        return f"{value!r} has {what.get(bad, f'{bad!r} (U+{ord(bad):04X})')}"
    if ".." in value:
        return f"{value!r} has '..'"
    return f"{value!r} starts with {value[0]!r}"


def check_name(value: object, where: str) -> str:
    """``value`` if it is a name (:data:`NAME_FORM`), else one line: ``WHERE: PROBLEM; FORM``
    (``where``: ``file:line: key``, or an option such as ``--kind``)."""
    problem = name_problem(value)
    if problem:
        raise ConfigError(f"{where}: {problem}; {NAME_FORM}")
    return value  # type: ignore[return-value]


def component_problem(part: object) -> str | None:
    """What keeps ``part`` from being one folder name inside another (None: it is one): a run
    folder's parts (``<model>/<probe>/<head>[,variant]/seed<k>``) are made of names a plug-in
    or an option may give, so none may be empty, ``.``/``..`` or hold a separator."""
    if not isinstance(part, str) or part in ("", ".", ".."):
        return f"{part!r} is not a folder name"
    bad = next((c for c in part if c in "/\\\x00"), None)
    return f"{part!r} holds {bad!r}" if bad else None


def inside(path: str | Path, root: str | Path) -> bool:
    """Whether ``path``, resolved (symlinks followed, ``..`` removed), lies under ``root`` resolved."""
    p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return p == r or r in p.parents


def confined(path: str | Path, root: str | Path, what: str = "") -> Path:
    """``path`` if it lies under ``root`` once both are resolved; else one line naming both
    (a name that climbs out, an absolute path, a symlinked folder inside ``root`` that points
    elsewhere): nothing is written there."""
    if inside(path, root):
        return Path(path)
    real = os.path.realpath(path)
    via = "" if os.path.normpath(os.path.abspath(path)) == real else f" (it resolves to {real})"
    label = f"{what} " if what else ""
    raise ConfigError(f"{label}{path} lies outside {root}{via}; every output of an experiment is written "
                      f"inside its out: folder (remove the symbolic link, or rename what names it)")
