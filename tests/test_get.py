"""`filter_get`: every array leaf to host NumPy with its exact value; statics untouched."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MESH_KINDS, assert_statics_same, make_mesh, make_model, named
from jax.sharding import PartitionSpec as P

import eqxshard


def _check_host(out: Any, tree: Any) -> None:
    """Every non-key array leaf of `out` is a NumPy array equal to the input, same dtype."""
    assert_statics_same(out, tree)
    for x, ref in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        if eqx.is_array(ref) and not jnp.issubdtype(ref.dtype, jax.dtypes.prng_key):
            assert type(x) is np.ndarray, type(x)
            assert x.shape == ref.shape and x.dtype == ref.dtype
            np.testing.assert_array_equal(x, np.asarray(ref))


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_sharded_replicated_and_single_device_arrays(kind: str) -> None:
    mesh = make_mesh(kind)
    tree = {
        "both": jax.device_put(jnp.arange(32.0).reshape(8, 4), named(mesh, "data", "model")),
        "rows": jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(8, 2), named(mesh, "data")),
        "cols": jax.device_put(
            jnp.arange(8, dtype=jnp.bfloat16).reshape(2, 4), named(mesh, None, "model")
        ),
        "replicated": jax.device_put(jnp.array([1.5, -2.0, 3.25]), named(mesh)),
        "single": jax.device_put(jnp.arange(5, dtype=jnp.uint8), jax.devices()[6]),
        "uncommitted": jnp.array([True, False]),
        "scalar": jnp.float32(7.0),
        "numpy": np.arange(3.0),
        "name": "params",
        "act": jax.nn.gelu,
    }
    out = eqxshard.filter_get(tree)
    _check_host(out, tree)
    assert out["scalar"].shape == () and out["scalar"] == 7.0
    np.testing.assert_array_equal(out["both"], np.arange(32.0).reshape(8, 4))


def test_pinned_host_arrays() -> None:
    mesh = make_mesh("explicit")
    x = jax.device_put(jnp.arange(8.0), named(mesh, "data").with_memory_kind("pinned_host"))
    out = eqxshard.filter_get({"x": x})
    assert type(out["x"]) is np.ndarray
    np.testing.assert_array_equal(out["x"], np.arange(8.0))


def test_a_model_keeps_its_statics() -> None:
    model = make_model()
    model = eqxshard.filter_shard(model, make_mesh("auto"), P("data"))
    out = eqxshard.filter_get(model)
    assert type(out) is type(model)
    assert out.activation is model.activation and out.fn is model.fn
    assert out.name is model.name and out.count == model.count
    _check_host(out, model)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_prng_keys_come_back_as_key_arrays(kind: str) -> None:
    mesh = make_mesh(kind)
    keys = jax.random.split(jax.random.key(3), 8)
    tree = {
        "sharded": jax.device_put(keys, named(mesh, "data")),
        "replicated": jax.device_put(keys[:2], named(mesh)),
        "one": jax.random.key(5, impl="rbg"),
        "raw": jax.random.PRNGKey(4),  # an old-style uint32 key is a plain array
    }
    out = eqxshard.filter_get(tree)
    for name in ("sharded", "replicated", "one"):
        x, ref = out[name], tree[name]
        assert jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        assert jax.random.key_impl(x) == jax.random.key_impl(ref)
        assert x.shape == ref.shape
        np.testing.assert_array_equal(jax.random.key_data(x), jax.random.key_data(ref))
        assert x.is_fully_addressable and len(x.sharding.device_set) == 1
    # The keys still work as keys, giving the same numbers.
    np.testing.assert_array_equal(
        jax.random.normal(out["sharded"][3], (2,)), jax.random.normal(keys[3], (2,))
    )
    assert type(out["raw"]) is np.ndarray and out["raw"].dtype == np.uint32
    np.testing.assert_array_equal(out["raw"], np.asarray(tree["raw"]))


def test_a_tree_without_arrays() -> None:
    tree = {"name": "x", "fn": jnp.tanh, "n": 3, "nothing": None}
    out = eqxshard.filter_get(tree)
    assert out == tree
    assert out["fn"] is tree["fn"]


def test_inside_jit_is_an_error() -> None:
    mesh = make_mesh("auto")
    tree = {"w": jax.device_put(jnp.ones((8, 2)), named(mesh, "data")), "name": "w"}
    with pytest.raises(TypeError, match=r"`filter_get` cannot fetch traced leaves") as info:
        eqx.filter_jit(eqxshard.filter_get)(tree)
    assert "\n  w" in str(info.value)
    with pytest.raises(TypeError, match="Call `filter_get` outside the transformation"):
        jax.jit(eqxshard.filter_get)(tree["w"])
