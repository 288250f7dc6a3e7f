"""`filter_shardings` and `filter_init` (eqxshard/_plans/plan.py)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    MESH_KINDS,
    Device,
    assert_equal_value,
    assert_placed,
    assert_sharding,
    make_mesh,
    make_model,
    named,
)
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import _compat, describe, filter_init, filter_shardings, fsdp, path_rules


def make_mlp(key: jax.Array, width: int = 16) -> eqx.nn.MLP:
    return eqx.nn.MLP(8, 8, width, 2, key=key)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


# ----------------------------------------------------------------------------- filter_shardings


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_plan_is_what_filter_shard_gives(kind: str) -> None:
    mesh = make_mesh(kind)
    model = make_model()
    spec = lambda path, leaf: P("data") if leaf.ndim == 2 else P()
    plan = filter_shardings(model, mesh, spec)
    abstract_plan = filter_shardings(eqx.filter_eval_shape(make_model), mesh, spec)
    placed = eqxshard.filter_shard(model, mesh, spec)
    for p, a, x in zip(
        jax.tree.leaves(plan), jax.tree.leaves(abstract_plan), arrays(placed), strict=True
    ):
        assert p == a
        assert_sharding(x.sharding, p, x.ndim)
    # Non-array leaves of the plan are None; statics keep their values.
    assert plan.fn is None and plan.count is None and plan.activation is jax.nn.relu


def test_plan_leaves_alone_and_feeds_back_into_filter_shard() -> None:
    mesh = make_mesh("explicit")
    tree = {"a": jnp.ones((8, 2)), "b": np.ones(4, np.float32), "c": "text"}
    plan = filter_shardings(tree, mesh, {"a": P("data"), "b": None, "c": None})
    assert plan["b"] is None and plan["c"] is None
    placed = eqxshard.filter_shard(tree, plan)
    assert_placed(placed["a"], named(mesh, "data"), tree["a"])
    assert placed["b"] is tree["b"] and placed["c"] == "text"


def test_plan_uses_the_ambient_mesh_and_other_targets() -> None:
    mesh = make_mesh("explicit")
    tree = {"a": jax.ShapeDtypeStruct((8, 2), jnp.float32)}
    with jax.set_mesh(mesh):
        assert filter_shardings(tree, spec=P("data"))["a"] == named(mesh, "data")
        assert filter_shardings(tree, P(None, "model"))["a"] == named(mesh, None, "model")
    device = jax.devices()[3]
    assert filter_shardings(tree, device)["a"] == jax.sharding.SingleDeviceSharding(device)


def test_plan_errors_are_filter_shard_errors() -> None:
    mesh = make_mesh("auto")
    tree = {"a": jax.ShapeDtypeStruct((6, 2), jnp.float32)}
    with pytest.raises(ValueError, match="`filter_shardings` cannot split these leaves evenly"):
        filter_shardings(tree, mesh, P("data"))
    with pytest.raises(
        ValueError, match="`filter_shardings` was given a PartitionSpec but no mesh"
    ):
        filter_shardings(tree, P("data"))
    with pytest.raises(ValueError, match="`filter_shardings` was given no `target` and no mesh"):
        filter_shardings(tree)
    with pytest.raises(TypeError, match="`filter_shardings` cannot read the `target`/`spec`"):
        filter_shardings(tree, mesh, 3)


# ----------------------------------------------------------------------------- filter_init


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_init_matches_the_unsharded_model(kind: str) -> None:
    mesh = make_mesh(kind)
    key = jax.random.key(1)
    rules = path_rules([(r"layers\.2\..*", P())]) | fsdp(("data", "model"), min_size=0)
    model = filter_init(make_mlp, mesh, rules)(key)
    expected = make_mlp(key)
    plan = filter_shardings(expected, mesh, rules)
    for x, want, sharding in zip(
        arrays(model), arrays(expected), jax.tree.leaves(plan), strict=True
    ):
        assert_placed(x, sharding, want)
    assert model.activation is expected.activation  # statics from the abstract tree
    assert jax.tree.structure(model) == jax.tree.structure(expected)


def test_init_takes_static_and_keyword_arguments() -> None:
    mesh = make_mesh("explicit")
    calls = []

    def make(key, width, *, scale):
        calls.append(width)
        return {"w": jax.random.normal(key, (width, 2)) * scale, "name": "w", "n": width}

    out = filter_init(make, mesh, P("data"))(jax.random.key(0), 8, scale=jnp.float32(2.0))
    assert out["name"] == "w" and out["n"] == 8
    assert_placed(out["w"], named(mesh, "data"), make(jax.random.key(0), 8, scale=2.0)["w"])
    assert calls == [8, 8, 8]  # traced for its shapes, traced under jit, and called above


def test_init_leaves_alone_what_the_spec_leaves_alone() -> None:
    mesh = make_mesh("auto")
    out = filter_init(
        lambda: {"a": jnp.ones((8, 2)), "b": jnp.zeros(3)}, mesh, {"a": P("data"), "b": None}
    )()
    assert_placed(out["a"], named(mesh, "data"), jnp.ones((8, 2)))
    assert_equal_value(out["b"], jnp.zeros(3))


def test_init_never_holds_more_than_a_shard_per_device() -> None:
    mesh = make_mesh("auto", shape=(8,), names=("data",))
    make = lambda key: make_mlp(key, width=256)
    rule = fsdp("data", min_size=0)
    key = jax.random.key(0)
    table = describe(eqx.filter_eval_shape(make, key), mesh, rule)
    assert table.max_bytes_per_device * 8 == table.total_bytes
    memory = filter_init(make, mesh, rule).lower(key).compile().memory_analysis()
    # The output is one shard of each leaf per device (plus a pointer per leaf), and the
    # temporaries of the random number generation are per shard too.
    n_leaves = len(table.rows)
    assert table.max_bytes_per_device <= memory.output_size_in_bytes
    assert memory.output_size_in_bytes <= table.max_bytes_per_device + 8 * n_leaves
    assert memory.output_size_in_bytes + memory.temp_size_in_bytes < table.total_bytes / 2
    # Without a plan, one device holds the whole model.
    whole = jax.jit(lambda k: eqx.filter(make(k), eqx.is_array)).lower(key).compile()
    whole_memory = whole.memory_analysis()
    assert whole_memory is not None  # the CPU backend reports it
    assert whole_memory.output_size_in_bytes >= table.total_bytes
    # Live bytes after the init: each device holds exactly its shards.
    model = filter_init(make, mesh, rule)(key)
    per_device: dict[Device, int] = {}
    for x in arrays(model):
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert per_device == table.bytes_per_device


def test_init_errors_come_before_running() -> None:
    mesh = make_mesh("auto")
    with pytest.raises(ValueError, match="`filter_init` cannot split these leaves evenly"):
        filter_init(lambda: jnp.ones(6), mesh, P("data"))()
    with pytest.raises(ValueError, match="`filter_init` has no rule that matches"):
        filter_init(make_mlp, mesh, path_rules([]))(jax.random.key(0))
    with pytest.raises(TypeError, match="`filter_init` takes a callable `fn`, but got int"):
        filter_init(3, mesh)  # type: ignore[arg-type]


def test_init_with_a_named_sharding_prefix_target() -> None:
    mesh = make_mesh("explicit")
    target = {"a": NamedSharding(mesh, P("data")), "b": jax.devices()[2]}
    out = filter_init(lambda: {"a": jnp.arange(8.0), "b": jnp.ones(2)}, target)()
    assert_placed(out["a"], named(mesh, "data"), jnp.arange(8.0))
    assert_placed(out["b"], jax.sharding.SingleDeviceSharding(jax.devices()[2]), jnp.ones(2))


def test_plan_on_an_abstract_mesh_of_512_devices() -> None:
    """A plan for a machine one does not have: no devices, any size, the same checks."""
    mesh = _compat.abstract_mesh((64, 8), ("data", "model"))
    shapes = {
        "w": jax.ShapeDtypeStruct((1024, 512), jnp.float32),
        "b": jax.ShapeDtypeStruct((512,), jnp.float32),
    }
    plan = filter_shardings(
        shapes, mesh, path_rules([("w", P("data", "model")), ("b", P("model"))])
    )
    assert plan["w"] == NamedSharding(mesh, P("data", "model"))
    assert plan["b"] == NamedSharding(mesh, P("model"))
    assert plan["w"].mesh.size == 512
    # fsdp over both axes: 512 parts; dim 0 (1024) is the largest that 512 divides.
    assert filter_shardings(shapes, mesh, fsdp(("data", "model"), min_size=0))["w"].spec == P(
        ("data", "model")
    )
    odd = {"w": jax.ShapeDtypeStruct((100, 30), jnp.float32)}
    with pytest.raises(ValueError, match=r"(?s)no dim is divisible by 64.*\n  w"):
        filter_shardings(odd, mesh, fsdp("data", min_size=0))


def test_init_with_unconstrained_dims_places_them_as_filter_shard_does() -> None:
    # Outside `jit`, `P.UNCONSTRAINED` dims are not split (`jit`'s `out_shardings` would
    # refuse them); the same layout `filter_shard` gives the built model.
    mesh = make_mesh("auto")
    make = lambda key: eqx.nn.Linear(16, 8, key=key)
    rule = eqxshard.logical(
        path_rules([("weight", P("rows", P.UNCONSTRAINED)), (".*", P())]), {"rows": "data"}
    )
    model = filter_init(make, mesh, rule)(jax.random.key(0))
    shard = eqxshard.filter_shard(make(jax.random.key(0)), mesh, rule)
    assert model.weight.sharding.is_equivalent_to(shard.weight.sharding, 2)
    assert isinstance(model.weight.sharding, NamedSharding)
    assert model.weight.sharding.spec == P("data", None)
    np.testing.assert_array_equal(model.weight, shard.weight)


def test_unconstrained_on_a_mesh_without_auto_axes_names_the_leaf() -> None:
    mesh = make_mesh("explicit")
    rule = path_rules([("weight", P("data", P.UNCONSTRAINED)), (".*", P())])
    make = lambda key: eqx.nn.Linear(16, 8, key=key)
    match = r"(?s)`filter_init` got `P.UNCONSTRAINED`.*\n  weight .*data: Explicit.*Use `None`"
    with pytest.raises(ValueError, match=match):
        filter_init(make, mesh, rule)(jax.random.key(0))
    with pytest.raises(ValueError, match=match.replace("filter_init", "filter_shard")):
        eqxshard.filter_shard(make(jax.random.key(0)), mesh, rule)
