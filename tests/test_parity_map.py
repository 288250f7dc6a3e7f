"""`filter_map` against `eqx.filter_vmap`: the cases of Equinox's `tests/test_vmap.py` and
every `in_axes`/`out_axes` form, at batch sizes that do and do not divide the mapped axis.
Values, shapes, dtypes, statics and (for arrays) output shardings must all agree."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqxshard import filter_map


def _batch_sizes(n):
    return [*sorted({b for b in (1, 3, n - 1, n, n + 1) if b >= 1}), None]


def _assert_same(out, ref, exact=True):
    assert jtu.tree_structure(out) == jtu.tree_structure(ref)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(ref), strict=True):
        if not eqx.is_array(b):
            assert a is b or a == b
            continue
        assert eqx.is_array(a) and a.shape == b.shape and a.dtype == b.dtype
        if isinstance(b, jax.Array) and b.ndim:
            assert a.sharding.is_equivalent_to(b.sharding, b.ndim), (a.sharding, b.sharding)
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _check(fun, args, n, exact=True, jit=True, sizes=None, **kwargs):
    """`filter_map(fun, **kwargs)` equals `eqx.filter_vmap(fun, **kwargs)` at every size
    (compiled: under `eqx.filter_jit` unless `jit=False`, which is slower)."""
    ref = eqx.filter_vmap(fun, **kwargs)(*args)
    for batch_size in _batch_sizes(n) if sizes is None else sizes:
        mapped = filter_map(fun, batch_size=batch_size, **kwargs)
        if jit:
            mapped = eqx.filter_jit(mapped)
        _assert_same(mapped(*args), ref, exact)
    return ref


def _zero_if_inexact_array_else_none(x):
    return 0 if eqx.is_inexact_array(x) else None


# ---- Equinox's `tests/test_vmap.py` ---------------------------------------------------


def test_args():
    def f(a, b, c, d):
        return a + b[0]["a"] + c + d

    args = (jnp.arange(1.0, 8.0), [{"a": jnp.array([2])}], jnp.arange(7), 4)
    in_axes = (_zero_if_inexact_array_else_none, [{"a": None}], 0, eqx.if_array(0))
    _check(f, args, 7, in_axes=in_axes)


def test_default_callable_in_axes():
    _check(
        lambda a, b: a + b,
        (jnp.array(3), jnp.arange(7.0)),
        7,
        in_axes=_zero_if_inexact_array_else_none,
    )


@pytest.mark.parametrize(
    "in_axes,out_axes,args",
    [
        (eqx.if_array(0), None, (1,)),
        (None, None, (jnp.array([3, 4]),)),
        (eqx.if_array(0), 0, (1,)),
        (None, 0, (jnp.array([3, 4]),)),
        (None, _zero_if_inexact_array_else_none, (1,)),
    ],
)
def test_axis_size_without_mapped_inputs(in_axes, out_axes, args):
    _check(lambda x: x, args, 5, in_axes=in_axes, out_axes=out_axes, axis_size=5)


def test_ensemble():
    keys = jax.random.split(jax.random.key(0), 7)
    models = eqx.filter_vmap(lambda k: eqx.nn.MLP(5, 4, 3, 2, key=k))(keys)
    xs = jax.random.normal(jax.random.key(1), (7, 5))
    _check(lambda m, x: m(x), (models, xs), 7, exact=False)
    # The broadcast input: one size with a remainder (3 of 7) and the unchunked one; the
    # chunk edges (1, n - 1, n, n + 1) are the first check's, the same code for any in_axes.
    both = (eqx.if_array(0), None)
    _check(lambda m, x: m(x), (models, xs[0]), 7, exact=False, sizes=(3, None), in_axes=both)


@pytest.mark.parametrize("call", [False, True])
def test_methods(call):
    class M(eqx.Module):
        increment: int | jax.Array

        def __call__(self, x):
            return x + self.increment

        def method(self, x):
            return x + self.increment

    m = M(5)
    # Eagerly: `eqx.filter_jit` warns on a wrapper whose `__wrapped__` is a Module.
    _check(m if call else m.method, (jnp.arange(7.0),), 7, jit=False)


def test_named_reduction_in_one_chunk():
    def f(x):
        return jax.lax.psum(x + 1, axis_name="device") * jax.lax.axis_index("device")

    x = jnp.arange(7.0)
    ref = eqx.filter_vmap(f, axis_name="device")(x)
    for batch_size in (7, 8, 100):
        _assert_same(filter_map(f, batch_size=batch_size, axis_name="device")(x), ref)
        out = jax.jit(filter_map(f, batch_size=batch_size, axis_name="device"))(x)
        _assert_same(out, ref)
    for batch_size in (None, 1, 3, 6):  # in chunks: refused, never a per-chunk psum
        with pytest.raises(ValueError, match="uses collectives over the mapped axis"):
            filter_map(f, batch_size=batch_size, axis_name="device")(x)


def test_axis_name_without_collectives_in_chunks():
    # A named axis that `fun` reduces over only in a nested vmap of its own is fine.
    def f(x):
        inner = jax.vmap(lambda y: jax.lax.psum(y, "inner"), axis_name="inner")(x)
        return inner * 2

    _check(f, (jnp.arange(21.0).reshape(7, 3),), 7, axis_name="rows")


def test_map_non_jax():
    model = eqx.nn.MLP(2, 2, 2, 2, activation=jax.nn.relu, key=jax.random.key(42))
    out = _check(lambda x: x, (model,), 2)
    assert out.activation is jax.nn.relu


def test_keyword_in_axes():
    x = jax.random.normal(jax.random.key(0), (3, 4))
    y = jax.random.normal(jax.random.key(1), (1, 3))
    out = _check(lambda x, y: x + y, (x, y), 3, in_axes=dict(y=1))
    np.testing.assert_allclose(out, x + y.T)


def test_keyword_default():
    x = jnp.arange(12.0).reshape(3, 4)
    _check(lambda x, y=1: x + y, (x,), 3, in_axes=dict(x=0))
    with pytest.raises(ValueError):
        eqx.filter_vmap(lambda x, y=1: x, in_axes=dict(y=0))(x)
    with pytest.raises(ValueError, match=r"`filter_map\(in_axes=\.\.\.\)` names \['y'\]"):
        filter_map(lambda x, y=1: x, in_axes=dict(y=0))(x)


# ---- every `in_axes` / `out_axes` form -----------------------------------------------


def _f(x, y, label):
    """Exact ops only (no fused multiply-add), a scalar, a constant and a static output."""
    z = x * 2 + y.sum()
    return {"z": z, "first": z[0], "const": jnp.float32(3.0)}, label


_ROWS, _COLS = "rows first", "rows last"
IN_AXES_FORMS = {  # in_axes, layout of x, layout of y
    "ints": ((0, 0, None), _ROWS, _ROWS),
    "pos-neg": ((1, -1, None), _COLS, _COLS),
    "neg-pos": ((-2, 1, None), _ROWS, _COLS),
    "if_array0": (eqx.if_array(0), _ROWS, _ROWS),
    "if_array-1": (eqx.if_array(-1), _COLS, _COLS),
    "dict": (dict(x=1), _COLS, _ROWS),
    "dict-all": (dict(x=-1, y=0, label=None), _COLS, _ROWS),
    "callable": ((lambda leaf: 1 if eqx.is_array(leaf) else None), _COLS, _COLS),
}


def _layout(rows, n, width, dtype):
    a = jnp.arange(n * width, dtype=dtype).reshape(n, width)
    return a if rows == _ROWS else a.T


@pytest.mark.parametrize("n", [0, 7])
@pytest.mark.parametrize("form", sorted(IN_AXES_FORMS))
def test_in_axes_forms(n, form):
    in_axes, x_rows, y_rows = IN_AXES_FORMS[form]
    x = _layout(x_rows, n, 4, jnp.float32)
    y = _layout(y_rows, n, 3, jnp.int32)
    out_axes = ({"z": 0, "first": 0, "const": None}, None)
    _check(_f, (x, y, "label"), n, in_axes=in_axes, out_axes=out_axes)


def test_in_axes_prefix_tree():
    # `in_axes` a prefix tree reaching inside an argument: one axis per dict entry.
    tree = {"a": jnp.arange(21.0).reshape(7, 3), "b": jnp.arange(21.0).reshape(3, 7)}
    _check(
        lambda t, s: t["a"] + t["b"].sum() * s,
        (tree, jnp.float32(2.0)),
        7,
        in_axes=({"a": 0, "b": 1}, None),
    )


@pytest.mark.parametrize(
    "out_axes",
    [
        0,
        1,
        -1,
        eqx.if_array(1),
        ({"z": 1, "first": -1, "const": None}, None),
        ({"z": -2, "first": 0, "const": 0}, None),
        (eqx.if_array(0), None),
    ],
    ids=["0", "1", "-1", "if_array1", "prefix", "prefix-neg", "prefix-callable"],
)
def test_out_axes_forms(out_axes):
    n = 7
    x = jnp.arange(n * 4.0).reshape(n, 4)
    y = jnp.arange(n * 3, dtype=jnp.int32).reshape(n, 3)
    fun = _f
    if out_axes in (0, 1, -1) or out_axes == eqx.if_array(1):

        def mapped_only(x, y, label):  # every output mapped: arrays only, all varying with rows
            out, _ = _f(x, y, label)
            return {**out, "first": out["z"][:2], "const": out["const"] + y[:1]}

        fun = mapped_only

    _check(fun, (x, y, "label"), n, in_axes=(0, 0, None), out_axes=out_axes)


# ---- modules with static leaves --------------------------------------------------------


class _Scaled(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    name: str = eqx.field(static=True)
    activation: Callable = jax.nn.relu
    power: int = 2

    def __call__(self, x):
        return self.activation(self.weight * x + self.bias) ** self.power, self.name


def test_module_with_static_leaves():
    module = _Scaled(jnp.arange(7.0) - 3, jnp.ones(7), "scaled")
    x = jnp.arange(7.0) / 4
    _check(lambda m, x: m(x), (module, x), 7, exact=False, jit=False)  # eagerly, once
    _check(lambda m, x: m(x), (module, x[0]), 7, exact=False, in_axes=(eqx.if_array(0), None))
    # The module as the output: its statics come back as the same objects.
    out = _check(lambda m: m, (module,), 7)
    assert out.activation is jax.nn.relu and out.name == "scaled"


def test_under_jit():
    module = _Scaled(jnp.arange(7.0) - 3, jnp.ones(7), "scaled")
    _check(lambda m, x: m(x), (module, jnp.arange(7.0)), 7, exact=False, jit=True)


# ---- sharded inputs: the same output shardings as `filter_vmap` -------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("sharded_dim", [0, 1])
def test_sharded_inputs(axis_type, sharded_dim):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    n = 16
    x = jnp.arange(n * 8.0).reshape(n, 8)
    spec = P("data") if sharded_dim == 0 else P(None, "data")
    x = jax.device_put(x, NamedSharding(mesh, spec))
    w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P()))

    def f(w, x):
        return {"y": x * w + 1, "s": jnp.sum(x * 2)}

    sizes = (8, 16, 24) if sharded_dim == 0 else (1, 3, 15, 16, 17)
    ref = eqx.filter_vmap(f, in_axes=(None, 0))(w, x)
    for batch_size in sizes:
        _assert_same(filter_map(f, batch_size=batch_size, in_axes=(None, 0))(w, x), ref)


# ---- committed inputs: JAX refuses arrays committed to different devices ----------------


def test_inputs_committed_to_different_devices_are_refused_naming_each():
    # Refused as `eqx.filter_vmap` refuses them (JAX: "incompatible devices", naming an
    # argument of an inner `scan`), here before any work, with every committed leaf named.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
    y = jax.device_put(jnp.arange(16.0), jax.devices()[3])

    def f(x, y):
        return x * y

    with pytest.raises(ValueError, match="incompatible devices"):
        eqx.filter_vmap(f)(x, y)
    for batch_size in (8, "auto"):
        budget = 2**20 if batch_size == "auto" else None
        with pytest.raises(
            ValueError,
            match=r"`filter_map` got arrays committed to different devices.*\n"
            r"  args\.0  committed to 8 cpu devices \[0, 1, 2, 3, 4, 5, 6, 7\]\n"
            r"  args\.1  committed to cpu device 3\n"
            r"Put them on the same devices first",
        ):
            filter_map(f, batch_size=batch_size, memory_budget=budget)(x, y)
    # Committed to one and the same device: computed there, as by `eqx.filter_vmap`.
    z = jax.device_put(jnp.arange(16.0) + 1, jax.devices()[3])
    _assert_same(filter_map(f, batch_size=4)(z, y), eqx.filter_vmap(f)(z, y))
