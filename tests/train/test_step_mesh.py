"""Train and eval steps built for a mesh carry it: their activation constraints do not depend on
the caller tracing them inside ``jax.set_mesh``."""

from __future__ import annotations

import re

import jax
import pytest

from nested_jax.parallel.mesh import make_mesh
from nested_jax.train.config import MeshConfig, load_config
from nested_jax.train.setup import plan_train_setup
from nested_jax.train.step import make_train_step

# a StableHLO sharding constraint, with its target sharding (the SSA names differ between traces)
_CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ (<[^>]*>)")


@pytest.fixture(scope="module")
def plan():
    cfg = load_config(
        [],
        [
            "model.name=gdn",
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.chunk_size=16",
            "data.seq_len=32",
            "data.batch_size=8",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
        ],
    )
    return cfg, plan_train_setup(cfg, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))


def _constraints(lowered) -> list[str]:
    return _CONSTRAINT.findall(lowered.as_text())


def _lower_train(plan, step, cfg):
    batch = plan.abstract_batch(cfg.data.batch_size, cfg.data.seq_len)
    return step.lower(plan.abstract_state(), plan.abstract_rest(), batch)


def test_planned_steps_constrain_outside_set_mesh(plan):
    cfg, plan = plan
    batch = plan.abstract_batch(cfg.data.batch_size, cfg.data.seq_len)
    params = plan.abstract_state()["params"]
    outside = _constraints(_lower_train(plan, plan.train_step, cfg))
    outside_eval = _constraints(plan.eval_step.lower(params, plan.abstract_rest(), batch))
    with jax.set_mesh(plan.mesh):
        inside = _constraints(_lower_train(plan, plan.train_step, cfg))
        inside_eval = _constraints(plan.eval_step.lower(params, plan.abstract_rest(), batch))
    assert inside and inside_eval  # the model does pin its activations on this mesh
    assert outside == inside
    assert outside_eval == inside_eval


def test_users_own_jit_of_make_train_step_keeps_the_constraints(plan):
    cfg, plan = plan

    def build(mesh):
        step = make_train_step(plan.graphdef, plan.state_def, plan.tx, plan.schedule, mesh=mesh)
        return jax.jit(step)

    with jax.set_mesh(plan.mesh):
        inside = _constraints(_lower_train(plan, build(None), cfg))
    assert _constraints(_lower_train(plan, build(plan.mesh), cfg)) == inside
    # without the mesh at build time the constraints exist only inside the caller's set_mesh
    assert _constraints(_lower_train(plan, build(None), cfg)) == []
