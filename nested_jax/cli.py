"""`nested-jax` commands: `train | eval | report | generate | aot | bench | launch | prepare-data |
import-hf | export-hf | lm-eval`.

Each sub-command lives in its own module and exposes `main(argv: list[str]) -> int` (or the
function named after a colon); this file only dispatches, so importing the CLI stays cheap and a
broken sub-command cannot break the others.

Failures: a sub-command that raises prints one line, ``error: <text> (traceback in <path>)``, and
exits 1; the traceback is appended to ``<workdir>/errors.log`` (a ``--workdir`` that exists) or to
the cache folder's ``errors.log`` (:mod:`nested_jax.train.errorlog`). A package of an optional
extra that is not installed is named with the extra: ``pip install "nested-jax[hf]"``.
"""

from __future__ import annotations

import importlib
import sys

from nested_jax.parallel.platform import quiet_cpu_platforms

COMMANDS = {
    "train": ("nested_jax.train.main", "train a model: --config FILE --workdir DIR"),
    "eval": ("nested_jax.eval.main", "evaluate the latest checkpoint: --workdir DIR"),
    "report": ("nested_jax.eval.report", "compare evaluated runs: RUN [RUN ...] [--out DIR]"),
    "generate": ("nested_jax.eval.generate", "sample text: --workdir DIR --prompt TEXT"),
    "aot": ("nested_jax.train.aot", "compile for a TPU slice on this CPU: --config F --topology T"),
    "bench": (
        None,
        "benchmarks: bench {core,titans,optim,hola,hope,kernels,context,data,peers} [--json]",
    ),
    "launch": ("nested_jax.launch.main", "start runs: launch {tpu-vm,xpk,local} ... [--dry-run]"),
    "prepare-data": ("nested_jax.data.prepared", "tokenise once into shards: --config F --out DIR"),
    "import-hf": (
        "nested_jax.train.hf:main_import",
        "Hugging Face Llama/Qwen2 -> step 0: --from HF_DIR --workdir NEW [--to hope_attention]",
    ),
    "lm-eval": (
        "nested_jax.eval.harness",
        "lm-evaluation-harness on a run: --model nested_jax --model_args workdir=W --tasks T",
    ),
    "export-hf": (
        "nested_jax.train.hf:main_export",
        "a run's checkpoint -> Hugging Face: --workdir W --out DIR [--arch llama|qwen2]",
    ),
}
BENCHES = (
    "core", "titans", "optim", "hola", "hope", "kernels", "context", "data", "peers", "momentum",
)  # fmt: skip


def _usage() -> str:
    lines = ["usage: nested-jax [--version] <command> [args]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def version() -> str:
    """The installed distribution's version, else the package's ``__version__`` (a source tree)."""
    from importlib import metadata

    try:
        return metadata.version("nested-jax")
    except metadata.PackageNotFoundError:
        from nested_jax import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"nested-jax {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"nested-jax: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    quiet_cpu_platforms(command)  # before JAX starts: no libtpu start-up noise on a CPU machine
    if command == "bench":
        if not rest or rest[0] not in BENCHES:
            print(f"usage: nested-jax bench {{{','.join(BENCHES)}}} [--json]", file=sys.stderr)
            return 2
        module_name, rest = f"nested_jax.bench.{rest[0]}", rest[1:]
    elif command == "prepare-data":  # the data layer cannot load a whole config: hand it a loader
        from nested_jax.data.prepared import main as prepare_main
        from nested_jax.train.config import load_config

        return prepare_main(rest, lambda paths, sets: load_config(paths, sets).data)
    else:
        module_name = COMMANDS[command][0]
    if command == "train":  # before the slow imports: a SIGTERM now exits as a preemption
        from nested_jax.train.signals import install_startup_handler

        install_startup_handler()
    try:
        return _run(command, module_name, rest)
    except Exception as err:
        return _report(command, rest, err)
    except BaseException as err:  # SIGTERM while `train` still imports: exit as a preemption
        from nested_jax.train.signals import StoppedEarly, report_stopped_early

        if isinstance(err, StoppedEarly):
            return report_stopped_early(err, _workdir_arg(rest))
        raise


def _run(command: str, module_name: str, rest: list[str]) -> int:
    if command in ("train", "eval", "generate"):  # the generated-task families of data.task
        import nested_jax.eval.task_families  # noqa: F401
    module_name, _, function = module_name.partition(":")
    run = getattr(importlib.import_module(module_name), function or "main")
    if command == "train":  # this process ends with the command: an abort may skip unwinding
        return int(run(rest, hard_abort=True) or 0)
    return int(run(rest) or 0)


def _workdir_arg(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--workdir" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
    return None


def _report(command: str, argv: list[str], err: Exception) -> int:
    """One line on stderr for a sub-command's uncaught exception; the traceback to a log."""
    from nested_jax.train import errorlog

    extra = errorlog.missing_extra(err)
    if extra is not None:
        print(errorlog.missing_extra_line(command, extra), file=sys.stderr)
        return 1
    try:
        path = errorlog.log_exception(
            errorlog.log_path(_workdir_arg(argv)), err, f"nested-jax {command}"
        )
        where = f"traceback in {path}"
    except OSError as log_err:  # nowhere to write: still one line
        where = f"no traceback saved: {log_err.strerror or log_err}"
    print(f"error: {errorlog.one_line(err)} ({where})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
