"""Print five structure counts of ``nested_jax.core`` (grimp for imports, ast for definitions).

1. rooms: modules and subpackages directly inside ``core/`` (``__init__`` not counted);
2. arrows: distinct directed import pairs between those rooms;
3. private imports across folders: ``from M import _name`` with ``M`` in a mechanism folder of
   core and the importer outside that folder (elsewhere in core or in ``pallas_kernels``), and
   any private name ``pallas_kernels`` takes from core;
4. modules other than ``__init__.py`` whose ``__all__`` lists names they do not define;
5. functions (nested ones too) in ``core/`` with twelve or more parameters.

Arrows count ``core/__init__.py`` as a room that imports (it is not counted as a room).

    python scripts/structure_counts.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Analyse the checkout this script sits in, not whichever copy the environment has installed.
sys.path.insert(0, str(ROOT))

import grimp  # noqa: E402

CORE = "nested_jax.core"


def folder(module: str) -> str:
    """Folder of a module: ``pallas_kernels``, ``nested_jax`` (outside core), ``core`` (the flat
    shared plumbing) or the name of a mechanism folder inside core."""
    if module.startswith("pallas_kernels"):
        return "pallas_kernels"
    if not module.startswith(CORE + "."):
        return "core" if module == CORE else "nested_jax"
    room = module.split(".")[2]
    return room if _is_package(room) else "core"


def _is_package(room: str) -> bool:
    return (ROOT / "nested_jax" / "core" / room / "__init__.py").exists()


def _path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _modules(package_dir: Path, prefix: str) -> list[str]:
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out.append(".".join([prefix, *parts]) if parts else prefix)
    return out


def rooms() -> list[str]:
    core = ROOT / "nested_jax" / "core"
    mods = [p.stem for p in core.glob("*.py") if p.stem != "__init__"]
    pkgs = [p.name for p in core.iterdir() if (p / "__init__.py").exists()]
    return sorted(mods + pkgs)


def arrows(graph) -> set[tuple[str, str]]:
    out = set()
    for mod in graph.find_descendants(CORE) | {CORE}:
        src = mod.split(".")[2] if mod != CORE else "__init__"
        for imp in graph.find_modules_directly_imported_by(mod):
            if imp.startswith(CORE + ".") and imp.split(".")[2] != src:
                out.add((src, imp.split(".")[2]))
    return out


def private_imports() -> list[str]:
    found = []
    mods = _modules(ROOT / "nested_jax", "nested_jax")
    mods += _modules(ROOT / "pallas_kernels", "pallas_kernels")
    for mod in mods:
        tree = ast.parse(_path(mod).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            if not node.module.startswith(CORE):
                continue
            src, dst = folder(mod), folder(node.module)
            if src == dst or src == "nested_jax" or (dst == "core" and src != "pallas_kernels"):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{mod} <- {node.module}.{alias.name}")
    return found


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
    return names


def _all_names(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def foreign_all() -> list[str]:
    out = []
    for top in ("nested_jax", "pallas_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            tree = ast.parse(path.read_text())
            names = _all_names(tree)
            if names is None:
                continue
            extra = sorted(set(names) - _defined(tree))
            if extra:
                out.append(f"{path.relative_to(ROOT)}: {', '.join(extra)}")
    return out


def wide_functions(limit: int = 12) -> list[str]:
    out = []
    for path in sorted((ROOT / "nested_jax" / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                n += (a.vararg is not None) + (a.kwarg is not None)
                if n >= limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    return out


def main() -> int:
    verbose = "-v" in sys.argv
    graph = grimp.build_graph("nested_jax", "pallas_kernels", cache_dir=None)
    sections = [
        ("rooms directly inside core/", rooms()),
        ("import arrows between rooms", sorted(f"{a} -> {b}" for a, b in arrows(graph))),
        ("_private names imported from another folder", private_imports()),
        ("modules whose __all__ lists names they do not define", foreign_all()),
        ("functions in core/ with >= 12 parameters", wide_functions()),
    ]
    for title, items in sections:
        print(f"{len(items):4d}  {title}")
        if verbose:
            for item in items:
                print(f"        {item}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
