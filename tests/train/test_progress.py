"""Progress: a bar on a terminal, plain periodic lines in a log file."""

from __future__ import annotations

import io

from nested_jax.train.progress import FALLBACK_COLUMNS, Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_file_gets_plain_lines_first_periodic_and_last():
    log = io.StringIO()
    p = Progress(10, initial=2, desc="train", stream=log, interval_s=3600)
    for _ in range(8):
        p.update(1, loss=2.5, tok_s=1234.0)
    p.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 2  # the first update and the last; the interval suppresses the rest
    assert lines[0].startswith("[train] 3/10 (30%) loss=2.500 tok_s=1234")
    assert lines[1].startswith("[train] 10/10 (100%)") and "left" not in lines[1]


def test_every_update_prints_once_the_interval_has_passed():
    log = io.StringIO()
    p = Progress(3, stream=log, interval_s=0.0)
    for _ in range(3):
        p.update(1)
    assert len(log.getvalue().splitlines()) == 3


def test_a_terminal_gets_a_redrawn_bar():
    term = _Terminal()
    p = Progress(5, desc="train", stream=term)
    p.update(5, loss=1.0)
    p.close()
    assert "\r" in term.getvalue() and "5/5" in term.getvalue()


def test_disabled_progress_prints_nothing_but_write_still_echoes(capsys):
    log = io.StringIO()
    p = Progress(5, stream=log, enabled=False)
    p.update(5)
    p.write("step 5: val loss 1.0")
    assert log.getvalue() == "" and capsys.readouterr().out == "step 5: val loss 1.0\n"
    quiet = Progress(5, stream=log, enabled=False, echo=False)
    quiet.write("not shown")
    assert capsys.readouterr().out == ""


def test_time_left_leaves_out_the_first_update_that_compiles(monkeypatch):
    clock = iter([0.0, 100.0, 101.0, 102.0, 103.0])  # start; compile ends; then 1 s per step
    monkeypatch.setattr("nested_jax.train.progress.time.monotonic", lambda: next(clock))
    log = io.StringIO()
    p = Progress(10, desc="train", stream=log, interval_s=0.0)
    p.update(1)
    assert p.rate() is None  # nothing timed after compilation yet
    p.update(1)
    p.update(1)
    lines = log.getvalue().splitlines()
    assert lines[0] == "[train] 1/10 (10%)  | 100 s elapsed"  # no time left while compiling
    # 2 steps in 2 s after the first: 1 step/s, 7 left; the 100 s compile would say ~233 s.
    assert p.rate() == 1.0 and lines[2].endswith("| 102 s elapsed, ~7 s left")


def test_the_bar_shows_no_time_left_until_a_step_after_compilation(monkeypatch):
    clock = iter([0.0, 100.0, 101.0, 102.0])
    monkeypatch.setattr("nested_jax.train.progress.time.monotonic", lambda: next(clock))
    term = _Terminal()
    p = Progress(10, desc="train", stream=term)
    p.update(1)
    assert p._bar.format_dict["rate"] == 0.0  # tqdm shows "?" for a zero rate
    assert "<?," in str(p._bar)
    p.update(1)
    p.update(1)
    assert p._bar.format_dict["rate"] == 1.0 and "<00:07," in str(p._bar)
    p.close()


def test_a_terminal_of_zero_columns_gets_a_fixed_width_bar(monkeypatch):
    import os

    class _Pty(_Terminal):
        def fileno(self):
            return 2

    # tqdm asks os.get_terminal_size; some pseudo-terminals answer 0 columns.
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((0, 0)))
    term = _Pty()
    p = Progress(5, desc="eval", stream=term)
    p.update(5, loss=1.0)
    p.close()
    frames = [f for f in term.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    assert frames and "5/5" in frames[-1] and "loss=1.000" in frames[-1]
    assert max(len(f) for f in frames) <= FALLBACK_COLUMNS


def test_status_says_what_runs_before_the_first_update():
    log = io.StringIO()
    p = Progress(4, desc="eval niah", stream=log)
    p.status("compiling…")
    p.update(4)
    assert log.getvalue().splitlines()[0] == "[eval niah] 0/4 compiling…"
    term = _Terminal()
    bar = Progress(4, desc="eval niah", stream=term)
    bar.status("compiling…")
    assert "compiling…" in term.getvalue()
    bar.close()
