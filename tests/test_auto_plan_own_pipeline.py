"""`auto_plan` plans a step that calls `filter_pipeline` itself (not through a `Stacked`):
the meshes with the step's own stage axis are its candidates, the leaves it pipelines are
split over that axis, and the chosen plan's `plan.jit(step)` runs it with the mesh set.
What cannot be planned so is named before anything is compiled."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_stack as ts
from helpers import compiled_total
from jax.sharding import AxisType

import eqxshard

OPTIMIZER = optax.adam(1e-2)
WIDTH = 32  # wide enough that the compiled step's fixed bytes are well under 1% of it


class Model(eqx.Module):
    blocks: dict
    head: jax.Array

    def __call__(self, x, microbatches=4, **kwargs):
        y = eqxshard.filter_pipeline(
            ts.layer, self.blocks, x, axis="pipe", microbatches=microbatches, **kwargs
        )
        return y @ self.head


def _make(key, n=ts.N):
    w = jax.random.normal(jax.random.key(1), (n, WIDTH, WIDTH)) / WIDTH**0.5
    blocks = {"w": w, "b": jnp.zeros((n, WIDTH))}
    return Model(blocks, jax.random.normal(key, (WIDTH, 2)))


def _step(model, opt_state, x):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def _x(batch):
    return jnp.linspace(-1.0, 1.0, batch * WIDTH).reshape(batch, WIDTH)


def _plan(devices, batch, step=_step, model=None, **options: Any):
    model = _make(jax.random.key(0)) if model is None else model
    shapes = jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)
    return eqxshard.auto_plan(
        step, model, shapes, devices=devices, budget="1MiB", optimizer=OPTIMIZER,
        progress=False, **options,
    )  # fmt: skip


def _trains_as_one_device(plan, batch, steps=2, check_bytes=True):
    """`plan.jit(step)` compiles to the table's bytes per device and trains as one device."""
    model, state = plan.init(_make, OPTIMIZER)(jax.random.key(0))
    train_step = plan.jit(_step)
    if check_bytes:
        compiled = train_step.lower(model, state, _x(batch)).compile()
        total = compiled_total(compiled.memory_analysis())
        assert plan.chosen.total_bytes is not None
        assert abs(total - plan.chosen.total_bytes) <= 0.01 * total
    one = _make(jax.random.key(0))
    one_state = OPTIMIZER.init(eqx.filter(one, eqx.is_array))
    # One device runs the step with a one-stage mesh set (`filter_pipeline` needs one).
    with jax.set_mesh(jax.make_mesh((1,), ("pipe",), devices=jax.devices()[:1])):
        one_step = eqx.filter_jit(_step)
        for _ in range(steps):
            model, state, loss = train_step(model, state, _x(batch))
            one, one_state, one_loss = one_step(one, one_state, _x(batch))
            np.testing.assert_allclose(loss, one_loss, rtol=1e-5)


def test_a_step_that_pipelines_by_itself_is_planned_over_its_axis():
    plan = _plan(2, 8)
    assert [c.mesh_shape for c in plan.table] == [{"pipe": 2}]
    pipeline = {"axis": "pipe", "microbatches": 4, "repeats": 1, "in_step": True}
    assert plan.pipeline == eqxshard.Pipeline(**pipeline) and plan.chosen.pipeline == pipeline
    assert "bubble 20%" in plan.chosen.reason
    assert "calls `filter_pipeline` over axis 'pipe' itself" in plan.chosen.reason
    pasted = eval(repr(plan), {"Plan": eqxshard.Plan, "P": jax.P, **vars(eqxshard)})
    assert pasted == plan
    # `apply` has no `Stacked` to configure: it places the model, and the layers split.
    model = plan.apply(_make(jax.random.key(0)))
    assert model.blocks["w"].sharding.spec[0] == "pipe"
    # Its step runs with the plan's mesh set (bytes checked on eight devices, below).
    _trains_as_one_device(plan, 8, steps=1, check_bytes=False)


@pytest.mark.heavy
def test_eight_devices_weigh_every_stage_count_and_the_chosen_one_runs():
    plan = _plan(8, 32)
    assert plan.chosen.fits and plan.chosen.mesh_shape["pipe"] > 1
    assert all("pipe" in c.mesh_shape for c in plan.table)  # no mesh without the axis
    compiled = [c for c in plan.table if c.total_bytes is not None]
    assert {c.mesh_shape["pipe"] for c in compiled} == {2, 4}
    eight = [c for c in plan.table if c.mesh_shape["pipe"] == 8]
    assert eight and all("4 microbatches are fewer than 8 stages" in c.reason for c in eight)
    _trains_as_one_device(plan, 32)


def test_a_step_fixed_to_its_own_mesh_is_named():
    mesh = jax.make_mesh((2,), ("pipe",), axis_types=(AxisType.Auto,))
    step = lambda m, s, x: _step(_Fixed(m, mesh), s, x)
    with pytest.raises(ValueError, match=r"calls `filter_pipeline\(\.\.\., mesh=\.\.\.\)`"):
        _plan(2, 8, step=step)


class _Fixed(eqx.Module):
    model: Model
    mesh: Any = eqx.field(static=True)

    def __call__(self, x):
        return self.model(x, mesh=self.mesh)


def test_blocks_the_step_computes_are_named():
    def step(model, opt_state, x):
        doubled = jax.tree.map(lambda a: 2 * a, model.blocks)
        return _step(Model(doubled, model.head), opt_state, x)

    with pytest.raises(ValueError, match=r"(?s)could not find these leaves.*blocks\.b"):
        _plan(2, 8, step=step)


def test_two_schedules_in_one_step_are_named():
    def step(model, opt_state, x):
        y = model(x, microbatches=2)
        return _step(model, opt_state, x + 0 * jnp.sum(y))

    with pytest.raises(ValueError, match=r"(?s)pipelines in more than one way.*microbatches="):
        _plan(2, 8, step=step)


def test_an_mpmd_step_is_named():
    def step(model, opt_state, x):
        loss = lambda y: jnp.mean(y**2)
        value, (grads, _) = eqxshard.pipeline_value_and_grad(
            ts.layer, model.blocks, x, loss, axis="pipe", microbatches=4
        )
        return model, opt_state, value

    with pytest.raises(ValueError, match=r"calls `pipeline_value_and_grad`.*outside `jit`"):
        _plan(2, 8, step=step)


def test_a_step_through_a_stacked_is_not_taken_for_one():
    # A plain `Stacked` runs its scan, and no pipeline is seen: the search goes on.
    keys = jax.random.split(jax.random.key(0), 4)
    stack = eqxshard.Stacked(eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(keys))
    step = lambda stack, x: jnp.mean(jax.vmap(stack)(x) ** 2)
    shapes = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    plan = eqxshard.auto_plan(step, stack, shapes, devices=1, budget="1GiB", progress=False)
    assert plan.chosen.fits and plan.pipeline is None


def test_a_plan_pipeline_is_checked():
    bad = {"axis": "pipe", "microbatches": 4, "repeats": 1, "in_step": False}
    old = r"`Plan\(pipeline=\{...\}\)`: give the pipeline as `Pipeline"
    with pytest.warns(DeprecationWarning, match=old), pytest.raises(ValueError, match=r"or an"):
        eqxshard.Plan({"pipe": 2}, jax.P(), jax.P(), pipeline=bad)
    with pytest.raises(TypeError, match=r"`Pipeline` takes `in_step` as a bool, but got 1"):
        eqxshard.Pipeline(axis="pipe", microbatches=4, in_step=1)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`Pipeline` takes `microbatches` of 1 or more, but"):
        eqxshard.Pipeline(axis="pipe", microbatches=0)
    with pytest.raises(TypeError, match=r"`Pipeline` takes `repeats` as an int, but got 2.0"):
        eqxshard.Pipeline(axis="pipe", microbatches=4, repeats=2.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`Pipeline` takes `axis` as a mesh axis name, but"):
        eqxshard.Pipeline(axis=3, microbatches=4)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`Plan` takes `pipeline` as None or an `eqxshard"):
        eqxshard.Plan({"pipe": 2}, jax.P(), jax.P(), pipeline=("pipe", 4))  # pyright: ignore[reportArgumentType]
