"""A progress line on stderr: rewritten in place on a terminal, one line per step in logs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()

    def step(self, message: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        line = f"[{self.done:>{len(str(self.total))}}/{self.total} {elapsed:6.0f}s] {message}"
        if self.tty:
            width = 140
            self.stream.write("\r" + line[:width].ljust(width))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        """A message that must stay visible (a skip reason, a warning)."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + " " * 140 + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
