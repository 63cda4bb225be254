"""The library face of the packaging (issue 18 item 4): ``pip install nested-jax`` needs only jax
and numpy, in ranges; the training system is the extra ``train``, whose exact versions live in
constraints.txt (what scripts/setup installs); importing the pure functions pulls in no part of the
training stack."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LIBRARY = {"jax", "jaxlib", "numpy"}
TRAINING_STACK = {"flax", "optax", "orbax", "grain"}


def _name(requirement: str) -> str:
    """PEP 503 normalised project name (``array_record`` and ``Array-Record`` are one package)."""
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _constraints() -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line of constraints.txt."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # exactly one specifier per line ...
        assert spec.operator == "==", f"constraints.txt: {line!r} is not an exact pin"  # ... `==`
        pins[_name(line)] = spec.version
    return pins


def test_library_dependencies_are_jax_and_numpy_in_ranges():
    deps = PYPROJECT["project"]["dependencies"]
    assert {_name(d) for d in deps} == LIBRARY, deps
    for dep in deps:
        spec = Requirement(dep).specifier
        assert spec, f"{dep!r}: give a version range"
        assert all(s.operator not in ("==", "===") for s in spec), f"{dep!r}: a range, not a pin"


def test_every_extra_package_is_pinned_in_constraints():
    pins = _constraints()
    train = PYPROJECT["project"]["optional-dependencies"]["train"]
    assert TRAINING_STACK <= {_name(d).split("-")[0] for d in train}, train
    extras = PYPROJECT["project"]["optional-dependencies"].values()
    for dep in PYPROJECT["project"]["dependencies"] + [d for extra in extras for d in extra]:
        name = _name(dep)
        assert name in pins, f"{name} (from {dep!r}) has no exact pin in constraints.txt"
        assert Requirement(dep).specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {dep!r}"
        )


def test_setup_installs_train_with_the_constraints():
    setup = (ROOT / "scripts" / "setup").read_text()
    assert re.search(r'pip install[^\n]*-e "\.\[train,\$extras\]" -c constraints\.txt', setup)


def _modules_after_import(code: str) -> set[str]:
    """Top-level module names a fresh interpreter holds after running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    return {m.split(".")[0] for m in out.stdout.split()}


def test_importing_core_does_not_import_the_training_stack():
    loaded = _modules_after_import("import nested_jax.core, pallas_kernels.gated_delta")
    assert "nested_jax" in loaded and "jax" in loaded
    assert not loaded & TRAINING_STACK, sorted(loaded & TRAINING_STACK)


def test_importing_ops_does_not_import_the_training_stack():
    loaded = _modules_after_import("import nested_jax.ops")
    assert not loaded & TRAINING_STACK, sorted(loaded & TRAINING_STACK)
