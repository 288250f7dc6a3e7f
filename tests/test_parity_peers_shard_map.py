"""`filter_shard_map` against `jax.shard_map` on the cases of JAX's `shard_map_test.py`
that `test_parity_shard_map.py` does not run: every dtype family, PRNG keys, zero-size
arrays, NumPy inputs, namedtuples, scalars, and Python scalars given a spec of their own
(which JAX makes arrays). On Explicit axes JAX is given inputs already laid out."""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

from eqxshard import filter_shard_map

Pair = collections.namedtuple("Pair", "a b")


def _same(out, ref):
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    ref_leaves, ref_def = jax.tree_util.tree_flatten(ref)
    assert out_def == ref_def
    for a, b in zip(out_leaves, ref_leaves, strict=True):
        assert isinstance(a, jax.Array) and isinstance(b, jax.Array), (a, b)
        weak = jax.typeof(a).weak_type, jax.typeof(b).weak_type
        assert (a.shape, a.dtype, weak[0]) == (b.shape, b.dtype, weak[1]), (a, b)
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if a.size:  # `np.asarray` of a split zero-size array fails in JAX itself
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec


def _laid_out(mesh, args, in_specs):
    """The arguments placed as `in_specs` (a prefix tree of them) say."""

    def place(spec, subtree):
        return jax.tree.map(
            lambda x: (
                jax.device_put(x, NamedSharding(mesh, spec)) if isinstance(x, jax.Array) else x
            ),
            subtree,
        )

    return jax.tree.map(place, tuple(in_specs), tuple(args), is_leaf=lambda s: isinstance(s, P))


def _check(kind, jit, fun, args, in_specs, out_specs):
    mesh = make_mesh(kind, shape=(2, 4), names=("x", "y"))
    kw: dict[str, Any] = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    ours, theirs = filter_shard_map(fun, **kw), jax.shard_map(fun, **kw)
    if jit:
        ours, theirs = jax.jit(ours), jax.jit(theirs)
    _same(ours(*args), theirs(*_laid_out(mesh, args, in_specs)))


KINDS = [("auto", False), ("explicit", True)]  # one eager and one jitted run each
JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])


@pytest.mark.parametrize("kind,jit", KINDS)
@pytest.mark.parametrize(
    "dtype", [jnp.bool_, jnp.uint8, jnp.int32, jnp.bfloat16, jnp.float16, jnp.complex64]
)
def test_dtypes(dtype, kind, jit):
    x = (jnp.arange(16) % 3).reshape(8, 2).astype(dtype)
    _check(kind, jit, lambda x: (x, x[::-1]), (x,), (P("x"),), (P("x"), P("x")))


@pytest.mark.parametrize("kind,jit", KINDS)
def test_prng_keys_and_numpy(kind, jit):
    keys = jax.random.split(jax.random.key(0), 8)
    _check(kind, jit, lambda k: (k, jax.random.key_data(k)), (keys,), (P("x"),), P("x"))
    x = jnp.arange(8.0)  # NumPy arguments: JAX makes them arrays (not laid out, so Auto only)
    mesh = make_mesh("auto", shape=(2, 4), names=("x", "y"))
    kw: dict[str, Any] = dict(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    host = np.arange(8.0, dtype=np.float32)
    _same(filter_shard_map(lambda a: a * 2, **kw)(host), jax.shard_map(lambda a: a * 2, **kw)(x))


@pytest.mark.skipif(
    JAX_VERSION < (0, 8),
    reason="JAX 0.7's own shard_map fails on zero-size arrays ('Unexpected XLA sharding override')",
)
@pytest.mark.parametrize("kind,jit", KINDS)
def test_zero_size(kind, jit):
    _check(kind, jit, lambda z: z * 2, (jnp.zeros((8, 0)),), (P("x"),), P("x"))
    _check(kind, jit, lambda z: z * 2, (jnp.zeros((0, 4)),), (P(None, "y"),), P(None, "y"))


@pytest.mark.parametrize("kind,jit", KINDS)
def test_namedtuples_and_multi_axis_specs(kind, jit):
    x = jnp.arange(16.0).reshape(4, 4)
    spec = Pair(P("x", "y"), P())
    _check(kind, jit, lambda t: Pair(t.a * 2, t.b + 1), (Pair(x, x),), (spec,), spec)
    _check(kind, jit, lambda a: a.T, (x,), (P("x", "y"),), P("y", "x"))
    flat = jnp.arange(16.0)
    _check(kind, jit, lambda a: a * 2, (flat,), (P(("x", "y")),), P(("x", "y")))


@pytest.mark.parametrize("kind,jit", [*KINDS, ("auto", True), ("explicit", False)])
def test_python_scalars_given_their_own_spec_are_arrays(kind, jit):
    # `jax.shard_map` makes a Python scalar argument or output with a spec of its own an
    # array (weakly typed); eqxshard refused it ("in_specs for leaves that are not arrays").
    x = jnp.arange(8.0)
    specs = (P("x"), P())
    _check(kind, jit, lambda a, s: (a * s, s), (x, 2.0), specs, (P("x"), P()))
    _check(kind, jit, lambda a: (a, 3), (x,), (P("x"),), (P("x"), P()))
    _check(kind, jit, lambda a: True, (x,), (P("x"),), P())


def test_python_scalars_under_a_prefix_spec_stay_as_they_are():
    # A spec over a whole subtree leaves its non-array leaves alone (eqxshard's addition).
    mesh = make_mesh("explicit", shape=(2, 4), names=("x", "y"))
    model = {"w": jnp.arange(8.0), "n": 3}
    seen = []

    def body(m):
        seen.append(m["n"])
        return m["w"] * m["n"], m["n"]

    out, n = filter_shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), None))(model)
    assert seen == [3] and n == 3
    np.testing.assert_array_equal(out, np.arange(8.0) * 3)


def test_a_string_given_a_spec_is_still_refused():
    mesh = make_mesh("auto", shape=(2, 4), names=("x", "y"))
    with pytest.raises(TypeError, match="not a valid JAX type"):
        jax.shard_map(lambda a, s: a, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(
            jnp.arange(8.0), "s"
        )
    with pytest.raises(ValueError, match=r"`in_specs` for leaves that are not arrays:\n  1"):
        filter_shard_map(lambda a, s: a, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(
            jnp.arange(8.0), "s"
        )


def test_jax_own_checks_name_the_users_function():
    # An output said to be replicated that varies: JAX's check under `check_vma=True`
    # applies, and (under `jit` too) it names the user's function, not eqxshard's wrapper.
    mesh = make_mesh("explicit", shape=(2, 4), names=("x", "y"))

    def varying_output(a):
        return a

    kw: dict[str, Any] = dict(mesh=mesh, in_specs=P("x"), out_specs=P())
    x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
    for wrap in (jax.shard_map, filter_shard_map):
        with pytest.raises(ValueError, match="function 'varying_output'.*require replication"):
            jax.jit(wrap(varying_output, **kw))(x)
