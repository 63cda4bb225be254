"""The package's import structure: `lint-imports` (import-linter) keeps the README's layer order
(packages import only downwards), keeps layers off ``nested_jax.core`` (the one door is
``nested_jax.ops``) and forbids import cycles between the modules of a package. The contracts are in
pyproject.toml, and the README's layout table must list the same floors."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"Contracts: {len(contracts['contracts'])} kept, 0 broken." in r.stdout


def _readme_floors() -> list[set[str]]:
    """The packages of each floor of the README's layer map, top floor first."""
    floors = []
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = re.match(r"^\| (\d+) \| (.+?) \|", line)
        if m:
            paths = re.findall(r"`nested_jax/([\w]+?)(?:/|\.py)`", m.group(2))
            floors.append((int(m.group(1)), {f"nested_jax.{p}" for p in paths}))
    return [pkgs for _, pkgs in sorted(floors, reverse=True)]


def test_readme_layer_map_is_the_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contracts["contracts"] if c["id"] == "layers")["layers"]
    contract = [{p.strip() for p in row.split("|")} for row in layers]
    assert _readme_floors() == contract
