"""The placement cache: a call seen to pass every check is placed from its remembered
plan; any change that could change the result or an error takes the full path again."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_placed, make_mesh, make_model, named
from jax.sharding import NamedSharding, PartitionSpec as P

from eqxshard import filter_put, filter_replicate, filter_shard
from eqxshard._placement import cache, resolve


@pytest.fixture
def resolves(monkeypatch):
    """How often the full path resolved a call (from a fresh cache)."""
    cache.clear()
    calls = []
    real = resolve.resolve

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(resolve, "resolve", counted)
    yield calls
    cache.clear()


def test_same_call_again_is_not_resolved_again(resolves):
    mesh = make_mesh("auto", (8,), ("data",))
    model = make_model()
    placed = filter_shard(model, mesh)
    again = filter_shard(placed, mesh)
    assert resolves == ["filter_shard"]
    assert again is placed  # nothing to move: the very tree back, no copy
    moved = filter_shard(make_model(), mesh)  # a new tree of the same kind: transferred
    assert resolves == ["filter_shard"]
    assert cache.counts() == {"hits": 2, "misses": 1}
    for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(placed), strict=True):
        if eqx.is_array(x):
            assert_placed(x, named(mesh), y)
        else:
            assert x is y


def test_remembered_call_places_like_the_full_path(resolves):
    mesh = make_mesh("auto", (4, 2), ("data", "model"))
    tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "b": np.ones(8, np.int32), "n": 3}
    spec = {"w": P("data", "model"), "b": P("model"), "n": None}
    first = filter_shard(tree, mesh, spec)
    cache.clear()
    full = filter_shard(tree, mesh, spec)  # remembered again, from the full path
    remembered = filter_shard(tree, mesh, spec)
    assert cache.counts() == {"hits": 1, "misses": 1}
    for out in (first, remembered):
        assert out["n"] == 3
        for name in ("w", "b"):
            assert_placed(out[name], full[name].sharding, tree[name])


def change_shape(t):
    return {**t, "x": np.ones((16, 4), np.float32)}


def change_dtype(t):
    return {**t, "x": t["x"].astype(np.int32)}


def change_structure(t):
    return {**t, "y": np.ones(8, np.float32)}


def change_leaf_type(t):
    return {**t, "step": np.ones(8, np.int32)}  # was a Python int, now an array


@pytest.mark.parametrize("change", [change_shape, change_dtype, change_structure, change_leaf_type])
def test_a_different_tree_is_resolved_again(resolves, change):
    mesh = make_mesh("auto", (8,), ("data",))
    tree = {"x": np.ones((8, 4), np.float32), "step": 3}
    filter_shard(tree, mesh, P("data"))
    out = filter_shard(change(tree), mesh, P("data"))
    assert len(resolves) == 2
    assert out["x"].sharding.is_equivalent_to(named(mesh, "data"), 2)


def test_a_different_target_spec_or_mesh_is_resolved_again(resolves):
    tree: dict[str, Any] = {"x": np.ones((8, 4), np.float32)}
    mesh = make_mesh("auto", (8,), ("data",))
    other = make_mesh("auto", (8,), ("data",), jax.devices()[::-1])
    small = make_mesh("auto", (2,), ("data",))
    calls = [
        lambda: filter_shard(tree, mesh, P("data")),
        lambda: filter_shard(tree, mesh, P()),
        lambda: filter_shard(tree, other, P("data")),
        lambda: filter_shard(tree, small, P("data")),
        lambda: filter_shard(tree, NamedSharding(mesh, P("data"))),
        lambda: filter_shard(tree, jax.devices()[1]),
        lambda: filter_shard(tree, {"x": NamedSharding(small, P())}),
    ]
    results = [call() for call in calls]
    assert len(resolves) == len(calls)
    assert results[2]["x"].sharding.mesh == other
    assert results[3]["x"].sharding.mesh == small
    assert results[5]["x"].sharding.device_set == {jax.devices()[1]}
    for call in calls:  # each one again: remembered
        call()
    assert len(resolves) == len(calls)


def test_the_ambient_mesh_is_part_of_the_call(resolves):
    tree: dict[str, Any] = {"x": np.ones((8, 4), np.float32)}
    mesh, small = make_mesh("auto", (8,), ("data",)), make_mesh("auto", (2,), ("data",))
    with jax.set_mesh(mesh):
        filter_shard(tree, P("data"))
    with jax.set_mesh(small):
        out = filter_shard(tree, P("data"))
    assert len(resolves) == 2
    assert out["x"].sharding.mesh == small
    with pytest.raises(ValueError, match="no mesh is set"):
        filter_shard(tree, P("data"))


def test_errors_are_raised_on_every_call(resolves):
    mesh = make_mesh("auto", (8,), ("data",))
    filter_shard({"x": np.ones((8, 4))}, mesh, P("data"))
    for _ in range(2):  # a failing call is never remembered
        with pytest.raises(ValueError, match=r"\n  x.*dim 0 = 6 is not divisible by 8"):
            filter_shard({"x": np.ones((6, 4))}, mesh, P("data"))
        with pytest.raises(TypeError, match="dtype JAX has no arrays of"):
            filter_shard({"x": np.array(["a"] * 8)}, mesh, P("data"))
    assert len(resolves) == 5


def test_callable_specs_are_called_every_time(resolves):
    mesh = make_mesh("auto", (8,), ("data",))
    seen = []

    def spec(path, leaf):
        seen.append(jax.tree_util.keystr(path))
        return P("data")

    tree = {"x": np.ones((8, 4))}
    filter_shard(tree, mesh, spec)
    filter_shard(tree, mesh, spec)
    assert seen == ["['x']", "['x']"]
    assert len(resolves) == 2


def test_nothing_is_remembered_inside_jit(resolves):
    mesh = make_mesh("auto", (8,), ("data",))

    @jax.jit
    def f(x):
        return filter_shard(filter_shard(x, mesh, P("data")), mesh, P("data"))

    f(jnp.ones((8, 4)))
    assert len(resolves) == 2
    assert cache.counts() == {"hits": 0, "misses": 0}


def test_filter_put_remembers_memory_kinds(resolves):
    tree: dict[str, Any] = {"x": np.ones((8, 4), np.float32)}
    device = jax.devices()[2]
    on_host = filter_put(tree, device, memory_kind="pinned_host")
    filter_put(tree, device, memory_kind="pinned_host")
    back = filter_put(on_host, device, memory_kind="device")
    assert len(resolves) == 2
    assert on_host["x"].sharding.memory_kind == "pinned_host"
    assert back["x"].sharding.memory_kind == "device"
    assert filter_put(back, device, memory_kind="device") is back


def test_filter_replicate_remembers_too(resolves):
    mesh, small = make_mesh("auto", (8,), ("data",)), make_mesh("auto", (2,), ("data",))
    tree = {"x": jnp.ones((3, 5))}  # jax.Arrays: placed ones have the same leaf types
    placed = filter_replicate(tree, mesh)
    assert filter_replicate(placed, mesh) is placed
    other = filter_replicate(placed, small)
    assert resolves == ["filter_replicate", "filter_replicate"]
    assert_placed(other["x"], named(small), tree["x"])
    with pytest.raises(ValueError, match="no `mesh` and no mesh is set"):
        filter_replicate(tree)
