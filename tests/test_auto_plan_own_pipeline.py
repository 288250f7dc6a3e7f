"""`auto_plan` finds a step that calls `filter_pipeline` itself (not through a `Stacked`) and
says what that means for a plan, before compiling anything."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import eqxshard


def _blocks():
    keys = jax.random.split(jax.random.key(0), 4)
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys)


def _layer(block, h):
    return jax.vmap(block)(h)


BATCH = jax.ShapeDtypeStruct((8, 8), jnp.float32)


def test_a_step_that_pipelines_by_itself_without_a_mesh_is_named():
    def step(blocks, x):
        y = eqxshard.filter_pipeline(_layer, blocks, x, axis="pipe", microbatches=4)
        return jnp.mean(y**2)

    with pytest.raises(ValueError, match="pipelines by itself") as info:
        eqxshard.auto_plan(step, _blocks(), BATCH, devices=2, budget="1GiB", progress=False)
    message = str(info.value)
    assert "over axis 'pipe' with microbatches=4, repeats=1" in message
    assert "tracing it without a mesh raised" in message
    assert "`eqxshard.Stacked`" in message and "a mesh without the axis 'pipe'" in message


def test_a_step_that_pipelines_over_its_own_mesh_is_named():
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Auto,))

    def step(blocks, x):
        y = eqxshard.filter_pipeline(
            _layer, blocks, x, mesh=mesh, axis="stage", microbatches=2, repeats=2
        )
        return jnp.mean(y**2)

    with pytest.raises(ValueError, match="pipelines by itself") as info:
        eqxshard.auto_plan(step, _blocks(), BATCH, devices=2, budget="1GiB", progress=False)
    message = str(info.value)
    assert "over axis 'stage' with microbatches=2, repeats=2." in message
    assert "without a mesh raised" not in message


def test_a_step_through_a_stacked_is_not_taken_for_one():
    # A plain `Stacked` runs its scan, and no pipeline is seen: the search goes on.
    stack = eqxshard.Stacked(_blocks())
    step = lambda stack, x: jnp.mean(jax.vmap(stack)(x) ** 2)
    plan = eqxshard.auto_plan(step, stack, BATCH, devices=1, budget="1GiB", progress=False)
    assert plan.chosen.fits
