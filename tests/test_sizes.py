"""Sizes and wording of the source (``scripts/size_counts.py``) and the length of the README.

No file of ``nested_jax/`` or ``pallas_kernels/`` over 600 lines, no function over 80 code lines,
no line naming an issue number, a date or "Split from" (docstrings state what the code does;
history goes to CHANGELOG.md, measurements to docs/RESULTS.md); a README of at most 250 lines.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "size_counts.py"
STRUCTURE = ROOT / "scripts" / "structure_counts.py"
README_MAX_LINES = 250


@pytest.fixture(scope="module")
def size_counts():
    spec = importlib.util.spec_from_file_location("size_counts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_file_over_600_lines(size_counts):
    found = size_counts.long_files()
    assert not found, "files over 600 lines (split them by meaning):\n" + "\n".join(found)


def test_no_function_over_80_code_lines(size_counts):
    found = size_counts.long_functions()
    assert not found, "functions over 80 code lines:\n" + "\n".join(found)


def test_no_history_in_code_or_docstrings(size_counts):
    found = size_counts.history_lines()
    assert not found, "lines naming an issue, a date or 'Split from':\n" + "\n".join(found)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines(size_counts, tmp_path):
    pkg = tmp_path / "nested_jax"
    pkg.mkdir()
    head = ["def f():", '    """Doc', "    more doc.", '    """', "    # a comment", ""]
    assigns = [f"    x{i} = {i}" for i in range(80)]
    (pkg / "m.py").write_text("\n".join(head + assigns[:79]) + "\n")  # def + 79 = 80 code lines
    assert size_counts.long_functions(tmp_path) == []
    (pkg / "m.py").write_text("\n".join(head + assigns) + "\n")  # def + 80 = 81
    assert size_counts.long_functions(tmp_path) == ["nested_jax/m.py:1 f (81)"]


def test_script_prints_three_counts_and_check_fails_above_zero(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True)
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and all(line.split()[0].isdigit() for line in lines)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--nope" in bad.stderr


def test_readme_stays_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md: {n} lines (at most {README_MAX_LINES})"


def test_core_structure_stays_within_its_bounds():
    """scripts/structure_counts.py: rooms directly in core/ <= 14, arrows between them <= 40, no
    private name imported across folders, no foreign name in an ``__all__``, at most five
    functions in core/ with twelve or more parameters."""
    spec = importlib.util.spec_from_file_location("structure_counts", STRUCTURE)
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)
    rooms = counts.rooms()
    assert len(rooms) <= 14, rooms
    graph = counts.grimp.build_graph("nested_jax", "pallas_kernels", cache_dir=None)
    assert len(counts.arrows(graph)) <= 40
    assert counts.private_imports() == []
    assert counts.foreign_all() == []
    assert len(counts.wide_functions()) <= 5, counts.wide_functions()
