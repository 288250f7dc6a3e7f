"""`filter_map` against `eqx.filter_vmap` on the cases of Equinox's and JAX's own test
material that `test_parity_map.py` does not run: outputs of three or more dims with every
`out_axes`, PRNG keys, every dtype family, weak types, `None` leaves, namedtuples, NumPy
inputs, Python scalars broadcast by an int `out_axes`, and the wrapper itself a PyTree.
Each case compares values, tree structure, dtypes, weak types and output shardings."""

from __future__ import annotations

import collections
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

from eqxshard import filter_map

Pair = collections.namedtuple("Pair", "a b")


def _same(out, ref):
    assert jtu.tree_structure(out) == jtu.tree_structure(ref)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(ref), strict=True):
        if not eqx.is_array(b):
            assert a is b or (type(a) is type(b) and a == b), (a, b)
            continue
        assert isinstance(a, jax.Array) and isinstance(b, jax.Array)
        weak = jax.typeof(a).weak_type, jax.typeof(b).weak_type
        assert (a.shape, a.dtype, weak[0]) == (b.shape, b.dtype, weak[1]), (a, b)
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def _check(fun, args, **kwargs):
    """Eagerly at one row per chunk, and under `jax.jit` in chunks of 3 (a remainder)."""
    ref = eqx.filter_vmap(fun, **kwargs)(*args)
    _same(filter_map(fun, **kwargs)(*args), ref)
    _same(eqx.filter_jit(filter_map(fun, batch_size=3, **kwargs))(*args), ref)
    return ref


@pytest.mark.parametrize("out_axes", [0, 1, 2, -1, -2, -3])
def test_out_axes_of_a_three_dim_output(out_axes):
    # Equinox issue 900: the mapped axis moved into outputs of three dims.
    _check(lambda x: x * 2, (jnp.arange(7 * 3 * 4).reshape(7, 3, 4),), out_axes=out_axes)


def test_prng_keys_in_and_out():
    keys = jax.random.split(jax.random.key(0), 7)
    _check(lambda k: jax.random.normal(k, (2,)), (keys,))
    _check(lambda k: jax.random.split(k, 3), (keys,))  # typed keys out
    _check(lambda k: jax.random.uniform(k), (jax.random.split(jax.random.PRNGKey(1), 7),))


@pytest.mark.parametrize(
    "dtype", [jnp.bool_, jnp.int8, jnp.uint32, jnp.float16, jnp.bfloat16, jnp.complex64]
)
def test_dtypes(dtype):
    x = (jnp.arange(7 * 2) % 3).reshape(7, 2).astype(dtype)
    _check(lambda x: (x, x[::-1]), (x,))


def test_weak_types():
    # A weak scalar broadcast against a mapped int: a weak output, as `jax.vmap` gives.
    _check(lambda i, s: i * 0 + s, (jnp.arange(7), jnp.asarray(2.0)), in_axes=(0, None))
    _check(lambda x: x * 2.0, (jnp.asarray([1.0, 2.0, 3.0, 4.0]),))


def test_none_leaves_namedtuples_and_numpy_inputs():
    x = jnp.arange(7.0)
    _check(lambda t: {"a": t["a"] * 2, "none": None}, ({"a": x, "b": None},))
    _check(lambda t: Pair(t.a + 1, t.b), (Pair(x, "static"),))
    _check(lambda t: Pair(t.a * 2, jnp.ones(2)), (Pair(x, x),), out_axes=Pair(0, None))
    _check(lambda x: x * 2, (np.arange(7.0, dtype=np.float32),))
    _check(lambda x: x.sum(), (jnp.zeros((7, 0)),))  # zero-size rows


def test_outputs_without_arrays():
    _check(lambda x: None, (jnp.arange(7.0),))
    _check(lambda x: (), (jnp.arange(7.0),))
    _check(lambda x: (x, "tag", 3), (jnp.arange(7.0),))  # statics under the default


@pytest.mark.parametrize("scalar", [3, 2.5, True, 1j, np.float32(2.0)], ids=repr)
def test_python_scalar_output_with_an_int_out_axes_is_broadcast(scalar):
    # `eqx.filter_vmap` hands it to `jax.vmap`, which broadcasts it (weakly typed for Python
    # scalars); `filter_map` refused it before ("maps outputs that are not arrays").
    ref = _check(lambda x: (x, scalar), (jnp.arange(7.0),), out_axes=0)
    assert ref[1].shape == (7,)


def test_a_string_output_with_an_int_out_axes_is_refused_as_by_equinox():
    with pytest.raises(TypeError, match="not a valid JAX type"):
        eqx.filter_vmap(lambda x: (x, "s"), out_axes=0)(jnp.arange(7.0))
    with pytest.raises(ValueError, match=r"not arrays or lack that axis:\n  out\.1  str"):
        filter_map(lambda x: (x, "s"), out_axes=0)(jnp.arange(7.0))


def test_a_scalar_mapped_names_the_leaf():
    # Equinox's `test_default`: mapping a 0-d array raises (in eqxshard it was a bare
    # "len() of unsized object" TypeError from inside the size check).
    in_axes = lambda x: 0 if eqx.is_inexact_array(x) else None  # noqa: E731
    args = (jnp.array(3.0), jnp.array([3.0]))
    with pytest.raises(ValueError, match="rank should be at least 1"):
        eqx.filter_vmap(lambda a, b: a + b, in_axes=in_axes)(*args)
    with pytest.raises(ValueError, match=r"axis these leaves do not have:\n  args\.0  shape \(\)"):
        filter_map(lambda a, b: a + b, in_axes=in_axes)(*args)


def test_the_wrapper_is_a_pytree_as_equinox():
    # `eqx.filter_vmap(module)` is a Module whose leaves are the module's arrays: stored in
    # another Module it is trained, and `eqx.filter_jit` traces its arrays. `filter_map`
    # returned a plain function, which Equinox warns about (and whose arrays are constants).
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))

    class Outer(eqx.Module):
        mapped: object

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Possibly assigning a JAX-transformed callable"
        outer = Outer(filter_map(linear, batch_size=2))
    ref = Outer(eqx.filter_vmap(linear))
    assert len(jtu.tree_leaves(eqx.filter(outer, eqx.is_array))) == 2
    xs = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)

    def loss(m, xs):
        return jnp.sum(m.mapped(xs) ** 2)

    ours, theirs = eqx.filter_grad(loss)(outer, xs), eqx.filter_grad(loss)(ref, xs)
    for a, b in zip(jtu.tree_leaves(ours), jtu.tree_leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _same(eqx.filter_jit(filter_map(linear))(xs), eqx.filter_vmap(linear)(xs))


def test_as_a_method_decorator():
    class Scale(eqx.Module):
        w: jax.Array

        @filter_map(in_axes=(None, 0), batch_size=2)
        def ours(self, x):
            return self.w * x

        @eqx.filter_vmap(in_axes=(None, 0))
        def theirs(self, x):
            return self.w * x

    m, xs = Scale(jnp.asarray(3.0)), jnp.arange(5.0)
    _same(m.ours(xs), m.theirs(xs))
    _same(eqx.filter_jit(lambda m, xs: m.ours(xs))(m, xs), m.theirs(xs))
