"""A circular `Stacked` built without a mesh (its stage count unknown then) reaches the
stage-major order once, not per step: `filter_init` and `Plan.apply` (`configure`) build it
with the mesh set, and its compiled step then holds no all-to-all; one left in layer order
warns that its pipeline regroups the weights every step (the all-to-all in its program)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard import Stacked
from eqxshard._pipeline.stacked.configure import configure

D = 8
N = 8
PIPELINE: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=2)  # no mesh
RULES = eqxshard.first(eqxshard.stages("stage", path=r"blocks\..*"), P())


def make(key):
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(key, N))
    return Stacked(blocks, **PIPELINE)


def mesh():
    return jax.make_mesh((4, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def all_to_alls(stack, m):
    """The all-to-alls of the compiled gradient step of `stack` on `m`, and its result."""

    def loss(stack, x):
        return jnp.mean(jax.vmap(stack)(x) ** 2)

    x = jax.random.normal(jax.random.key(1), (8, D))
    step = jax.jit(jax.value_and_grad(loss))
    with jax.set_mesh(m):
        compiled = step.lower(stack, x).compile()
        out = compiled(stack, x)
    text = compiled.as_text()
    assert text is not None
    ops = [
        line for line in text.splitlines() if " all-to-all(" in line or "all-to-all-start(" in line
    ]
    return ops, out


def layers_close(a, b):
    for x, y in zip(jax.tree.leaves(a.to_layers()), jax.tree.leaves(b.to_layers()), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


@pytest.mark.heavy  # two compiled steps; test_stacked_pipeline checks the HLO on every JAX
def test_filter_init_stores_a_circular_stack_stage_major_and_its_step_moves_no_weights():
    m = mesh()
    built = eqxshard.filter_init(make, m, RULES)(jax.random.key(0))
    assert built.stages == 4 and built.mesh is None
    assert built.blocks.weight.sharding.spec[0] == "stage"
    layers_close(built, make(jax.random.key(0)))  # the same layers, read in layer order
    ops, (value, grads) = all_to_alls(built, m)
    assert not ops, ops
    # Left in layer order, its step regroups the weights: an all-to-all, and a warning.
    plain = eqxshard.filter_shard(make(jax.random.key(0)), m, RULES)
    assert plain.stages is None
    with pytest.warns(UserWarning, match=r"stored in layer order.*all-to-all over 'stage'"):
        ops, (value_ref, grads_ref) = all_to_alls(plain, m)
    assert ops
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)
    layers_close(eqx.tree_at(lambda s: s.blocks, built, grads.blocks), grads_ref)


def test_filter_init_under_a_mesh_set_or_without_a_stack_is_unchanged():
    m = mesh()
    with jax.set_mesh(m):  # the mesh set decides, as for any `Stacked` built under it
        assert eqxshard.filter_init(make, m, RULES)(jax.random.key(0)).stages == 4
    linear = eqxshard.filter_init(lambda k: eqx.nn.Linear(D, D, key=k), m, P())(jax.random.key(0))
    assert isinstance(linear, eqx.nn.Linear)


def test_a_plan_stores_a_circular_stack_stage_major_for_its_mesh():
    m = mesh()
    model = {"head": jnp.ones(3), "blocks": make(jax.random.key(0))}
    assert model["blocks"].stages is None
    applied = configure("Plan.apply", model, remat={}, pipeline=None, mesh=m)
    assert applied["blocks"].stages == 4 and applied["blocks"].mesh is None
    layers_close(applied["blocks"], model["blocks"])


def test_configure_under_a_trace_builds_stage_major_on_the_abstract_mesh():
    # `Plan.init` configures inside `filter_init`'s eval_shape, where JAX refuses
    # `jax.set_mesh`: the stack is built on the mesh's abstract form instead.
    m = mesh()
    built = eqx.filter_eval_shape(
        lambda key: configure("Plan.init", make(key), mesh=m, remat={}, pipeline=PIPELINE),
        jax.random.key(0),
    )
    assert built.stages == 4
