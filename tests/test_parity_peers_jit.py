"""`filter_jit` against `eqx.filter_jit`, and `filter_shard` against `eqx.filter_shard`, on
cases of Equinox's test material that `test_jit.py` and `test_parity_shard.py` do not run:
`lower(...)` with keyword arguments, `compile(compiler_options=...)`, keyword-only and
`**kwargs` parameters, PRNG keys, weak types, NumPy and float0 leaves (the cotangents of
integers), dtypes, and wrapped callables (`jax.grad`, `jax.vmap`, partials, a jitted
function). Values, structure, dtypes, weak types and shardings are compared."""

from __future__ import annotations

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard import _compat

Pair = collections.namedtuple("Pair", "a b")
JITS = [eqxshard.filter_jit, eqx.filter_jit]


def _same(out, ref):
    assert jtu.tree_structure(out) == jtu.tree_structure(ref)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(ref), strict=True):
        if not isinstance(b, jax.Array):
            assert type(a) is type(b)
            if isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape
            else:
                assert a == b
            continue
        weak = jax.typeof(a).weak_type, jax.typeof(b).weak_type
        assert (a.shape, a.dtype, weak[0]) == (b.shape, b.dtype, weak[1]), (a, b)
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def _both(fun, *args, **kwargs):
    ours, theirs = (jit(fun)(*args, **kwargs) for jit in JITS)
    _same(ours, theirs)
    return ours


@pytest.mark.parametrize("donate", ["all", "all-except-first", "none"])
def test_lower_with_keyword_arguments(donate):
    # Equinox issue 625: `lower(...)` with `**kwargs`, then the compiled call with them.
    def f(x, y, **kwargs):
        return 2 * x + y + kwargs["test"]

    outs = []
    for jit in JITS:
        lowered = jit(f, donate=donate).lower(jnp.array(3), 4, test=123)
        assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()
        outs.append(lowered.compile()(jnp.array(3), 4, test=123))
    _same(*outs)


def test_compiler_options():
    outs = []
    for jit in JITS:
        lowered = jit(lambda x, y: 2 * x + y).lower(jnp.array(3), 4)
        compiled = lowered.compile(compiler_options={"xla_gpu_autotune_level": "0"})
        outs.append(compiled(jnp.array(3), 4))
        with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
            lowered.compile(compiler_options={"an option that does not make sense": "bad value"})
    _same(*outs)


def test_parameters_of_every_kind():
    x = jnp.arange(4.0)
    _both(lambda a, b=2.0: a * b, x)
    _both(lambda a, *, b: a * b, x, b=3.0)
    _both(lambda a, *, b: a * b, x, b=x)
    _both(lambda a, **kw: a * kw["z"], x, z=x)
    _both(lambda *a: a[0] + a[1] + a[2], x, x, x)
    _both(lambda a, s, n: a * n if s == "x" else -a, x, "x", 3)
    _both(lambda: 1)
    _both(lambda a: None, x)


def test_leaves_of_every_kind():
    x = jnp.arange(4.0)
    _both(lambda k: jax.random.split(k), jax.random.key(0))
    _both(lambda k: jax.random.split(k), jax.random.PRNGKey(0))
    _both(lambda s: s * 2.0, jnp.asarray(1.0))  # weak in, weak out
    _both(lambda s: s * 2.0, 1.0)  # a Python float is static: a weak constant out
    _both(lambda a: (a * 2, a), np.arange(4.0))  # NumPy in (float64 made float32)
    _both(lambda a: a, np.float32(2.0))
    _both(lambda t: Pair(t.a * 2, t.b), Pair(x, "static"))
    _both(lambda a, b: (a, b), x, None)
    _both(lambda b: b.sum(0), jnp.zeros((0, 3)))
    for dtype in (jnp.bool_, jnp.uint8, jnp.int16, jnp.bfloat16, jnp.float16, jnp.complex64):
        _both(lambda a: (a, a[::-1]), jnp.ones(3, dtype))


def test_float0_leaves_pass_through_as_in_equinox():
    # The cotangent of an integer (`jax.grad(..., allow_int=True)`) is a float0 NumPy
    # array. `filter_jit` raised an AttributeError waiting on it ("block_until_ready").
    grads = jax.grad(lambda t: t["w"].sum() * 2.0, allow_int=True)(
        {"w": jnp.ones(3), "n": jnp.asarray(3)}
    )
    assert grads["n"].dtype == jax.dtypes.float0
    _both(lambda g: g, grads)
    _both(lambda g: g["n"], grads)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_filter_shard_leaves_float0_alone_as_equinox(jit):
    # `filter_shard` refused float0 outside `jit` ("dtype JAX has no arrays of") and let
    # it through inside; `eqx.filter_shard` lets it through in both.
    mesh = make_mesh("auto", shape=(8,), names=("x",))
    sharding = NamedSharding(mesh, P("x"))
    grads = {"n": np.zeros((8,), dtype=jax.dtypes.float0), "w": jnp.ones(8)}
    outs = []
    for shard in (eqxshard.filter_shard, eqx.filter_shard):
        fun = lambda t, shard=shard: shard(t, sharding)  # noqa: E731
        outs.append((eqx.filter_jit(fun) if jit else fun)(grads))
    ours, theirs = outs
    assert ours["n"].dtype == theirs["n"].dtype == jax.dtypes.float0
    assert ours["n"].shape == theirs["n"].shape
    assert ours["w"].sharding.is_equivalent_to(theirs["w"].sharding, 1)
    np.testing.assert_array_equal(ours["w"], theirs["w"])


def test_wrapped_callables():
    x = jnp.arange(4.0)
    _both(jax.grad(lambda a: jnp.sum(a**2)), x)
    _both(jax.vmap(lambda a: a + 1), x)
    _both(jtu.Partial(lambda a, b: a * b, x), x)
    _both(eqx.Partial(lambda a, b: a * b, x), x)
    _both(eqx.filter_jit(lambda a: a + 1), x)
    _both(eqxshard.filter_jit(lambda a: a + 1), x)
    _both(lambda a: eqx.nn.Linear(2, 2, key=jax.random.key(0)), x)  # a Module out


def test_filter_shard_same_as_equinox_under_transforms():
    # `vmap`, `grad`, `scan`, `eval_shape` and `jit` around the placement; NumPy, weak and
    # PRNG-key leaves; a split over two mesh axes at once.
    mesh = make_mesh("auto", shape=(2, 4), names=("x", "y"))
    both = NamedSharding(mesh, P("x", "y"))
    rows, x = NamedSharding(mesh, P("y")), jnp.arange(32.0).reshape(8, 4)
    cases = [
        lambda shard: jax.vmap(lambda r: shard(r, rows))(x),
        lambda shard: jax.jit(jax.vmap(lambda r: shard(r, rows)))(x),
        lambda shard: jax.grad(lambda a: jnp.sum(shard(a, both) ** 2))(x),
        lambda shard: jax.jit(jax.grad(lambda a: jnp.sum(shard(a, both) ** 2)))(x),
        lambda shard: jax.lax.scan(lambda c, r: (c, shard(r, rows)), 0, x)[1],
        lambda shard: shard(x, NamedSharding(mesh, P(("x", "y")))),
        lambda shard: shard(np.arange(32.0).reshape(8, 4), both),
        lambda shard: eqx.filter_jit(lambda a: shard(a, both))(np.arange(32.0).reshape(8, 4)),
        lambda shard: jax.jit(lambda a: shard(a * 2.0, NamedSharding(mesh, P())))(1.0),
        lambda shard: jax.jit(lambda k: shard(k, NamedSharding(mesh, P("x"))))(
            jax.random.split(jax.random.key(0), 8)
        ),
    ]
    for case in cases:
        _same(case(eqxshard.filter_shard), case(eqx.filter_shard))
    shard_fns = (eqxshard.filter_shard, eqx.filter_shard)
    shapes = [jax.eval_shape(lambda a, s=s: s(a, both), x) for s in shard_fns]
    assert shapes[0].shape == shapes[1].shape and shapes[0].dtype == shapes[1].dtype


@pytest.mark.skipif(
    not _compat.memory_kinds_in_jit(), reason="this JAX cannot move memory kinds inside jit on CPU"
)
def test_memory_kind_inside_jit_deliberately_differs():
    # Inside `jit`, `eqx.filter_shard`'s `with_sharding_constraint` drops a memory kind
    # (the result lands in device memory); eqxshard honours it, as it does outside `jit`.
    mesh = make_mesh("auto", shape=(2, 4), names=("x", "y"))
    pinned = NamedSharding(mesh, P("x", "y"), memory_kind="pinned_host")
    x = jnp.arange(32.0).reshape(8, 4)
    ours = jax.jit(lambda a: eqxshard.filter_shard(a, pinned))(x)
    theirs = jax.jit(lambda a: eqx.filter_shard(a, pinned))(x)
    assert theirs.sharding.memory_kind == "device"
    assert ours.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(ours, theirs)
