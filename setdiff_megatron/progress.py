"""Progress for every long job: a bar on a terminal, plain lines everywhere else.

A progress bar redraws itself with carriage returns, which a terminal turns into one moving line
and a log file (SLURM's, CI's, `2>&1 | tee`) keeps as one line tens of kilobytes long. So
`progress_bar` gives tqdm only when its stream is a terminal, and otherwise `LineProgress`: the
same calls, printing a complete line (done/total, rate, elapsed, ETA and the job's own figures)
at most every `interval_s` seconds and once at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

__all__ = ["interactive", "progress_bar", "LineProgress", "clock"]


def interactive(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default: stderr, where progress goes) is a terminal."""
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def clock(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LineProgress:
    """tqdm's calls used here (update, set_postfix, set_postfix_str, write, close, iteration),
    printed as plain lines."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        file: TextIO | None = None,
        interval_s: float = 30.0,
        disable: bool = False,
        **_: Any,
    ):
        self.iterable, self.desc, self.unit, self.disable = iterable, desc, unit, disable
        self.total = total if total is not None or iterable is None else _len(iterable)
        self.n, self.start_n, self.file, self.interval_s = initial, initial, file, interval_s
        self.start = self.last = time.monotonic()
        self.postfix, self.printed_n = "", None

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval_s or (self.total is not None and self.n >= self.total):
            self.last = now
            self._emit()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def write(self, s: str, file: TextIO | None = None) -> None:
        print(s, file=file or self.file or sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = (self.n - self.start_n) / elapsed if elapsed > 0 else 0.0
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        eta = f", ETA {clock((self.total - self.n) / rate)}" if self.total is not None and rate > 0 else ""
        extra = f", {self.postfix}" if self.postfix else ""
        return (
            f"{self.desc + ': ' if self.desc else ''}{done} {self.unit}, {rate:.3g} {self.unit}/s, "
            f"elapsed {clock(elapsed)}{eta}{extra}"
        )

    def _emit(self) -> None:
        if not self.disable and self.printed_n != self.n:
            self.printed_n = self.n
            self.write(self.line())

    def close(self) -> None:
        self._emit()


def _len(iterable: Iterable) -> int | None:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


def progress_bar(iterable: Iterable | None = None, **kwargs: Any):
    """tqdm on a terminal, LineProgress elsewhere (same keyword arguments: total, desc, unit,
    initial, file, disable, ...)."""
    if interactive(kwargs.get("file")):
        from tqdm import tqdm

        return tqdm(iterable, **{k: v for k, v in kwargs.items() if k != "interval_s"})
    return LineProgress(iterable, **kwargs)
