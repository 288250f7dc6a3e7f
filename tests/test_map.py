import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from eqxshard import filter_map

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")


def _batch_sizes(n):
    return sorted({b for b in (1, 3, n - 1, n, n + 1) if b >= 1})


CASES = [(n, b) for n in (0, 1, 7, 64) for b in _batch_sizes(n)]


def _assert_same(out, ref, exact=True):
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        if eqx.is_array(b):
            assert a.shape == b.shape and a.dtype == b.dtype
            if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            if exact:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            assert a is b


ACTIVATION = jnp.tanh  # a non-array leaf: must come back as the same object


def _elementwise(params, x, key, label):
    """Several positional args, broadcast arrays and non-arrays, keys, mixed outputs."""
    noise = (jax.random.bits(key, x.shape) % 8).astype(x.dtype)  # correctly rounded ops only,
    y = (x + noise + params["shift"]) * params["scale"]  # (no a*b+c: XLA may fuse it to an FMA)
    new_key = jax.random.fold_in(key, 1)
    return {"y": y, "peak": jnp.max(y), "key": new_key}, label, ACTIVATION


def _inputs(n):
    params = {"scale": jnp.float32(1.5), "shift": jnp.arange(3.0)}
    x = jnp.arange(n * 3, dtype=jnp.float32).reshape(n, 3) / 7
    keys = jax.random.split(jax.random.key(0), n)
    return params, x, keys, "label"


IN_AXES = (None, 0, 0, None)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("n,batch_size", CASES)
def test_equals_filter_vmap(n, batch_size, jit):
    args = _inputs(n)
    ref = eqx.filter_vmap(_elementwise, in_axes=IN_AXES)(*args)
    mapped = filter_map(_elementwise, batch_size=batch_size, in_axes=IN_AXES)
    out = (eqx.filter_jit(mapped) if jit else mapped)(*args)
    _assert_same(out, ref)
    assert out[1] is args[3]


def _mlp_apply(model, x):
    return model(x)


@pytest.mark.parametrize("n,batch_size", [(0, 3), (7, 3), (7, 8), (64, 3), (64, 63)])
def test_model_matches_filter_vmap(n, batch_size):
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (n, 3))
    ref = eqx.filter_vmap(_mlp_apply, in_axes=(None, 0))(model, x)
    out = filter_map(_mlp_apply, batch_size=batch_size, in_axes=(None, 0))(model, x)
    _assert_same(out, ref, exact=False)


def test_batch_size_none_is_one_row_at_a_time():
    seen = []

    def f(x):
        seen.append(x.shape)
        return x * 2

    x = jnp.arange(10.0)
    jaxpr = jax.make_jaxpr(filter_map(f))(x)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 10
    np.testing.assert_array_equal(filter_map(f)(x), x * 2)


def test_scan_length_and_remainder():
    jaxpr = jax.make_jaxpr(filter_map(jnp.sin, batch_size=3))(jnp.arange(7.0))
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 2


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_in_axes_out_axes_forms(jit):
    def f(a, b, c):
        return {"u": a * b, "v": c}, jnp.sum(a)

    a = jnp.arange(12.0).reshape(3, 4)  # mapped along axis 1 (size 4)
    b = jnp.arange(4.0)
    c = jnp.ones(5)
    kwargs: dict[str, Any] = dict(
        in_axes=(1, -1, None), out_axes=({"u": -1, "v": None}, eqx.if_array(0))
    )
    ref = eqx.filter_vmap(f, **kwargs)(a, b, c)
    mapped = filter_map(f, batch_size=3, **kwargs)
    _assert_same((jax.jit(mapped) if jit else mapped)(a, b, c), ref)


def test_decorator_forms():
    @filter_map
    def f(x):
        return x + 1

    @filter_map(batch_size=2)
    def g(x):
        return x + 1

    x = jnp.arange(5.0)
    np.testing.assert_array_equal(f(x), x + 1)
    np.testing.assert_array_equal(g(x), x + 1)
    assert g.__name__ == "g"


def test_nothing_mapped_is_filter_vmap():
    out = filter_map(lambda x: (x, "s"), in_axes=None, out_axes=None)(jnp.ones(3))
    assert out[1] == "s"
    with pytest.raises(ValueError, match="Cannot resolve batch dimension"):
        filter_map(lambda x: x, in_axes=None)(jnp.ones(3))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 20), batch_size=st.integers(1, 25), axis=st.integers(-2, 1))
def test_random_sizes_and_axes(n, batch_size, axis):
    x = jnp.arange(2 * n, dtype=jnp.float32).reshape((2, n) if axis in (1, -1) else (n, 2))
    f = lambda x: jnp.cos(x) * x.sum()  # noqa: E731
    ref = jax.vmap(f, in_axes=axis, out_axes=axis)(x)
    out = filter_map(f, batch_size=batch_size, in_axes=axis, out_axes=axis)(x)
    np.testing.assert_array_equal(out, ref)


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1.5, "3", True, (2,)])
def test_batch_size_type_error(bad):
    with pytest.raises(TypeError, match=r"batch_size=\.\.\.\)` must be `None` or a positive int"):
        filter_map(jnp.sin, batch_size=bad)


@pytest.mark.parametrize("bad", [0, -2])
def test_batch_size_value_error(bad):
    with pytest.raises(ValueError, match=rf"must be >= 1, got {bad}"):
        filter_map(jnp.sin, batch_size=bad)


def test_different_sizes_lists_every_mapped_leaf():
    args = ({"a": jnp.ones(3), "b": jnp.ones((4, 2))}, jnp.ones(3))
    with pytest.raises(ValueError, match="same size") as info:
        filter_map(lambda d, y: y, batch_size=2)(*args)
    msg = str(info.value)
    for path in ("args.0.a", "args.0.b", "args.1"):
        assert path in msg
    assert "size 4" in msg and "size 3" in msg


def test_axis_out_of_range_lists_leaves():
    with pytest.raises(ValueError, match=r"axis these leaves do not have:\n  args\.0"):
        filter_map(lambda x, y: x, in_axes=(2, 0))(jnp.ones((3, 2)), jnp.ones(3))


def test_mapped_non_array_is_type_error():
    with pytest.raises(TypeError, match=r"non-array leaves:\n  args\.1\s+str"):
        filter_map(lambda x, s: x, in_axes=(0, 0))(jnp.ones(3), "text")


def test_in_axes_not_a_prefix():
    with pytest.raises(ValueError, match=r"`filter_map\(in_axes=...\)` must be a prefix"):
        filter_map(lambda x, y: x, in_axes=(0, 0, 0))(jnp.ones(3), jnp.ones(3))


def test_in_axes_bad_spec_type():
    with pytest.raises(TypeError, match="must hold only `None`, ints and callables"):
        filter_map(lambda x: x, in_axes="0")(jnp.ones(3))


def test_out_axes_on_non_array():
    with pytest.raises(ValueError, match=r"not arrays or lack that axis:\n  out\.1"):
        filter_map(lambda x: (x, "s"), out_axes=0)(jnp.ones(3))


def test_out_axes_out_of_range():
    with pytest.raises(ValueError, match=r"lack that axis:\n  out  shape \(2,\)  out_axes 3"):
        filter_map(lambda x: x, out_axes=3)(jnp.ones((4, 2)))


def test_keyword_arguments_rejected():
    with pytest.raises(TypeError, match="positional arguments only.*\\['y'\\]"):
        filter_map(lambda x, y: x)(jnp.ones(3), y=jnp.ones(3))


def test_fun_not_callable():
    with pytest.raises(TypeError, match="must be callable"):
        filter_map(3)  # type: ignore[arg-type]


def test_statics_differ_between_chunks():
    f = lambda x: (x, object())  # noqa: E731
    out = filter_map(f, batch_size=3)(jnp.ones(6))  # one trace: fine
    assert type(out[1]) is object
    with pytest.raises(ValueError, match="non-array outputs .* differed"):
        filter_map(f, batch_size=3)(jnp.ones(7))


# ---- memory ---------------------------------------------------------------------------


def _layers(a):
    for _ in range(3):
        a = a @ (a - a.mean())
    return a


def _temp_bytes(f, *args):
    memory = jax.jit(f).lower(*args).compile().memory_analysis()
    assert memory is not None  # the CPU backend reports it
    return memory.temp_size_in_bytes


XS = jnp.ones((60, 16, 16))


@pytest.mark.parametrize("batch_size", [4, 7])
def test_forward_temporaries_at_most_lax_map(batch_size):
    ours = _temp_bytes(filter_map(_layers, batch_size=batch_size), XS)
    lax = _temp_bytes(lambda x: jax.lax.map(_layers, x, batch_size=batch_size), XS)
    assert ours <= lax
    if batch_size == 4:  # a sixth of the rows at once
        assert ours * 4 < _temp_bytes(jax.vmap(_layers), XS)


def test_remat_bounds_backward_temporaries():
    def grad_of(f):
        return jax.grad(lambda x: jnp.sum(f(x)))

    plain = _temp_bytes(grad_of(filter_map(_layers, batch_size=4)), XS)
    remat = _temp_bytes(grad_of(filter_map(_layers, batch_size=4, remat=True)), XS)
    full = _temp_bytes(grad_of(jax.vmap(_layers)), XS)
    assert remat * 4 < plain
    assert remat * 10 <= full


# ---- differentiation ------------------------------------------------------------------


def _scaled(w, x):
    return jnp.sin(w * x) * jnp.sum(x)


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("n,batch_size", [(7, 3), (2, 5)])
def test_derivatives_match_filter_vmap(n, batch_size, remat):
    w = jnp.linspace(0.5, 1.5, 4)
    x = jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4) / 10
    ref_f = eqx.filter_vmap(_scaled, in_axes=(None, 0))
    our_f = filter_map(_scaled, batch_size=batch_size, in_axes=(None, 0), remat=remat)

    def loss(f):
        return lambda w, x: jnp.sum(f(w, x) ** 2)

    def derivatives(f):  # every transform and argnums in one program: one compile, not six
        return jax.jit(
            lambda w, x: [
                transform(loss(f), argnums=argnums)(w, x)
                for transform in (jax.grad, jax.jacfwd, jax.jacrev)
                for argnums in (0, 1)
            ]
        )(w, x)

    for ours, ref in zip(derivatives(our_f), derivatives(ref_f), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    jac = jax.jacrev(lambda x: our_f(w, x))(x)
    np.testing.assert_allclose(jac, jax.jacrev(lambda x: ref_f(w, x))(x), rtol=1e-5, atol=1e-6)
    model = {"w": w, "act": jnp.tanh}
    g_ours = eqx.filter_grad(lambda m, x: jnp.sum(m["act"](our_f(m["w"], x))))(model, x)
    g_ref = eqx.filter_grad(lambda m, x: jnp.sum(m["act"](ref_f(m["w"], x))))(model, x)
    np.testing.assert_allclose(g_ours["w"], g_ref["w"], rtol=1e-5, atol=1e-6)
    assert g_ours["act"] is None


def test_under_outer_vmap():
    x = jnp.arange(30.0).reshape(3, 10)
    out = jax.vmap(filter_map(jnp.sin, batch_size=4))(x)
    np.testing.assert_array_equal(out, jnp.sin(x))


# ---- sharding -------------------------------------------------------------------------

MESHES = {
    "auto": ((8,), ("rows",), (AxisType.Auto,), P("rows")),
    "explicit": ((8,), ("rows",), (AxisType.Explicit,), P("rows")),
    "mixed": (
        (4, 2),
        ("rows", "cols"),
        (AxisType.Explicit, AxisType.Auto),
        P("rows", None, "cols"),
    ),
    "2d-explicit": ((4, 2), ("rows", "cols"), (AxisType.Explicit,) * 2, P("rows", None, "cols")),
}


def _local(w, x):  # nothing in here needs another device's data
    return jnp.tanh(x * w) + jnp.sum(x, axis=0)


@pytest.mark.parametrize("batch_size", [16, 24, None])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_sharded_rows_stay_local(mesh_name, batch_size):
    shape, names, types, spec = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=types)
    xs = jax.random.normal(jax.random.key(0), (56, 3, 4))  # 7 rows per shard: a remainder
    x = jax.device_put(xs, NamedSharding(mesh, spec))
    w = jax.device_put(jnp.float32(0.7), NamedSharding(mesh, P()))
    ref = jax.vmap(_local, in_axes=(None, 0))(w, xs)
    mapped = filter_map(_local, batch_size=batch_size, in_axes=(None, 0))
    jitted = jax.jit(mapped)
    hlo = jitted.lower(w, x).compile().as_text()
    assert hlo is not None
    assert not [c for c in COLLECTIVES if c in hlo]
    for out in (jitted(w, x), mapped(w, x)):
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
        assert isinstance(out.sharding, NamedSharding)
        assert out.sharding.spec[0] == spec[0]
        assert out.sharding.mesh.shape == mesh.shape


def test_lax_map_all_gathers_where_filter_map_does_not():
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.ones((64, 4)), NamedSharding(mesh, P("rows")))
    lax_hlo = jax.jit(lambda x: jax.lax.map(jnp.sin, x, batch_size=16)).lower(x).compile()
    ours = jax.jit(filter_map(jnp.sin, batch_size=16)).lower(x).compile()
    lax_text, our_text = lax_hlo.as_text(), ours.as_text()
    assert lax_text is not None and our_text is not None
    assert "all-gather" in lax_text
    assert "all-gather" not in our_text


def test_batch_size_not_multiple_of_shards_warns():
    mesh = jax.make_mesh((8,), ("rows",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("rows")))
    with pytest.warns(UserWarning, match=re.escape("split over 8 shards and 20 is not")):
        jaxpr = jax.make_jaxpr(filter_map(jnp.sin, batch_size=20))(x)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scans[0].params["length"] == 4  # 2 rows per shard per chunk
    with pytest.warns(UserWarning, match=re.escape("1 row(s) per shard (8 rows)")):
        out = filter_map(jnp.sin, batch_size=3)(x)
    np.testing.assert_array_equal(out, jnp.sin(x))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape", [(1,), (1, 2)])
def test_explicit_axes_of_one_shard(shape, jit):
    """Mapped rows on Explicit mesh axes of size 1 (any one-device Explicit mesh): one
    shard, so the plain chunked path runs; `lax.scan` must not see the axis on its chunks."""
    names = ("p", "q")[: len(shape)]
    mesh = jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(shape), devices=jax.devices()[:2]
    )
    spec = P(*names) if len(shape) == 2 else P("p")
    x = jax.device_put(jnp.arange(64.0 * 4).reshape(64, 4), NamedSharding(mesh, spec))
    fun = lambda v: v * 2 + v.sum()
    mapped = filter_map(fun, batch_size=16)
    out = (jax.jit(mapped) if jit else mapped)(x)
    want = eqx.filter_vmap(fun)(x)
    np.testing.assert_allclose(out, want)
    assert out.sharding.is_equivalent_to(want.sharding, out.ndim)


def test_committed_devices_past_eight_are_shortened():
    from types import SimpleNamespace

    from eqxshard._placement import committed

    class Sharding:  # what `_compat.device_assignment` reads
        _device_assignment = tuple(SimpleNamespace(id=i, platform="tpu") for i in range(16))

    text = committed._devices(Sharding())  # pyright: ignore[reportArgumentType]
    assert text == "committed to 16 tpu devices [0, 1, 2, 3, ..., 14, 15]"
