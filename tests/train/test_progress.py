"""Progress: a bar on a terminal, plain periodic lines in a log file."""

from __future__ import annotations

import io

from nested_jax.train.progress import Progress


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
