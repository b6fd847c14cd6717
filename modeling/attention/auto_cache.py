"""The disk cache of attn_implementation="auto" (auto_backend.py): one JSON file per user, holding what was
measured on this machine, entry by entry, with the torch and swapformer versions that measured it.

Where: `$SWAPFORMER_CACHE_DIR/auto_backend.json`, else `$XDG_CACHE_HOME/swapformer/`, else
`~/.cache/swapformer/`. Entries are keyed by the situation (device and its name, dtype, layer config, length
bucket, ...), so one file serves every machine that shares a home folder; an entry measured by another torch
or swapformer version is ignored (kernels change between versions) and replaced when measured again. Writes
merge with what another process wrote since this one read the file, then replace it atomically (temporary
file + os.replace), so a reader never sees half a file.

A situation is measured under `measuring_lock`, an exclusive lock on a file beside the cache: processes of one
machine that meet the same situation together (the ranks of a multi-process run, parallel jobs) measure it
once. The first takes the lock and measures, alone on the machine's cores; the others wait, then read its
entry, so they all run the same backend. Where the folder cannot be written or the system has no `fcntl`
(Windows), nothing is locked and each process measures for itself.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from transformers.utils import logging

try:
    import fcntl
except ImportError:  # Windows: no locking (see the module docstring)
    fcntl = None

logger = logging.get_logger(__name__)

FILE_NAME = "auto_backend.json"
LOCK_NAME = "auto_backend.lock"
FORMAT = 1
_entries: dict | None = None  # the file's entries as this process last read or wrote them
_warned = False


def cache_file() -> Path:
    """The cache file of this user (the folder need not exist yet)."""
    folder = os.environ.get("SWAPFORMER_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "swapformer")
    return Path(folder) / FILE_NAME


def versions() -> dict[str, str]:
    """What makes a measurement stale: the torch and swapformer that measured it."""
    try:
        ours = version("swapformer")
    except PackageNotFoundError:  # remote code loaded where swapformer is not installed
        ours = "remote-code"
    return {"torch": torch.__version__, "swapformer": ours}


def _read() -> dict:
    """Every entry of the file (any version); {} when there is none or it cannot be read as JSON."""
    try:
        data = json.loads(cache_file().read_text())
        return dict(data["entries"]) if data.get("format") == FORMAT else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _warn(f"ignoring the unreadable auto-backend cache {cache_file()} ({e}); it will be rewritten")
        return {}


def entries(*, current: bool = True) -> dict[str, dict]:
    """{key: entry} from the file (read once per process); only those of this torch and swapformer when
    `current`."""
    global _entries
    if _entries is None:
        _entries = _read()
    if not current:
        return dict(_entries)
    now = versions()
    return {k: e for k, e in _entries.items() if all(e.get(name) == v for name, v in now.items())}


def lookup(key: str) -> dict | None:
    """The entry of `key` measured by this torch and swapformer, or None."""
    return entries().get(key)


def store(key: str, entry: dict) -> None:
    """Add `entry` (with the versions and the time) under `key`, merged into what the file holds now. A
    folder that cannot be written is warned about once; the choice is kept in memory for this process."""
    global _entries
    record = {**entry, **versions(), "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    merged = {**_read(), key: record}
    _entries = merged
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".auto_backend.", suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            json.dump({"format": FORMAT, "entries": merged}, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as e:
        _warn(
            f"could not write the auto-backend cache {path} ({e}); set SWAPFORMER_CACHE_DIR to a writable folder"
        )


@contextmanager
def measuring_lock():
    """Hold the machine's measuring lock (the module docstring says why); wait while another process holds it."""
    path = cache_file().with_name(LOCK_NAME)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 - closed below, after the lock is released
    except OSError:  # store() warns about the folder; measure without the lock
        handle = None
    if handle is None or fcntl is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def forget() -> None:
    """Read the file again at the next lookup (tests, and a process that changed SWAPFORMER_CACHE_DIR)."""
    global _entries
    _entries = None


def _warn(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(message)
