"""Print three size and wording counts of ``nested_jax/`` and ``pallas_kernels/`` (every ``*.py``).

1. files over 600 lines;
2. functions (methods and nested functions too) over 80 code lines: the lines from ``def`` to the
   function's last line that hold code, so docstring, comment and blank lines are not counted;
3. lines naming history instead of the code: an issue number (``issue 17``), a date
   (``2026-12-03``) or ``Split from`` (history belongs in ``CHANGELOG.md``, measurements with their
   dates in ``docs/RESULTS.md``).

    python scripts/size_counts.py [-v] [--check]

``-v`` lists each item under its count; ``--check`` exits 1 when any count is above 0.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nested_jax", "pallas_kernels")
MAX_FILE_LINES = 600
MAX_FUNCTION_CODE_LINES = 80
HISTORY = re.compile(r"[Ii]ssue [0-9]+|20[0-9]{2}-[0-9]{2}-[0-9]{2}|Split from")

# Tokens that carry no code: a line holding only these is blank or a comment.
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
    tokenize.ENCODING,
}


def sources(root: Path = ROOT) -> list[Path]:
    """Every ``*.py`` under the two packages, sorted."""
    return sorted(p for top in PACKAGES for p in (root / top).rglob("*.py"))


def _line_count(text: str) -> int:
    return len(text.splitlines())


def _code_lines(text: str) -> set[int]:
    """1-based numbers of the lines that hold code (a multi-line string counts on every line)."""
    out: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in _NOT_CODE:
            out.update(range(tok.start[0], tok.end[0] + 1))
    return out


def _docstring_lines(tree: ast.Module) -> set[int]:
    """1-based numbers of the lines of every module, class and function docstring."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.update(range(first.lineno, first.end_lineno + 1))
    return out


def long_files(root: Path = ROOT, limit: int = MAX_FILE_LINES) -> list[str]:
    """``path (lines)`` of every file over ``limit`` lines."""
    out = []
    for path in sources(root):
        n = _line_count(path.read_text())
        if n > limit:
            out.append(f"{path.relative_to(root)} ({n})")
    return out


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_CODE_LINES) -> list[str]:
    """``path:line name (code lines)`` of every function over ``limit`` code lines."""
    out = []
    for path in sources(root):
        text = path.read_text()
        tree = ast.parse(text)
        code = _code_lines(text) - _docstring_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = sum(1 for i in range(node.lineno, node.end_lineno + 1) if i in code)
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n})")
    return out


def history_lines(root: Path = ROOT) -> list[str]:
    """``path:line: text`` of every line matching :data:`HISTORY`."""
    out = []
    for path in sources(root):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                out.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    return out


def counts(root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """``(title, items)`` of the three counts, in the order printed."""
    return [
        (f"files over {MAX_FILE_LINES} lines", long_files(root)),
        (f"functions over {MAX_FUNCTION_CODE_LINES} code lines", long_functions(root)),
        ("lines naming an issue number, a date or 'Split from'", history_lines(root)),
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    unknown = [a for a in argv if a not in ("-v", "--check")]
    if unknown:
        print(f"error: unknown argument {unknown[0]!r} (expected -v, --check)", file=sys.stderr)
        return 2
    sections = counts()
    for title, items in sections:
        print(f"{len(items):4d}  {title}")
        if "-v" in argv:
            for item in items:
                print(f"        {item}")
    return 1 if "--check" in argv and any(items for _, items in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
