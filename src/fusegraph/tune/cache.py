"""The on-disk tuning cache: one JSON file per full key, named by the key's sha256.

    <settings.cache_dir>/tune/<sha256>.json   {"schema", "key", "config", "timings", "tuning_s", "created"}

Writes go to a temporary file in the same folder, are fsynced, then `os.replace`d over the entry,
so a reader sees either no entry or a whole one, whatever other processes do at the same time.
There is no shared index to lock. An entry that does not parse, has another schema, or holds
another key is deleted with a `CacheWarning` and tuned again, never trusted.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..settings import settings
from .config import Config
from .keys import SCHEMA_VERSION, FullKey, canonical, digest, library_versions

ENTRY_SUFFIX = ".json"
TEMP_SUFFIX = ".tmp"
# A temporary file this old belongs to a writer that died; younger ones may be in flight.
ABANDONED_TEMP_AGE_S = 60.0


class CacheWarning(UserWarning):
    """A cache entry could not be read or written; fusegraph tunes again instead."""


@dataclass(frozen=True)
class Timing:
    """One candidate's measurement: its median time in ms, or why it could not run."""
    config: Config
    ms: float | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_json(), "ms": self.ms, "error": self.error}

    @classmethod
    def from_json(cls, data: Any) -> Timing:
        if not isinstance(data, dict):
            raise TypeError("a timing must be a JSON object")
        ms, error = data.get("ms"), data.get("error")
        if ms is not None and not isinstance(ms, (int, float)):
            raise TypeError(f"timing ms must be a number, got {ms!r}")
        if error is not None and not isinstance(error, str):
            raise TypeError(f"timing error must be a string, got {error!r}")
        return cls(Config.from_json(data.get("config")), None if ms is None else float(ms), error)


@dataclass(frozen=True)
class CacheEntry:
    """The choice made for one full key, with what it was chosen from."""
    config: Config
    timings: tuple[Timing, ...] = ()
    tuning_s: float = 0.0
    created: float = field(default_factory=time.time)


@dataclass(frozen=True)
class ScannedEntry:
    """What `TuneCache.scan` found in one file (for `fusegraph cache info` / `clear`)."""
    path: Path
    size: int
    name: str | None          # kernel name, None when unreadable
    problem: str | None       # why the entry is unusable, None when it is fine
    stale: bool               # written by another schema or other library versions


def default_directory() -> Path:
    return Path(settings.cache_dir).expanduser() / "tune"


class TuneCache:
    """The tuning cache in one directory (default: settings.cache_dir / "tune", read at creation)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else default_directory()

    def path_for(self, key: FullKey) -> Path:
        return self.directory / (digest(key) + ENTRY_SUFFIX)

    def load(self, key: FullKey) -> CacheEntry | None:
        """The entry stored for `key`, or None (missing, or corrupt: then deleted with a warning)."""
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as err:
            warnings.warn(f"cannot read tuning cache entry {path}: {err}; tuning again", CacheWarning,
                          stacklevel=2)
            return None
        try:
            return _parse_entry(raw, expected_key=canonical(key))
        except (ValueError, TypeError, KeyError) as err:
            warnings.warn(f"tuning cache entry {path} is corrupt ({err}); deleting it and tuning again",
                          CacheWarning, stacklevel=2)
            _delete_if_unchanged(path, stat)
            return None

    def store(self, key: FullKey, entry: CacheEntry) -> Path | None:
        """Write `entry` atomically; returns its path, or None (with a warning) when the disk refused."""
        path = self.path_for(key)
        data = {
            "schema": SCHEMA_VERSION,
            "key": canonical(key),
            "config": entry.config.to_json(),
            "timings": [t.to_json() for t in entry.timings],
            "tuning_s": entry.tuning_s,
            "created": entry.created,
        }
        text = json.dumps(data, sort_keys=True, indent=1, allow_nan=False) + "\n"
        try:
            write_atomically(path, text.encode("ascii"))
        except OSError as err:
            warnings.warn(f"cannot write tuning cache entry {path}: {err}", CacheWarning, stacklevel=2)
            return None
        return path

    def entry_paths(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir()
                      if p.name.endswith(ENTRY_SUFFIX) and not p.name.startswith("."))

    def scan(self) -> Iterator[ScannedEntry]:
        current = canonical(library_versions())
        for path in self.entry_paths():
            try:
                raw = path.read_bytes()
            except OSError as err:  # removed by a concurrent clear, or unreadable
                yield ScannedEntry(path, 0, None, f"unreadable: {err}", False)
                continue
            try:
                data = json.loads(raw.decode("ascii"))
                key = data["key"]
                _check_entry(data, expected_key=key, file_stem=path.stem)
            except (ValueError, TypeError, KeyError) as err:
                yield ScannedEntry(path, len(raw), None, str(err), False)
                continue
            stale = key.get("versions") != current
            yield ScannedEntry(path, len(raw), str(key.get("name")), None, stale)

    def clear(self, *, stale_only: bool = False, name: str | None = None) -> int:
        """Remove entries (all, or only stale and corrupt ones; optionally of one kernel); returns how many."""
        removed = 0
        for found in self.scan():
            if name is not None and found.name != name:
                continue
            if stale_only and not (found.stale or found.problem):
                continue
            with contextlib.suppress(FileNotFoundError):
                found.path.unlink()
                removed += 1
        if name is None:
            self._remove_abandoned_temp_files()
        return removed

    def _remove_abandoned_temp_files(self) -> None:
        if not self.directory.is_dir():
            return
        now = time.time()
        for p in self.directory.iterdir():
            if p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX):
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > ABANDONED_TEMP_AGE_S:
                        p.unlink()


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the whole new one: a temporary file in
    the same folder, fsynced, renamed over it, the folder fsynced (OSError when the disk refuses)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="." + path.stem + ".", suffix=TEMP_SUFFIX, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_directory(path.parent)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _parse_entry(raw: bytes, expected_key: Any) -> CacheEntry:
    if not raw:
        raise ValueError("empty file")
    data = json.loads(raw.decode("ascii"))
    _check_entry(data, expected_key)
    timings = tuple(Timing.from_json(t) for t in data.get("timings", []))
    tuning_s, created = data.get("tuning_s", 0.0), data.get("created", 0.0)
    if not isinstance(tuning_s, (int, float)) or not isinstance(created, (int, float)):
        raise TypeError("tuning_s and created must be numbers")
    return CacheEntry(Config.from_json(data["config"]), timings, float(tuning_s), float(created))


def _check_entry(data: Any, expected_key: Any, file_stem: str | None = None) -> None:
    if not isinstance(data, dict):
        raise TypeError(f"entry is a JSON {type(data).__name__}, not an object")
    if data.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
    if data.get("key") != expected_key:
        raise ValueError("the stored key is not the key this file is named for")
    if file_stem is not None and digest(expected_key) != file_stem:
        raise ValueError("file name is not the digest of the stored key")
    Config.from_json(data.get("config"))
    if not isinstance(data.get("timings", []), list):
        raise TypeError("timings must be a list")


def _delete_if_unchanged(path: Path, seen: os.stat_result) -> None:
    """Delete `path` unless another process replaced it since we read it (then theirs is fresh)."""
    with contextlib.suppress(OSError):
        now = os.stat(path)
        if (now.st_ino, now.st_dev) == (seen.st_ino, seen.st_dev):
            os.unlink(path)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every platform opens directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["CacheEntry", "CacheWarning", "ScannedEntry", "Timing", "TuneCache",
           "default_directory"]
