"""Progress of long work: a tqdm bar on a terminal, plain periodic lines in a log file.

A redrawn bar is unreadable in a scheduler's log (carriage returns, one line per redraw), so when
the stream is not a terminal the same information is printed as one line at most every
``interval_s`` seconds, plus the first and the last update::

    [train] 120/300 (40%) loss=2.310 bpb=3.330 tok_s=2013 | 61 s elapsed, ~92 s left
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


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
        self._start_n = initial
        self._last_line = -float("inf")
        self._bar = None
        isatty = getattr(self.stream, "isatty", lambda: False)()
        if enabled and isatty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc or None,
                file=self.stream,
                dynamic_ncols=True,
                unit=unit,
                mininterval=1.0,
            )

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advances by `n`; `postfix` values are shown as ``key=value``."""
        self.n += n
        if not self.enabled:
            return
        text = {k: _short(v) for k, v in postfix.items()}
        if self._bar is not None:
            self._bar.set_postfix(text, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        first = self.n - n == self._start_n
        if first or self.n >= self.total or now - self._last_line >= self.interval_s:
            self._last_line = now
            print(self._line(text, now), file=self.stream, flush=True)

    def _line(self, postfix: dict[str, str], now: float) -> str:
        elapsed = now - self._t0
        done = self.n - self._start_n
        left = (self.total - self.n) * elapsed / done if done > 0 else float("nan")
        pct = 100.0 * self.n / self.total if self.total else 100.0
        fields = " ".join(f"{k}={v}" for k, v in postfix.items())
        eta = f", ~{left:.0f} s left" if self.n < self.total and left == left else ""
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


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)
