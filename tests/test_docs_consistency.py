"""The docs' checkable statements stay true: the files they name exist, the extras they name are
in ``pyproject.toml``, the code cites only Markdown files that exist, and the modules the README
says import without Flax and Optax do (and those it says need them do not)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "launch" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the top of a path inside this repository (a backticked `runs/x` or `.venv/bin/...` is not one)
TOP = ("nested_jax", "pallas_kernels", "configs", "docs", "launch", "scripts", "tests", "examples")
TOP_FILES = ("README.md", "pyproject.toml", "constraints.txt", ".ci/run")
# paths the docs name as what a command writes, not as files of the repository
WRITTEN = ("docs/api/", "docs/aot_table.md")
_SPAN = re.compile(r"`([^`\s]+)`")
# `.[a,b]`, `nested-jax[a]`, or a lone `[a]` whose name is a word (`[p0]` is a log prefix)
_EXTRA = re.compile(r"(?:\.|nested-jax)\[([\w,-]+)\]|`\[([a-z]+)\]`")
_MD_TOKEN = re.compile(r"[\w./-]*\.md\b")


def _repo_path(span: str) -> str | None:
    """The repository path a backticked span names (without ``::test`` / ``:line`` / ``§``
    suffixes), or None when the span is not a path into the repository."""
    path = re.split(r"::|:\d|§", span)[0].rstrip(".,;:)")
    if path in TOP_FILES or path.split("/")[0] in TOP and "/" in path:
        return path
    return None


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``; a ``<placeholder>`` becomes a glob ``*``."""
    path = re.sub(r"<[^>]*>", "*", path)
    brace = re.search(r"\{([^}]*)\}", path)
    if not brace:
        return [path]
    head, tail = path[: brace.start()], path[brace.end() :]
    return [p for alt in brace.group(1).split(",") for p in _expand(head + alt + tail)]


def _missing(path: str) -> bool:
    if path.startswith(WRITTEN):
        return False
    for one in _expand(path):
        found = list(ROOT.glob(one)) if "*" in one or "?" in one else (ROOT / one).exists()
        if not found:
            return True
    return False


def test_files_named_in_the_docs_exist():
    missing = []
    for doc in DOCS:
        for span in _SPAN.findall(doc.read_text()):
            path = _repo_path(span)
            if path is not None and _missing(path):
                missing.append(f"{doc.relative_to(ROOT)}: `{span}`")
    assert not missing, "docs name files that are not in the repository:\n" + "\n".join(missing)


def _extras_named(text: str) -> set[str]:
    names = set()
    for group, alone in _EXTRA.findall(text):
        names.update(n for n in (group or alone).split(",") if n)
    return names


def test_extras_named_in_the_docs_exist():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "optional-dependencies" in declared
    named = {doc.relative_to(ROOT): _extras_named(doc.read_text()) for doc in DOCS}
    assert {"train", "tpu"} <= named[Path("README.md")]  # the pattern does find the README's
    unknown = {str(doc): sorted(n - set(extras)) for doc, n in named.items() if n - set(extras)}
    assert not unknown, f"extras that pyproject.toml does not define: {unknown}"


def _md_citations(path: Path) -> list[str]:
    """The Markdown documents `path` cites: an upper-case name (``README.md``, ``SPEC.md``, a
    ``core/README.md``) or a path from the top of the repository (``docs/chunking.md``); other
    names (``compare.md``, ``workdir/eval_report.md``) are files the code writes."""
    out = []
    for token in _MD_TOKEN.findall(path.read_text()):
        stem = token.rsplit("/", 1)[-1][: -len(".md")]
        if stem.replace("_", "").isupper() or token.split("/")[0] in TOP:
            out.append(token)
    return out


def _md_exists(cited: str, source: Path) -> bool:
    """A cited ``.md`` exists as a repository or package path (``core/README.md``), beside the
    citing file or in a folder above it (``README.md`` in ``nested_jax/core/scan.py``)."""
    folders = [ROOT, ROOT / "nested_jax", source.parent, *source.parents]
    for folder in folders:
        path = (folder / cited).resolve()
        # ../shared/X.md from the repository root is not a file of the repository
        if path.is_file() and ROOT.resolve() in path.parents and ROOT in [folder, *folder.parents]:
            return True
    return False


def test_code_cites_only_markdown_files_that_exist():
    sources = sorted((ROOT / "nested_jax").rglob("*.py")) + sorted(
        (ROOT / "pallas_kernels").rglob("*.py")
    )
    cited = [(src, md) for src in sources for md in _md_citations(src)]
    assert len(cited) > 10  # the pattern does find the code's citations
    bad = [f"{src.relative_to(ROOT)}: {md}" for src, md in cited if not _md_exists(md, src)]
    assert not bad, "docstrings / comments cite missing Markdown files:\n" + "\n".join(bad)


def _readme_module_claims() -> tuple[list[str], list[str]]:
    """From the README's "As a library" paragraph: the modules it says install with jax and numpy
    alone, and those it says need the ``[train]`` extra."""
    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("As a library:") :].split("\n\n")[0]
    sentences = re.split(r"(?<=[.;])\s", " ".join(paragraph.split()))
    modules = re.compile(r"`((?:nested_jax|pallas_kernels)[\w.]*)`")
    alone = [m for s in sentences if "numpy alone" in s for m in modules.findall(s)]
    need = [m for s in sentences if re.search(r"needs? `\[train\]`", s) for m in modules.findall(s)]
    return alone, need


def _imports_without_flax_and_optax(*modules: str) -> bool:
    """Whether `modules` import in a fresh interpreter where ``flax`` and ``optax`` cannot."""
    code = "import sys; sys.modules['flax'] = sys.modules['optax'] = None; import " + ", ".join(
        modules
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120)
    return run.returncode == 0


def test_readme_says_which_modules_import_without_flax():
    alone, need = _readme_module_claims()
    assert "nested_jax.core" in alone and need  # both claims are where the parser looks
    assert _imports_without_flax_and_optax(*alone), f"README: {alone} need Flax or Optax"
    wrong = [m for m in need if _imports_without_flax_and_optax(m)]
    assert not wrong, f"README says {wrong} need [train], but they import without Flax and Optax"


# what the docs may not say of gs:// paths: the workdir, metrics, report and data paths reach
# buckets through etils.epath (tests/train/test_remote_paths.py)
_GS_DENIAL = re.compile(r"does not reach|not yet|not supported|do(?:es)? not work")


def test_docs_do_not_deny_gs_workdirs():
    assert (ROOT / "tests" / "train" / "test_remote_paths.py").is_file()
    denials = []
    for doc in DOCS:
        for paragraph in doc.read_text().split("\n\n"):
            flat = " ".join(paragraph.split())
            for sentence in re.split(r"(?<=[.:;])\s", flat):
                if "gs://" in sentence and _GS_DENIAL.search(sentence):
                    denials.append(f"{doc.relative_to(ROOT)}: {sentence}")
    assert not denials, "docs say gs:// paths do not work:\n" + "\n".join(denials)


@pytest.mark.parametrize(
    "span, path",
    [
        ("nested_jax/parallel/platform.py", "nested_jax/parallel/platform.py"),
        ("tests/core/test_x.py::test_y", "tests/core/test_x.py"),
        ("docs/SPEC.md§3", "docs/SPEC.md"),
        ("runs/quickstart", None),
        (".venv/bin/nested-jax", None),
        ("nested_jax.core", None),
    ],
)
def test_repo_path_recognises_paths(span, path):
    assert _repo_path(span) == path


@pytest.mark.parametrize(
    "cited, source, exists",
    [
        ("README.md", "nested_jax/core/scan.py", True),
        ("core/README.md", "pallas_kernels/gated_delta/ops.py", True),
        ("docs/SPEC.md", "nested_jax/ops/_impl.py", True),
        ("DESIGN.md", "nested_jax/ops/_impl.py", False),
        ("../shared/REFERENCES.md", "nested_jax/bench/kernels.py", False),
    ],
)
def test_md_exists_stays_inside_the_repository(cited, source, exists):
    assert _md_exists(cited, ROOT / source) is exists


def test_expand_braces_and_placeholders():
    assert _expand("a/{b,c}.py") == ["a/b.py", "a/c.py"]
    assert _expand("ops/<mechanism>.py") == ["ops/*.py"]


CORE = ROOT / "nested_jax" / "core"
MECHANISMS = sorted(p.parent.name for p in CORE.glob("*/__init__.py"))
CORE_READMES = [CORE / "README.md", *(CORE / m / "README.md" for m in MECHANISMS)]
# `file.py:name` in a core README: the file beside the README (or in core/) defines `name`
_DEFINED_AT = re.compile(r"`((?:[\w]+/)*[\w]+\.py):(\w+)`")


def test_every_mechanism_folder_has_its_twin_and_derivation():
    assert {"associative", "titans", "hope", "hola", "cms"} <= set(MECHANISMS)
    absent = [
        f"{m}/{name}"
        for m in MECHANISMS
        for name in ("reference.py", "README.md")
        if not (CORE / m / name).is_file()
    ]
    assert not absent, f"mechanism folders without their twin or derivation: {absent}"


@pytest.mark.parametrize("readme", CORE_READMES, ids=lambda p: p.parent.name)
def test_core_readmes_name_files_and_functions_that_exist(readme):
    """Repository paths in a core README exist, and every ``file.py:function`` it cites is
    defined in that file (beside the README, else under ``core/`` or ``nested_jax/``)."""
    text, wrong = readme.read_text(), []
    for span in _SPAN.findall(text):
        path = _repo_path(span)
        if path is not None and _missing(path):
            wrong.append(f"`{span}`: no such file")
    for file, name in _DEFINED_AT.findall(text):
        homes = (readme.parent, CORE, CORE.parent)
        source = next((d / file for d in homes if (d / file).is_file()), None)
        if source is None:
            wrong.append(f"`{file}:{name}`: no {file} beside the README, in core/ or nested_jax/")
        elif not re.search(rf"^\s*(?:def|class) {name}\b|^{name}\s*=", source.read_text(), re.M):
            wrong.append(f"`{file}:{name}`: {name} is not defined in {file}")
    assert not wrong, f"{readme.relative_to(ROOT)}:\n" + "\n".join(wrong)
