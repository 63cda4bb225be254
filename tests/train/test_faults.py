"""Fault injection (tests/train/faults.py): each case ends with its documented outcome and every
checkpoint that was healthy before is still there and healthy after.

`python tests/train/faults.py` runs the same cases and prints the table (case -> outcome ->
checkpoints before / after).
"""

from __future__ import annotations

import faults
import pytest

# Cases run by default: each needs at most one short resume beyond the shared base run (the
# others, `-m slow`, train two processes each or compile another mesh).
FAST = {
    "case_truncated_metadata",
    "case_new_workdir_without_config",
    "case_changed_corpus",
    "case_sigint",
    "case_lock_held",
    "case_stale_lock",
    "case_disk_full_tensorstore",
    "case_disk_low",
    "case_double_ctrl_c",
    "case_ctrl_c_during_stop_save",
    "case_sigterm_at_startup",
}
# One xdist worker builds the shared base run for every case (scripts/test: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("faults")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return faults.make_env(tmp_path_factory.mktemp("faults"))


def _name(case) -> str:
    return getattr(case, "__name__", "case")


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=_name(c), marks=() if _name(c) in FAST else pytest.mark.slow)
        for c in faults.CASES
        if _name(c) != "<lambda>"
    ],
)
def test_fault(env, case):
    row = case(env)
    assert row.ok, f"{row.case}: {row.outcome}\n{row.detail}\nbefore {row.before} after {row.after}"


@pytest.mark.parametrize(
    "index",
    [
        # Refused changes start no training (fast); the accepted ones (each a training resume)
        # are slow.
        pytest.param(
            i,
            id=name,
            marks=() if refused else pytest.mark.slow,
        )
        for i, (name, refused, _, _) in enumerate(faults.CHANGED_SETTINGS)
    ],
)
def test_changed_setting_on_resume(env, index):
    row = faults.case_changed_setting(env, index)
    assert row.ok, f"{row.case}: {row.outcome}\n{row.detail}\nbefore {row.before} after {row.after}"
