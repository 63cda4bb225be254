"""Launching training runs: Cloud TPU VMs, GKE (xpk / JobSet) and N local CPU processes.

Every launcher runs the same entry point, ``nested-jax train``, and differs only in how the
processes start and find each other:

- :mod:`~nested_jax.launch.tpu_vm`: ``gcloud`` commands for a TPU VM slice (queued resources,
  install on every worker, ``--worker=all`` training with ``NESTED_JAX_DISTRIBUTED=auto``).
- :mod:`~nested_jax.launch.xpk`: an ``xpk workload create`` command and a plain JobSet manifest.
- :mod:`~nested_jax.launch.local`: N ``nested-jax`` processes on this machine, gloo over
  127.0.0.1 (the multi-host code path without a pod).

The cloud modules are pure functions from a small parameter dataclass to argv lists, so
``--dry-run`` prints exactly what would run and tests can check it without a cloud account.
This package imports neither JAX nor the training code: a launcher must start in a fraction of a
second on a laptop that only talks to the cloud.
"""
