"""Progress lines of long benchmark runs: which case and backend runs, which phase, how many
iterations are done, and a heartbeat while one step takes long, so that a user can tell slow
work from a hang.

Lines go to stdout (flushed) from one process (rank 0), prefixed with the benchmark's name:

    [layer] Kimi-K2, 48 exp/GPU (case 1/1) | megatron-alltoall (1/1): timed iteration 3/5 done
    [layer] Kimi-K2, 48 exp/GPU (case 1/1) | megatron-alltoall (1/1): still building the layer (30 s)

A heartbeat line is printed every ``heartbeat_s`` seconds during which nothing else was printed.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of one benchmark process.

    Args:
        name: the benchmark ("layer", "e2e"), the prefix of every line.
        enabled: False on ranks other than 0 (nothing is printed).
        heartbeat_s: seconds of silence after which a "still ..." line is printed (0: never).
        min_interval_s: iteration lines closer together than this are skipped (the last
            iteration of a phase is always printed).
        stream: where lines go (default stdout).
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(self, name: str, *, enabled: bool = True, heartbeat_s: float = 30.0, min_interval_s: float = 2.0,
                 stream: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.enabled = enabled
        self.heartbeat_s = heartbeat_s
        self.min_interval_s = min_interval_s
        self.stream = stream
        self.clock = clock
        self.context = ""
        self.activity = ""
        self._activity_since = clock()
        self._last_line = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if enabled and heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, name=f"{name}-progress", daemon=True)
            self._thread.start()

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(text + "\n")
        stream.flush()

    def line(self, text: str) -> None:
        """Print ``[name] context: text``."""
        if not self.enabled:
            return
        with self._lock:
            self._last_line = self.clock()
            prefix = f"[{self.name}] {self.context}: " if self.context else f"[{self.name}] "
            self._write(prefix + text)

    def set_context(self, context: str) -> None:
        """What runs now (case and backend), the prefix of the next lines."""
        self.context = context

    def phase(self, activity: str) -> None:
        """Start a phase ("building the layer", "checking against the reference", ...): one line,
        and the heartbeat names it from now on."""
        self.activity = activity
        self._activity_since = self.clock()
        self.line(activity)

    def iteration(self, done: int, total: int, what: str = "iteration", detail: str = "") -> None:
        """``done`` of ``total`` iterations of the current phase (``detail`` appended to the
        line); printed when ``min_interval_s`` passed since the last line, or at the last one."""
        self.activity = f"running {what} {done + 1}/{total}" if done < total else f"finishing {what}s"
        self._activity_since = self.clock()
        if done == total or self.clock() - self._last_line >= self.min_interval_s:
            self.line(f"{what} {done}/{total} done{detail}")

    def heartbeat_text(self) -> Optional[str]:
        """The heartbeat line due now, or None."""
        now = self.clock()
        if not self.enabled or self.heartbeat_s <= 0 or now - self._last_line < self.heartbeat_s:
            return None
        what = self.activity or "working"
        return f"still {what} ({now - self._activity_since:.0f} s)"

    def _beat(self) -> None:
        while not self._stop.wait(min(5.0, self.heartbeat_s / 2)):
            text = self.heartbeat_text()
            if text is not None:
                self.line(text)

    def close(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
