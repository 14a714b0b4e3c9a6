"""A build that takes a while says so: one updating line on a terminal, plain lines when piped.

The library stays quiet unless a program turns this on (``enable()``): the puzzle's runner does, so that a
learner never waits on a silent screen while MAX compiles. ``building(label).run(work)`` runs ``work`` in a
thread and keeps the main thread free, so Ctrl-C stops the wait at once.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

QUIET_S = 1.0       # a wait shorter than this prints nothing (a cached build takes well under it)
PLAIN_EVERY_S = 10  # piped output: one line per this many seconds of a long build

_stream: TextIO | None = None


def enable(stream: TextIO | None = None) -> None:
    """Report builds on ``stream`` (default: standard error) from now on."""
    global _stream
    _stream = stream or sys.stderr


class building:
    """``with building(label) as b: b.run(work)``: ``building <label> ... N s`` shown while the block runs past
    ``QUIET_S``, its time counted from the block's start, and a last line when it ends.

    ``run(work)`` calls ``work()`` in a thread (MAX releases the GIL while it compiles) and waits in this one,
    so the line keeps moving and KeyboardInterrupt reaches the caller at once. The work's thread is a daemon
    and is left behind: a program that catches the interrupt should exit. Work that needs this thread (MAX's
    graph building: its MLIR context is the main thread's) runs between ``run`` calls.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = time.perf_counter()
        self.line = _Line(_stream, label) if _stream is not None else None

    def __enter__(self) -> building:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        if self.line is not None:
            if kind is KeyboardInterrupt:
                self.line.interrupted()
            elif kind is None:
                self.line.update(time.perf_counter() - self.start, done=True)
            else:
                self.line.failed(time.perf_counter() - self.start)

    def run(self, work: Callable[[], T]) -> T:
        """``work()``, its wait shown on the line; raises what ``work`` raised."""
        if self.line is None:
            return work()
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = work()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=call, name=f"build {self.label}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive():
                self.line.update(time.perf_counter() - self.start, done=False)
        if "error" in box:
            raise box["error"]
        return box["value"]


class _Line:
    """The one progress line: rewritten in place on a terminal, a plain line now and then otherwise."""

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream, self.label = stream, label
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = False
        self.last_plain = -1

    def update(self, seconds: float, done: bool) -> None:
        if seconds < QUIET_S and not self.shown:
            return   # a quick build (a cached one) says nothing
        if self.tty:
            state = "done" if done else "..."
            self._write(f"\r\033[K  building {self.label} {state} {seconds:.0f} s" + ("\n" if done else ""))
        elif done:
            self._write(f"  built {self.label} in {seconds:.1f} s\n")
        elif int(seconds) // PLAIN_EVERY_S != self.last_plain:
            self.last_plain = int(seconds) // PLAIN_EVERY_S
            self._write(f"  building {self.label} ... {seconds:.0f} s\n")
        self.shown = True

    def failed(self, seconds: float) -> None:
        if self.shown:
            self._write(("\r\033[K" if self.tty else "") + f"  building {self.label}: failed after {seconds:.0f} s\n")

    def interrupted(self) -> None:
        if self.shown:
            self._write(("\r\033[K" if self.tty else "") + f"  building {self.label}: interrupted\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
