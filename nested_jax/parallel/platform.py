"""Which JAX platforms a CLI process asks for, decided before JAX initialises a backend.

With ``libtpu`` installed (the ``[tpu]`` extra, for ``nested-jax aot``) JAX tries the TPU backend
first on every machine; where there is no TPU, libtpu prints its failed start-up
(``TPU_WORKER_HOSTNAMES``, ``TPU_ACCELERATOR_TYPE``, ...) on stderr before JAX falls back to the
CPU. :func:`quiet_cpu_platforms` sets ``JAX_PLATFORMS=cpu`` for such a process, and only when that
changes nothing else: the user set no ``JAX_PLATFORMS``, no TPU is attached or configured, and no
other accelerator plugin (CUDA, ROCm) is installed that the process would then lose.

Only the standard library is imported here: the CLI calls this before anything imports JAX.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Iterable, MutableMapping

# Commands that need libtpu itself: `aot` compiles for a TPU topology on this CPU machine.
TPU_COMMANDS = frozenset({"aot"})
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips show up as PCI devices of this vendor


def tpu_attached(root: str = "/") -> bool:
    """True when this machine shows a TPU device: ``/dev/accel*``, ``/dev/vfio`` or a Google PCI
    device (the same files JAX and libtpu look at)."""
    dev = os.path.join(root, "dev")
    if glob.glob(os.path.join(dev, "accel*")) or os.path.exists(os.path.join(dev, "vfio")):
        return True
    for vendor in glob.glob(os.path.join(root, "sys", "bus", "pci", "devices", "*", "vendor")):
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def tpu_configured(env: MutableMapping[str, str]) -> bool:
    """True when the environment addresses a TPU runtime (any ``TPU_*`` variable, or
    ``JAX_FORCE_TPU_INIT``): the user means libtpu to start, so its messages are theirs."""
    return "JAX_FORCE_TPU_INIT" in env or any(name.startswith("TPU_") for name in env)


def accelerator_plugins() -> list[str]:
    """Installed JAX PJRT plugins other than the TPU one (``jax_plugins.xla_cuda12``, ROCm, ...):
    the modules of the ``jax_plugins`` namespace package and the ``jax_plugins`` entry points."""
    names: set[str] = set()
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names.update(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))
    from importlib.metadata import entry_points

    names.update(ep.name for ep in entry_points(group="jax_plugins"))
    return sorted(n for n in names if "tpu" not in n.lower())


def _libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def wants_cpu_only(
    command: str,
    env: MutableMapping[str, str],
    *,
    libtpu: bool,
    tpu: bool,
    plugins: Iterable[str],
) -> bool:
    """Whether `command` should run with ``JAX_PLATFORMS=cpu`` (see the module docstring)."""
    if command in TPU_COMMANDS or "JAX_PLATFORMS" in env:
        return False
    return libtpu and not tpu and not tpu_configured(env) and not list(plugins)


def quiet_cpu_platforms(command: str, env: MutableMapping[str, str] | None = None) -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` in `env` (default ``os.environ``) when :func:`wants_cpu_only`;
    True when it did. Child processes inherit the setting, which is what they would pick too.

    Call before JAX initialises a backend; if ``jax`` is already imported its config is updated
    as well (the environment variable is read when ``jax`` is imported).
    """
    env = os.environ if env is None else env
    if command in TPU_COMMANDS or "JAX_PLATFORMS" in env or not _libtpu_installed():
        return False  # the cheap answers first: no file system scan for most processes
    if not wants_cpu_only(
        command, env, libtpu=True, tpu=tpu_attached(), plugins=accelerator_plugins()
    ):
        return False
    env["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None and env is os.environ:
        jax.config.update("jax_platforms", "cpu")
    return True
