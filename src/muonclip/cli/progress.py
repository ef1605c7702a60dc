"""A one-line progress bar for training (no dependency): step, loss, tokens/s, ETA.

On a terminal the line is redrawn in place (``\\r``) at most ``refresh`` times per second; when
the stream is not a terminal (a log file, CI) a full line is printed every ``every`` steps and
at the end, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1m15s"``; ``3700`` -> ``"1h01m"``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def format_rate(tokens_per_s: float) -> str:
    """``12345`` -> ``"12.3k"``."""
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


class Progress:
    """Progress of one run.

    Args:
        label: shown first, e.g. the optimizer name.
        total: total steps.
        start: the step the run starts from (non-zero on resume).
        tokens_per_step: tokens in one step, for tokens/s.
        stream: where to write (default sys.stderr).
        enabled: False to print nothing (default True).
        every: on a non-terminal stream, print a line every this many steps (default 50).
        refresh: on a terminal, redraws per second at most (default 10).
    """

    def __init__(self, label: str, total: int, *, start: int = 0, tokens_per_step: int = 0,
                 stream: TextIO | None = None, enabled: bool = True, every: int = 50, refresh: float = 10.0) -> None:
        self.label, self.total, self.start = label, total, start
        self.tokens_per_step = tokens_per_step
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.every = max(1, every)
        self.min_interval = 1.0 / refresh
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self.extra = ""

    def line(self, step: int, loss: float) -> str:
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("nan")
        frac = step / self.total if self.total else 1.0
        width = 20
        filled = int(frac * width)
        bar = "#" * filled + "-" * (width - filled)
        tok = format_rate(rate * self.tokens_per_step)
        eta_s = format_duration(eta) if eta == eta else "?"
        return (f"[{self.label}] {step}/{self.total} [{bar}] {100 * frac:3.0f}% | loss {loss:.4f} | "
                f"{tok} tok/s | ETA {eta_s}{self.extra}")

    def update(self, step: int, loss: float) -> None:
        """Report that ``step`` steps are done and the last training loss was ``loss``."""
        if not self.enabled:
            return
        now = time.perf_counter()
        last = step >= self.total
        if self.tty:
            if last or now - self._last_draw >= self.min_interval:
                self.stream.write("\r" + self.line(step, loss) + "\033[K")
                self.stream.flush()
                self._last_draw = now
        elif last or step % self.every == 0:
            self.stream.write(self.line(step, loss) + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line of text without breaking the bar."""
        if not self.enabled:
            return
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


__all__ = ["Progress", "format_duration", "format_rate"]
