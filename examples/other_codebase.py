"""nested-jax's rules inside another codebase: a plain-JAX model (no Flax), data-parallel training.

A two-layer sequence model written the way any JAX codebase would write it (a dict of arrays, a
``forward`` for ONE sequence ``[T, d]``) calls two pure functions of ``nested_jax.core``:

- ``gated_delta_chunked`` (gated delta rule,
  ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``),
- ``titans_linear_chunked`` (Titans matrix memory: online gradient descent with momentum and
  forgetting on ``‖Mᵀk_t − v_t‖²``).

The program wraps them in its own transformations: ``jax.vmap`` batches the one-sequence model,
``jax.shard_map`` splits the batch over a ``data`` axis of 8 CPU devices (``check_vma=True``, the
default: every value's varying axes are checked), ``jax.grad`` differentiates through the memory
updates and ``jax.jit`` compiles the train step. It then trains 20 steps of plain SGD on a toy
regression (a linear map of the current token plus one of the token two back, which only the
memories can supply) and prints the loss, after checking that the sharded step equals the
single-device one. It also prints the best loss a model without memory can reach: 20 steps of SGD
bring the loss from about 3.9 to about 0.76, just below that bound (a demonstration of the
plumbing, not of what the memories can learn with more steps).

Run: ``python examples/other_codebase.py`` (needs only ``pip install nested-jax``: jax and numpy).
"""

from __future__ import annotations

import os

# 8 CPU devices: must be set before JAX starts (kept if the caller already asked for a count).
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nested_jax.core import TitansRule, gated_delta_chunked, titans_linear_chunked  # noqa: E402

D_IN, D, H, K = 8, 16, 2, 8  # input width, model width, heads, head dim (K = V)
BATCH, T, LAG = 16, 32, 2  # 16 sequences of 32 tokens; target: token t − 2
CHUNK = 8
TITANS = TitansRule(memory_chunk=CHUNK)  # the memory rule, one frozen value (SPEC §2)
STEPS, LR = 20, 0.5


def init_params(key):
    """Plain dict of arrays: input/output maps and one (q, k, v, gates, out) set per memory."""
    ks = iter(jax.random.split(key, 16))

    def dense(d_in, d_out, scale=1.0):
        return scale * jax.random.normal(next(ks), (d_in, d_out)) / np.sqrt(d_in)

    def memory(n_gates):
        return {
            "wq": dense(D, H * K),
            "wk": dense(D, H * K),
            "wv": dense(D, H * K),
            "wgates": dense(D, n_gates * H, 0.1),
            "wo": dense(H * K, D, 0.5),
        }

    return {"w_in": dense(D_IN, D), "gdn": memory(2), "titans": memory(3), "head": dense(D, D_IN)}


def heads(p, h):
    """``h [T, d]`` → unit-norm ``q, k`` and ``v`` as ``[1, T, H, K]`` (the rules' ``[B, T, H, D]``;
    the batch of one is this sequence: the caller's ``vmap`` adds the real batch)."""
    split = lambda w: (h @ w).reshape(1, h.shape[0], H, K)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return unit(split(p["wq"])), unit(split(p["wk"])), split(p["wv"])


def gdn_layer(p, h):
    q, k, v = heads(p, h)
    gates = (h @ p["wgates"]).reshape(1, h.shape[0], 2, H)
    g = -jax.nn.softplus(gates[:, :, 0] + 2.0)  # log decay (α = e^g near 1: long memory)
    beta = jax.nn.sigmoid(gates[:, :, 1])  # write strength
    o, _ = gated_delta_chunked(q, k, v, g, beta, chunk_size=CHUNK)
    return o.reshape(h.shape[0], H * K) @ p["wo"]


def titans_layer(p, h):
    q, k, v = heads(p, h)
    gates = jax.nn.sigmoid((h @ p["wgates"]).reshape(1, h.shape[0], 3, H))
    theta, eta, alpha = 0.5 * gates[:, :, 0], gates[:, :, 1], 0.1 * gates[:, :, 2]
    o, _ = titans_linear_chunked(q, k, v, theta, eta, alpha, rule=TITANS)
    return o.reshape(h.shape[0], H * K) @ p["wo"]


def forward(params, x):
    """One sequence ``x [T, D_IN]`` → prediction ``[T, D_IN]`` (two residual memory layers)."""
    h = x @ params["w_in"]
    h = h + gdn_layer(params["gdn"], h)
    h = h + titans_layer(params["titans"], h)
    return h @ params["head"]


def batch_loss_sum(params, x, y):
    """Sum over the sequences of ``x [b, T, D_IN]`` of the per-sequence mean squared error."""
    pred = jax.vmap(forward, in_axes=(None, 0))(params, x)
    return jnp.sum(jnp.mean((pred - y) ** 2, axis=(1, 2)))


def single_device_step(params, x, y):
    """Reference: loss and gradient of the batch mean on one device (no shard_map)."""
    return jax.value_and_grad(lambda p: batch_loss_sum(p, x, y) / x.shape[0])(params)


def make_sharded_step(mesh):
    """jit(shard_map(vmap(model))): each device takes its ``BATCH / 8`` sequences.

    With ``check_vma=True`` the replicated ``params`` are invariant over ``data`` and ``x`` varies,
    so ``jax.grad`` of a per-device loss returns a gradient already summed over the devices (the
    transpose of the implicit broadcast is a ``psum``); the loss value is summed explicitly.
    """

    def local(params, x, y):
        loss, grads = jax.value_and_grad(lambda p: batch_loss_sum(p, x, y) / BATCH)(params)
        return jax.lax.psum(loss, "data"), grads

    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
    )


@jax.jit
def sgd(params, grads):
    return jax.tree.map(lambda w, gw: w - LR * gw, params, grads)


def make_data(key):
    """Random inputs ``x`` and target ``y_t = A x_t + B x_{t−LAG}`` (zero ``x`` before the start);
    returns ``(x, y, A)``."""
    kx, ka, kb = jax.random.split(key, 3)
    x = jax.random.normal(kx, (BATCH, T, D_IN))
    a, b = (jax.random.normal(k, (D_IN, D_IN)) / np.sqrt(D_IN) for k in (ka, kb))
    y = x @ a + jnp.pad(x[:, :-LAG] @ b, ((0, 0), (LAG, 0), (0, 0)))
    return x, y, a


def main():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    print(f"{jax.device_count()} devices, mesh {dict(mesh.shape)}, {BATCH // mesh.size} seqs each")
    # jit: one compile instead of one per random draw.
    params0 = jax.jit(init_params)(jax.random.key(0))
    x0, y0, a = jax.jit(make_data)(jax.random.key(1))
    # jax.make_mesh gives Explicit axes: arrays carry their sharding, so place them on the mesh.
    params = jax.device_put(params0, NamedSharding(mesh, P()))
    x, y = jax.device_put((x0, y0), NamedSharding(mesh, P("data")))
    loss_and_grad = make_sharded_step(mesh)

    # The sharded loss and gradient equal the single-device ones (same math, split batch).
    loss_1, grads_1 = jax.jit(single_device_step)(params0, x0, y0)
    loss_8, grads_8 = loss_and_grad(params, x, y)
    err = max(
        float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-12))
        for a, b in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads_8), strict=True)
    )
    print(
        f"shard_map vs one device: loss {float(loss_8):.6f} vs {float(loss_1):.6f}, "
        f"max relative gradient difference {err:.1e}"
    )
    assert abs(float(loss_8) - float(loss_1)) < 1e-5 * abs(float(loss_1)) and err < 1e-4

    # Without memory the best prediction of y_t from x_t is A x_t: the B x_{t-LAG} part is left.
    memoryless = float(jnp.mean(jnp.sum((y0 - x0 @ a) ** 2, axis=-1) / D_IN))
    print(f"best loss without memory {memoryless:.4f}")
    for i in range(STEPS):
        loss, grads = loss_and_grad(params, x, y)
        params = sgd(params, grads)
        print(f"step {i:2d} loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
