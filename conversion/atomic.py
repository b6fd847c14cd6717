"""Writing the output folder without ever leaving half of it, or losing what was there.

Everything is written to a hidden sibling of `out` first ("partial") and moved into place only after
verification; an existing `out` (replaced only with --overwrite) is parked aside ("old") until the new
one is in. SIGINT and SIGTERM become `ConversionInterrupted`, so the cleanup runs, and they are held
back while the final renames run. What a SIGKILL leaves is cleaned up by the next conversion to the
same `out`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import threading
import time
from pathlib import Path


class ConversionInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM during `convert`. A KeyboardInterrupt, so `except Exception` in
    between does not swallow it; `signum` is the signal (exit code 128 + signum)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class Signals:
    """While active, SIGINT and SIGTERM raise ConversionInterrupted, so that the `finally` removing the
    scratch folder runs (SIGTERM's default action would end the process on the spot and leave it).
    Inside `deferred()` a signal is only recorded, and raised when the block ends: the final renames
    and the cleanup are never cut in half. Handlers can only be set from the main thread; elsewhere
    the signals keep whatever handling they had."""

    def __init__(self, out: Path):
        self.out = out
        self.previous: dict = {}
        self.deferring = False
        self.pending: int | None = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.deferring:
            self.pending = signum
            return
        raise self._interrupted(signum, None)

    def _interrupted(self, signum: int, done: str | None) -> ConversionInterrupted:
        name = signal.Signals(signum).name
        if done is None:
            return ConversionInterrupted(
                signum, f"interrupted by {name}; nothing was written: {self.out} is as it was"
            )
        return ConversionInterrupted(signum, f"interrupted by {name} after {done}")

    @contextlib.contextmanager
    def deferred(self, done: str | None = None):
        """Hold signals back for the block; one that came meanwhile is raised after it, saying what
        was `done` (None: nothing was written)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise self._interrupted(signum, done)


def pause_for_tests(point: str, signals: Signals) -> None:
    """Test hook: with SWAPFORMER_TEST_PAUSE_CONVERT=point, say so on stdout and wait for a signal, so
    a test can interrupt the conversion at a known place without racing it. (Polls: a signal held back
    by `deferred` may arrive before a pause() would start.)"""
    if os.environ.get("SWAPFORMER_TEST_PAUSE_CONVERT") == point:
        print(f"paused at {point}", flush=True)
        while signals.pending is None:
            time.sleep(0.01)


def finish(tmp: Path, out: Path, signals: Signals) -> None:
    """Move the verified folder into place: an existing `out` is renamed aside, the new one renamed
    in, the old one removed; signals wait until all three are done."""
    with signals.deferred(done=f"{out} was written completely"):
        pause_for_tests("swap", signals)
        if out.exists():
            old = sibling(out, "old")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)


def sibling(out: Path, kind: str, pid: int | None = None) -> Path:
    """The hidden folder beside `out` that this process (or `pid`) writes to ("partial") or parks the
    replaced `out` in ("old")."""
    return out.parent / f".{out.name}.{kind}-{os.getpid() if pid is None else pid}"


def alive(pid: int) -> bool:
    if os.name != "posix":  # no cheap liveness probe elsewhere: treat as alive, touch nothing
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(out: Path, log) -> None:
    """What a conversion killed outright (SIGKILL, power loss) left beside `out`: its partial folder
    is removed; a replaced `out` parked aside is put back if `out` is missing, else removed."""
    if not out.parent.is_dir():
        return
    for kind in ("partial", "old"):
        for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            pid = path.name.rsplit("-", 1)[1]
            if not pid.isdigit() or int(pid) == os.getpid() or alive(int(pid)):
                continue
            if kind == "old" and not out.exists():
                os.replace(path, out)
                log(
                    f"restored {out} from {path.name}, left by a conversion that was killed while replacing it"
                )
            else:
                shutil.rmtree(path)
                log(f"removed {path}, left by a conversion that was killed (process {pid})")


def scratch(out: Path) -> Path:
    tmp = sibling(out, "partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def discard_unfinished(tmp: Path, out: Path, signals: Signals) -> None:
    """After the conversion, finished or not: a scratch folder still there was not moved into place
    and is removed (signals wait); a signal held back says whether `out` was written."""
    finished = not tmp.exists()
    with signals.deferred(done=f"{out} was written completely" if finished else None):
        if not finished:
            shutil.rmtree(tmp)
