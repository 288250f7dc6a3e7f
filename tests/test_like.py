"""`like(params)`: optimiser state laid out like its parameters (eqxshard/_plans/like.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MESH_KINDS, assert_placed, assert_sharding, make_mesh, named
from jax.sharding import PartitionSpec as P

import eqxshard
from eqxshard import filter_init, filter_shardings, fsdp, like, path_rules

RULES = path_rules([(r"layers\.[01]\.weight", P("data", "model")), (r".*", P())])


def params_on(mesh) -> eqx.nn.MLP:
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    return eqx.filter(eqxshard.filter_shard(model, mesh, RULES), eqx.is_array)


def init_of(optimiser: optax.GradientTransformation) -> Callable[[Any], tuple[Any, ...]]:
    """`optimiser.init`, typed as used here: optax types parameters and states as `ArrayTree`,
    which an Equinox module is not and whose parts cannot be indexed; these states are tuples."""
    return cast(Callable[[Any], tuple[Any, ...]], optimiser.init)


def check_adam_state(state, params, mesh) -> None:
    adam = state[0]
    for moments in (adam.mu, adam.nu):
        for m, p in zip(jax.tree.leaves(moments), jax.tree.leaves(params), strict=True):
            assert_sharding(m.sharding, p.sharding, p.ndim)
            assert m.sharding.device_set == p.sharding.device_set
    assert_sharding(adam.mu.layers[0].weight.sharding, named(mesh, "data", "model"), 2)
    assert_sharding(adam.count.sharding, named(mesh), 0)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_outside_jit_lays_out_an_existing_state(kind: str) -> None:
    mesh = make_mesh(kind)
    params = params_on(mesh)
    optimiser = optax.adam(1e-3)
    state = init_of(optimiser)(params)  # eagerly: the moments follow, the counter does not
    assert state[0].count.sharding.device_set == {jax.devices()[0]}
    placed = eqxshard.filter_shard(state, mesh, like(params))
    check_adam_state(placed, params, mesh)
    assert_placed(placed[0].count, named(mesh), state[0].count)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_filter_init_creates_the_state_in_place(kind: str) -> None:
    mesh = make_mesh(kind)
    params = params_on(mesh)
    optimiser = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = filter_init(init_of(optimiser), mesh, like(params))(params)
    check_adam_state(state[1], params, mesh)
    expected = init_of(optimiser)(params)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_inside_jit_explicit_reads_traced_params() -> None:
    mesh = make_mesh("explicit")
    params = params_on(mesh)
    optimiser = optax.adam(1e-3)

    @eqx.filter_jit
    def init(params):
        return eqxshard.filter_shard(optimiser.init(params), mesh, like(params))

    with jax.set_mesh(mesh):
        state = init(params)
    check_adam_state(state, params, mesh)


@pytest.mark.parametrize("kind", ["auto", "mixed"])
def test_inside_jit_auto_needs_the_plan(kind: str) -> None:
    mesh = make_mesh(kind)
    params = params_on(mesh)
    plan = filter_shardings(params, mesh, RULES)
    optimiser = optax.adam(1e-3)

    @eqx.filter_jit
    def init(params):
        return eqxshard.filter_shard(optimiser.init(params), mesh, like(params, plan=plan))

    with jax.set_mesh(mesh):
        check_adam_state(init(params), params, mesh)

    @eqx.filter_jit
    def init_without_plan(params):
        return eqxshard.filter_shard(optimiser.init(params), mesh, like(params))

    with pytest.raises(ValueError, match="`like` cannot read the layout") as info:
        init_without_plan(params)
    assert "traced and laid out over Auto mesh axes" in str(info.value)
    assert "layers.0.weight" in str(info.value) and "plan=filter_shardings" in str(info.value)


def test_jit_of_init_alone_does_not_follow_on_auto_meshes() -> None:
    """Why `like` exists: `jit(optimiser.init)` makes fresh zeros, laid out by JAX's own
    choice, not like the parameters, on Auto meshes."""
    mesh = make_mesh("auto")
    params = params_on(mesh)
    state = eqx.filter_jit(init_of(optax.adam(1e-3)))(params)
    weight = params.layers[0].weight
    assert not state[0].mu.layers[0].weight.sharding.is_equivalent_to(weight.sharding, 2)
    # On Explicit meshes (with the mesh set) the moments follow the parameters already.
    mesh = make_mesh("explicit")
    params = params_on(mesh)
    with jax.set_mesh(mesh):
        state = eqx.filter_jit(init_of(optax.adam(1e-3)))(params)
    assert_sharding(state[0].mu.layers[0].weight.sharding, params.layers[0].weight.sharding, 2)


def test_longest_suffix_and_shape_decide() -> None:
    mesh = make_mesh("auto")
    params = {
        "a": {"w": jnp.ones((8, 8))},
        "w": jnp.ones((8, 8)),
    }
    params = eqxshard.filter_shard(params, mesh, {"a": P("data"), "w": P(None, "model")})
    state = {
        "mu": params,
        "row": {"w": jnp.ones(8)},  # ends with "w" but another shape: replicated
        "step": jnp.zeros((), jnp.int32),
    }
    plan = filter_shardings(state, mesh, like(params))
    assert plan["mu"]["a"]["w"].spec == P("data")
    assert plan["mu"]["w"].spec == P(None, "model")
    assert plan["row"]["w"].spec == P() and plan["step"].spec == P()


def test_abstract_params_with_a_plan_and_single_device_params() -> None:
    mesh = make_mesh("explicit")
    abstract = eqx.filter_eval_shape(lambda: {"w": jnp.ones((8, 4)), "b": jnp.ones(4)})
    plan = filter_shardings(abstract, mesh, fsdp("data", min_size=0))
    state = eqx.filter_eval_shape(optax.sgd(0.1, momentum=0.9).init, abstract)
    got = filter_shardings(state, mesh, like(abstract, plan=plan))
    assert got[0].trace["w"].spec == P("data") and got[0].trace["b"].spec == P("data")
    # Parameters on one device count as replicated.
    on_one = jax.device_put({"w": jnp.ones((8, 4))}, jax.devices()[0])
    assert filter_shardings({"mu": on_one}, mesh, like(on_one))["mu"]["w"].spec == P()
    device_plan = {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    assert filter_shardings({"mu": on_one}, mesh, like(on_one, device_plan))["mu"]["w"].spec == P()


def test_parameters_whose_layout_cannot_be_read() -> None:
    with pytest.raises(ValueError, match="`like` cannot read the layout") as info:
        like({"host": np.ones(3), "abstract": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert "is a ndarray that is not placed on a mesh" in str(info.value)
    assert "is abstract, with no sharding" in str(info.value)
    with pytest.raises(ValueError, match="has no Sharding in `plan` at this path"):
        like({"w": jnp.ones(2), "b": jnp.ones(2)}, plan={"w": None, "b": None})
