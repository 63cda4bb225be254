"""Progress of long work: a tqdm bar on a terminal, plain periodic lines in a log file.

A redrawn bar is unreadable in a scheduler's log (carriage returns, one line per redraw), so when
the stream is not a terminal the same information is printed as one line at most every
``interval_s`` seconds, plus the first and the last update::

    [train] 120/300 (40%) loss=2.310 bpb=3.330 tok_s=2013 | 61 s elapsed, ~92 s left

The rate behind the time left leaves out the first update, which pays for compilation: it is
``(n − n₁) / (t − t₁)`` with ``(n₁, t₁)`` the count and time of the first update, so no time left
is shown (``?`` on the bar) until a second update was timed. A terminal that reports no width
(0 columns, as some pseudo-terminals do) gets a bar of :data:`FALLBACK_COLUMNS` columns.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import IO, Any

FALLBACK_COLUMNS = 80  # bar width when the terminal reports none


class Progress:
    """``update(n, **postfix)`` / ``write(line)`` / ``close()`` over a bar or periodic lines.

    Args:
      total: number of units of work.
      initial: units already done (a resumed run).
      desc: a short label.
      unit: the unit's name (tqdm).
      stream: where to draw / print (default: stderr).
      interval_s: seconds between plain lines when `stream` is not a terminal.
      enabled: False draws no progress (switched off, or nothing to do).
      echo: whether :meth:`write` prints (False on JAX processes other than 0).
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        stream: IO[str] | None = None,
        interval_s: float = 30.0,
        enabled: bool = True,
        echo: bool = True,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total, self.n, self.desc = total, initial, desc
        self.interval_s = interval_s
        self.enabled = enabled
        self.echo = echo
        self._t0 = time.monotonic()
        self._first: tuple[int, float] | None = None  # (n, time) after the first update
        self._last_t = self._t0
        self._last_line = -float("inf")
        self._bar = None
        isatty = getattr(self.stream, "isatty", lambda: False)()
        if enabled and isatty:
            # tqdm sizes the bar to the terminal minus one column; a 0 x 0 answer becomes
            # width -1 (every line trimmed away) and -1 rows (nothing displayed).
            size = _terminal_size(self.stream)
            blank = size is not None and min(size) < 1
            fixed = {"ncols": FALLBACK_COLUMNS, "nrows": 20} if blank else {}
            self._bar = _bar_class()(
                total=total,
                initial=initial,
                desc=desc or None,
                file=self.stream,
                dynamic_ncols=not blank,
                unit=unit,
                mininterval=1.0,
                **fixed,
            )
            self._bar.rate_fn = self.rate

    def rate(self) -> float | None:
        """Units per second since the first update (which includes compilation); None until a
        later update was timed."""
        if self._first is None:
            return None
        n1, t1 = self._first
        dt = self._last_t - t1
        return (self.n - n1) / dt if self.n > n1 and dt > 0 else None

    def status(self, text: str) -> None:
        """Shows what is running before the first update (e.g. ``compiling…``): on the bar as its
        postfix, in a log as one line."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text)
            return
        label = f"[{self.desc}] " if self.desc else ""
        print(f"{label}{self.n}/{self.total} {text}", file=self.stream, flush=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advances by `n`; `postfix` values are shown as ``key=value``."""
        self.n += n
        now = time.monotonic()
        self._last_t = now
        first = self._first is None
        if first:
            self._first = (self.n, now)
        if not self.enabled:
            return
        text = {k: _short(v) for k, v in postfix.items()}
        if self._bar is not None:
            self._bar.set_postfix(text, refresh=False)
            self._bar.update(n)
            return
        if first or self.n >= self.total or now - self._last_line >= self.interval_s:
            self._last_line = now
            print(self._line(text, now), file=self.stream, flush=True)

    def _line(self, postfix: dict[str, str], now: float) -> str:
        elapsed = now - self._t0
        rate = self.rate()
        pct = 100.0 * self.n / self.total if self.total else 100.0
        fields = " ".join(f"{k}={v}" for k, v in postfix.items())
        left = (self.total - self.n) / rate if rate else None
        eta = f", ~{left:.0f} s left" if self.n < self.total and left is not None else ""
        label = f"[{self.desc}] " if self.desc else ""
        return f"{label}{self.n}/{self.total} ({pct:.0f}%) {fields} | {elapsed:.0f} s elapsed{eta}"

    def write(self, line: str) -> None:
        """Prints `line` on stdout without breaking the bar."""
        if not self.echo:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@functools.cache
def _bar_class():
    """A tqdm whose rate (hence time left) comes from :meth:`Progress.rate`."""
    from tqdm import tqdm

    class Bar(tqdm):
        rate_fn = None

        @property
        def format_dict(self):
            d = super().format_dict
            if self.rate_fn is not None:
                # 0, not None: tqdm replaces None by the average since the start (compilation
                # included) and shows "?" for 0.
                d["rate"] = self.rate_fn() or 0.0
            return d

    return Bar


def _terminal_size(stream: IO[str]) -> tuple[int, int] | None:
    """(columns, lines) of the terminal behind `stream`, as tqdm reads it; None when unknown."""
    try:
        return tuple(os.get_terminal_size(stream.fileno()))
    except (AttributeError, OSError, ValueError):
        return None


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)
