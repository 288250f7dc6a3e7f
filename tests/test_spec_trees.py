"""A `spec` given as a prefix PyTree of rules, callables and PartitionSpecs, in every verb
that takes one (eqxshard/_placement/spec_tree.py): the same layouts as each part given
on its own subtree, and as `filter_jit`'s `out_shardings`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MESH_KINDS, assert_placed, make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import (
    describe,
    filter_init,
    filter_shard,
    filter_shardings,
    first,
    fsdp,
    like,
    path_rules,
)

RULE = fsdp("data", min_size=0)


def make_model(key: Any = 0) -> eqx.nn.MLP:
    return eqx.nn.MLP(8, 8, 16, 2, key=jax.random.key(key) if isinstance(key, int) else key)


def model_and_state(mesh) -> tuple[Any, Any, Any]:
    model = filter_shard(make_model(), mesh, RULE)
    params = eqx.filter(model, eqx.is_array)
    return model, params, optax.adam(1e-3).init(params)


def shardings_of(tree: Any) -> list[Any]:
    return [x.sharding for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def spec_of(x: Any) -> P:
    assert isinstance(x.sharding, NamedSharding)
    return x.sharding.spec


def assert_same_layouts(out: Any, expected: Any) -> None:
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        if isinstance(a, jax.sharding.Sharding):  # a plan
            assert a.is_equivalent_to(b, len(b.spec) + 2) or a == b, (a, b)
        elif eqx.is_array(b):
            assert_placed(a, b.sharding, b)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_filter_shard_takes_a_tuple_of_rules(kind: str) -> None:
    mesh = make_mesh(kind)
    model, params, state = model_and_state(mesh)
    bare: tuple[Any, Any] = (
        make_model(),
        optax.adam(1e-3).init(eqx.filter(make_model(), eqx.is_array)),
    )
    out = filter_shard(bare, mesh, (RULE, like(params)))
    assert_same_layouts(out[0], filter_shard(make_model(), mesh, RULE))
    assert_same_layouts(out[1], filter_shard(bare[1], mesh, like(params)))
    # The moments are split like their parameters, the step count is replicated.
    assert out[1][0].mu.layers[0].weight.sharding.spec == model.layers[0].weight.sharding.spec
    assert out[1][0].mu.layers[0].weight.sharding.spec != P()
    assert out[1][0].count.sharding.spec == P()


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_tuple_of_rules_under_jit(kind: str) -> None:
    mesh = make_mesh(kind)
    model, params, state = model_and_state(mesh)
    plan = filter_shardings(params, mesh, RULE)  # inside `jit` on Auto axes, `like` needs it
    bare = filter_shard((params, state), mesh)  # replicated

    @eqx.filter_jit
    def f(tree):
        return filter_shard(tree, mesh, (RULE, like(params, plan)))

    with jax.set_mesh(mesh):
        out = f(bare)
    assert_same_layouts(out[0], params)
    assert_same_layouts(out[1], filter_shard(state, mesh, like(params)))


def test_filter_shardings_and_describe_take_a_tuple_of_rules() -> None:
    mesh = make_mesh("explicit")
    model, params, state = model_and_state(mesh)
    abstract = eqx.filter_eval_shape(lambda: (make_model(), state))
    plan = filter_shardings(abstract, mesh, (RULE, like(params)))
    assert plan[0] == filter_shardings(abstract[0], mesh, RULE)
    assert plan[1] == filter_shardings(abstract[1], mesh, like(params))
    table = describe((model, state), mesh, (RULE, like(params)))
    specs = {row.path: row.spec for row in table.rows}
    assert specs["1.0.mu.layers.0.weight"] == specs["0.layers.0.weight"] != "P()"
    assert specs["1.0.count"] == "P()"


def test_filter_init_takes_a_tuple_of_rules() -> None:
    mesh = make_mesh("auto")
    model, params, _ = model_and_state(mesh)

    def make(key):
        model = make_model(key)
        return model, optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))

    out = filter_init(make, mesh, (RULE, like(params)))(jax.random.key(0))
    expected = filter_shard(make(jax.random.key(0)), mesh, (RULE, like(params)))
    assert_same_layouts(out, expected)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        if eqx.is_array(a):
            assert jnp.array_equal(a, b)


def test_filter_restore_takes_a_tuple_of_rules(tmp_path: Path) -> None:
    mesh = make_mesh("explicit")
    model, params, state = model_and_state(mesh)
    eqxshard.filter_save(tmp_path, 0, (model, state))
    other = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    abstract = eqx.filter_eval_shape(lambda: (make_model(), state))
    plan = filter_shardings(abstract[0], other, RULE)
    out = eqxshard.filter_restore(tmp_path, abstract, other, (RULE, like(abstract[0], plan)))
    assert out[0].layers[0].weight.sharding.spec == P("data")
    assert out[1][0].mu.layers[0].weight.sharding.spec == P("data")
    assert out[1][0].mu.layers[0].weight.sharding.mesh.shape == other.shape
    np.testing.assert_array_equal(out[1][0].nu.layers[1].weight, state[0].nu.layers[1].weight)


def test_a_rule_in_a_tree_sees_paths_from_its_subtree() -> None:
    mesh = make_mesh("auto")
    tree = {"model": {"w": jnp.ones((8, 8))}, "batch": jnp.ones((16, 8))}
    seen = []

    def spec(path, leaf):
        seen.append(jax.tree_util.keystr(path))
        return P("data")

    rules = path_rules([(r"w", P(None, "model")), (r".*", P())])
    out = filter_shard(tree, mesh, {"model": rules, "batch": spec})
    assert out["model"]["w"].sharding.spec == P(None, "model")
    assert out["batch"].sharding.spec == P("data")
    assert seen == [""]  # the batch is the whole subtree the callable was given for
    # The same tree as `filter_jit`'s `out_shardings` gives the same layouts.
    jitted = eqxshard.filter_jit(
        lambda t: t, out_shardings={"model": rules, "batch": spec}, mesh=mesh
    )
    assert_same_layouts(jitted(tree), out)


def test_first_takes_a_tree_of_rules() -> None:
    mesh = make_mesh("auto")
    tree = {"a": jnp.ones((8, 8)), "b": jnp.ones((16,)), "c": jnp.ones((4,))}
    rule = first({"a": RULE, "b": lambda path, leaf: P("data")}, P())
    out = filter_shard(tree, mesh, rule)
    assert [spec_of(out[k]) for k in "abc"] == [P("data"), P("data"), P()]


def test_a_spec_tree_with_a_mistake_says_what_a_spec_may_be() -> None:
    mesh = make_mesh("auto")
    tree = (make_model(), {"w": jnp.ones(8)})
    words = r"a `spec` is a PartitionSpec, a rule \(`fsdp`.*a callable.*prefix PyTree"
    with pytest.raises(TypeError, match=rf"(?s)\n  1\.w\s+spec 'data' is not a.*{words}"):
        filter_shard(tree, mesh, (RULE, {"w": "data"}))
    with pytest.raises(
        ValueError, match=r"got a `spec` for leaves that are not arrays(?s:.*)\n  1"
    ):
        filter_shard((jnp.ones(8), 3), mesh, (RULE, RULE))
    with pytest.raises(ValueError, match=r"`spec` whose structure is not a prefix of `tree`"):
        filter_shardings((jnp.ones(8), jnp.ones(8)), mesh, (RULE, RULE, RULE))
    with pytest.raises(TypeError, match=r"a rule `spec` was given with target"):
        filter_shard((jnp.ones(8), jnp.ones(8)), jax.devices()[0], (RULE, None))


def test_filter_shard_map_takes_a_tree_of_rules_and_specs() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    weights, batch = jnp.arange(64.0).reshape(8, 8), jnp.arange(32.0).reshape(16, 2)
    seen = []

    def batch_spec(path, leaf):
        seen.append(path)
        return P("data")

    def local(w, x):
        return (w.sum() + x.sum())[None]

    out = eqxshard.filter_shard_map(
        local,
        mesh=mesh,
        in_specs=(fsdp("data", min_size=0), batch_spec),
        out_specs=P("data"),
    )(weights, batch)
    # Each device sums its row of `weights` (fsdp splits dim 0) and its two rows of the batch.
    expected = weights.sum(1) + batch.reshape(8, 4).sum(1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected))
    assert seen == [()]  # the batch is the whole subtree the callable was given for
