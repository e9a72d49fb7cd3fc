"""The response cache: every model answer stored once, keyed by everything it depends on.

A key is a JSON object: the model's identity (local folder name + sha256 of its files, or
hub id + revision, or server URL + model name + declared revision), the template version
and the sha256 of the rendered prompt, the question key, the option order, whether the
image was shown and at what size, the decoding parameters and the tool's version. It is
stored under the sha256 of its canonical JSON, *with the key itself*; a read compares the
stored key with the one asked for, so one model's answer can never be returned for
another, even on a hash collision or a hand-edited file.

Answers are committed after each batch, so an interrupted run resumes where it stopped,
and rescoring (a new parser, new bootstrap replicates) costs no model call. An empty reply
(no text, no choice: a server's ``content: null``) is no answer: it is never stored, and one
stored by an older version reads as absent, so it is asked again.

A damaged file is one line, never a traceback: the file is checked when opened
(``PRAGMA quick_check``), and any SQLite error later (a page that goes bad, a full disk)
names the file and what to do.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

from spar_bench.errors import ConfigError, IntegrityError

SCHEMA = "spar-bench-vqa-cache/1"


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(key).encode("utf-8")).hexdigest()


def default_cache(out: str | Path, model: str) -> Path:
    """``OUT/.vqa-cache/<model>.sqlite``: the response cache of backend name ``model``'s runs under ``out``."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "model"
    return Path(out) / ".vqa-cache" / f"{slug[-80:]}.sqlite"


def is_empty(reply: dict[str, Any]) -> bool:
    """A reply that holds no answer: no choice and no (non-blank) text."""
    text = reply.get("text")
    return reply.get("choice") is None and not (isinstance(text, str) and text.strip())


class ResponseCache:
    """A SQLite file of ``(sha256(key), key, reply)`` rows.

    >>> with ResponseCache("runs/.vqa-cache/model.sqlite") as c:
    ...     c.get(key)            # the stored reply dict, or None
    ...     c.put_many([(key, reply), ...])
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(self.path))
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS replies "
                "(hash TEXT PRIMARY KEY, key TEXT NOT NULL, reply TEXT NOT NULL)"
            )
            self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (SCHEMA,))
            self._db.commit()
            (schema,) = self._db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
            (check,) = self._db.execute("PRAGMA quick_check(1)").fetchone()
        except sqlite3.DatabaseError as e:
            if "full" in str(e).lower():  # SQLITE_FULL: a full disk, not a damaged file
                raise self._damaged(e) from None
            raise ConfigError(f"{self.path}: not a readable SPAR-Bench response cache ({e}); "
                              "delete it (its answers are asked again) or pass another --cache") from None
        if schema != SCHEMA:
            raise ConfigError(f"{self.path}: response cache schema {schema!r}, expected {SCHEMA!r}")
        if check != "ok":
            raise self._damaged("it fails SQLite's quick_check")

    def _damaged(self, what: object) -> ConfigError:
        """The one-line error of a cache file SQLite cannot read or write."""
        text = str(what).splitlines()[0] if str(what) else type(what).__name__
        if "full" in text.lower():
            return ConfigError(f"{self.path}: cannot write the response cache ({text}); free space and "
                               "rerun (the answers stored so far are kept)")
        return ConfigError(f"{self.path}: the response cache is damaged ({text}); delete the file "
                           "(its answers are asked again) or pass another --cache")

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The reply stored for exactly ``key``, or None (also for an empty one: :func:`is_empty`)."""
        try:
            row = self._db.execute(
                "SELECT key, reply FROM replies WHERE hash=?", (key_hash(key),)
            ).fetchone()
        except sqlite3.DatabaseError as e:
            raise self._damaged(e) from None
        if row is None:
            return None
        if row[0] != canonical(key):
            raise IntegrityError(
                f"{self.path}: a stored answer's key differs from the key it is filed under; "
                "delete the cache file"
            )
        reply = json.loads(row[1])
        return None if is_empty(reply) else reply

    def put_many(self, items: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Store replies and commit (one transaction); an empty reply (:func:`is_empty`) is left out."""
        rows = [(key_hash(k), canonical(k), canonical(r)) for k, r in items if not is_empty(r)]
        try:
            with self._db:
                self._db.executemany("INSERT OR REPLACE INTO replies VALUES (?, ?, ?)", rows)
        except sqlite3.DatabaseError as e:
            raise self._damaged(e) from None

    def __len__(self) -> int:
        try:
            return int(self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0])
        except sqlite3.DatabaseError as e:
            raise self._damaged(e) from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ResponseCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
