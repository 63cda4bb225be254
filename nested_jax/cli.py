"""`nested-jax` commands: `train | eval | report | generate | aot | bench | launch | prepare-data |
import-hf | export-hf | lm-eval`.

Each sub-command lives in its own module and exposes `main(argv: list[str]) -> int` (or the
function named after a colon); this file only dispatches, so importing the CLI stays cheap and a
broken sub-command cannot break the others.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("nested_jax.train.main", "train a model: --config FILE --workdir DIR"),
    "eval": ("nested_jax.eval.main", "evaluate the latest checkpoint: --workdir DIR"),
    "report": ("nested_jax.eval.report", "compare evaluated runs: RUN [RUN ...] [--out DIR]"),
    "generate": ("nested_jax.eval.generate", "sample text: --workdir DIR --prompt TEXT"),
    "aot": ("nested_jax.train.aot", "compile for a TPU slice on this CPU: --config F --topology T"),
    "bench": (
        None,
        "benchmarks: bench {core,titans,optim,hola,hope,kernels,context,data} [--json]",
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
BENCHES = ("core", "titans", "optim", "hola", "hope", "kernels", "context", "data")


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
    if command in ("train", "eval", "generate"):  # the generated-task families of data.task
        import nested_jax.eval.task_families  # noqa: F401
    module_name, _, function = module_name.partition(":")
    return int(getattr(importlib.import_module(module_name), function or "main")(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
