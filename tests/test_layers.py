"""The package's import structure: `lint-imports` (import-linter) keeps the README's layer order
(packages import only downwards), keeps layers off ``nested_jax.core`` (the one door is
``nested_jax.ops``) and forbids import cycles between the modules of a package. The contracts are in
pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in r.stdout
