"""The chunked Jacobians (`batch_size` an int or `"auto"`, and `mesh=`) against
`eqx.filter_jac*`/`jax.jac*`: values, tree structure, dtypes and weak types, errors, and
one compilation per shapes for eager calls."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxshard

VERBS = {
    "fwd": (eqxshard.filter_jacfwd, eqx.filter_jacfwd),
    "rev": (eqxshard.filter_jacrev, eqx.filter_jacrev),
    "hessian": (eqxshard.filter_hessian, eqx.filter_hessian),
}
# The chunked paths: an int `batch_size`, "auto" under a budget, the basis split over 8
# devices (an Explicit mesh, as `jax.make_mesh` gives).
SETTINGS = {
    "int": {"batch_size": 1},
    "auto": {"batch_size": "auto", "memory_budget": 2**30},
    "mesh": {"mesh": jax.make_mesh((8,), ("basis",))},
}


def _same(got, want):
    """Same tree, and per leaf the same shape, dtype, weak type and values."""
    assert jtu.tree_structure(got) == jtu.tree_structure(want)
    for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(want), strict=True):
        assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type), (a, b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_numpy_float64_input_as_equinox_without_a_warning(verb, setting):
    # Warnings are errors here: the basis is built in float32, as JAX makes the input.
    ours, theirs = VERBS[verb]
    x = np.arange(3.0)
    _same(ours(jnp.sin, **SETTINGS[setting])(x), theirs(jnp.sin)(x))


def _dtypes_fun(x):
    """A weak float32 scalar and a float16 vector in; weak float32 and float16 out."""
    return {"weak": x["s"] * 2.0, "half": x["s"] * x["h"]}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("verb", ["fwd", "rev", "hessian"])
def test_dtypes_and_weak_types_as_equinox(verb, setting, jit):
    ours, theirs = VERBS[verb]
    x = {"s": jnp.asarray(1.5), "h": jnp.arange(1.0, 3.0, dtype=jnp.float16)}
    assert x["s"].weak_type
    fun = (
        (lambda x: jnp.sum(x["s"] * x["h"].astype(jnp.float32) ** 2))
        if verb == "hessian"
        else _dtypes_fun
    )
    jac = ours(fun, **SETTINGS[setting])
    got = jax.jit(jac)(x) if jit else jac(x)
    _same(got, theirs(fun)(x))
    if verb != "hessian":  # the identity of a weak scalar: a weak Jacobian
        _same(ours(lambda x: x, **SETTINGS[setting])(x["s"]), theirs(lambda x: x)(x["s"]))


@pytest.mark.parametrize("setting", SETTINGS)
def test_complex_outputs_forward_and_complex_inputs_reverse_as_equinox(setting):
    # What `jax.jac*` without `holomorphic` differentiate: real inputs (forward), real
    # outputs (reverse); the other side may be complex.
    x = jnp.linspace(0.0, 1.0, 3)
    f = lambda x: jnp.exp(1j * x)  # noqa: E731
    _same(eqxshard.filter_jacfwd(f, **SETTINGS[setting])(x), eqx.filter_jacfwd(f)(x))
    z = x * (1 + 2j)
    g = lambda z: jnp.abs(z) ** 2  # noqa: E731
    _same(eqxshard.filter_jacrev(g, **SETTINGS[setting])(z), eqx.filter_jacrev(g)(z))


@pytest.mark.parametrize("setting", [*SETTINGS, "none"])
def test_complex_where_equinox_raises(setting):
    options = SETTINGS.get(setting, {})
    x = {"w": jnp.ones(2), "z": jnp.asarray([1 + 2j, 3j])}
    with pytest.raises(TypeError, match="real-valued"):
        eqx.filter_jacfwd(jnp.sin)(x)
    with pytest.raises(
        TypeError,
        match=r"`filter_jacfwd` \(forward mode\) needs real-valued "
        r"inputs.*\n  z  complex64\(2,\)\nDifferentiate their real",
    ):
        eqxshard.filter_jacfwd(jnp.sin, **options)(x)
    with pytest.raises(TypeError, match="real-valued"):
        eqx.filter_hessian(lambda x: jnp.sum(jnp.abs(x["z"]) ** 2))(x)
    with pytest.raises(TypeError, match=r"forward mode.*\n  z"):
        eqxshard.filter_hessian(lambda x: jnp.sum(jnp.abs(x["z"]) ** 2), **options)(x)

    def f(w):
        return {"re": w, "im": w * 1j}

    with pytest.raises(TypeError, match="real-valued outputs"):
        eqx.filter_jacrev(f)(x["w"])
    with pytest.raises(
        TypeError,
        match=r"reverse mode\) needs real floating-point outputs"
        r".*\n  im  complex64\(2,\)\n.*real and imaginary",
    ):
        eqxshard.filter_jacrev(f, **options)(x["w"])


@pytest.mark.parametrize("setting", [*SETTINGS, "none"])
def test_integer_inputs_and_outputs_as_equinox(setting):
    options = SETTINGS.get(setting, {})
    cube = lambda x: x**3  # noqa: E731
    three = jnp.asarray(3)
    # Forward mode of an integer input: nothing to differentiate; Equinox raises ValueError.
    with pytest.raises(ValueError):
        eqx.filter_jacfwd(cube)(three)
    for verb in ("fwd", "hessian"):
        with pytest.raises(ValueError, match=r"has none.*\n  <root>  int32\(\)\nPass what"):
            VERBS[verb][0](cube, **options)(three)
    pair = (1.0, three)  # a Python float is held fixed too
    with pytest.raises(ValueError):
        eqx.filter_jacrev(lambda x: x[1] * 1.5)(pair)
    for verb in ("fwd", "rev"):
        with pytest.raises(ValueError, match=r"has none.*\n  0  float 1.0\n  1  int32"):
            VERBS[verb][0](lambda x: x[1] * 1.5, **options)(pair)
    # Reverse mode: `x**3` of an int is an int output, which reverse mode cannot do.
    for x in (three, jnp.asarray(3.0)):
        f = lambda x: jnp.round(x).astype(jnp.int32)  # noqa: E731
        for g in (cube, f) if x is three else (f,):
            with pytest.raises(TypeError, match="real-valued outputs"):
                eqx.filter_jacrev(g)(x)
            with pytest.raises(TypeError, match=r"real floating-point outputs.*\n  <root>  int32"):
                eqxshard.filter_jacrev(g, **options)(x)

    # Forward mode of an integer output: integer zeros, as Equinox gives.
    def h(x):
        return {"i": jnp.round(x).astype(jnp.int32), "f": x * 2}

    x = jnp.linspace(0.0, 2.0, 3)
    _same(eqxshard.filter_jacfwd(h, **options)(x), eqx.filter_jacfwd(h)(x))


@jax.custom_batching.custom_vmap
def _custom_sin(x):
    return jnp.sin(x)


@_custom_sin.def_vmap
def _custom_sin_vmap(axis_size, in_batched, x):
    del axis_size
    return jnp.sin(x), in_batched[0]


@pytest.mark.parametrize("setting", SETTINGS)
def test_custom_vmap_forward_as_equinox(setting):
    # `jax.jacfwd` pushes `jvp`s, which `custom_vmap` has; `jax.linearize` it has not.
    x = jnp.linspace(0.0, 1.0, 5)
    _same(
        eqxshard.filter_jacfwd(_custom_sin, **SETTINGS[setting])(x),
        eqx.filter_jacfwd(_custom_sin)(x),
    )
    with pytest.raises(ValueError, match="Linearization failed"):  # reverse mode: as Equinox
        eqx.filter_jacrev(_custom_sin)(x)
    with pytest.raises(ValueError, match="Linearization failed"):
        eqxshard.filter_jacrev(_custom_sin, **SETTINGS[setting])(x)


@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_non_array_aux_under_auto(verb):
    ours, theirs = VERBS[verb]

    def f(x):
        return jnp.sin(x), {"tag": "ok", "norm": jnp.sum(x**2), "n": 3}

    x = jnp.linspace(0.0, 1.0, 4)
    jac, aux = ours(f, has_aux=True, batch_size="auto", memory_budget=2**30)(x)
    assert aux["tag"] == "ok" and aux["n"] == 3
    _same(aux["norm"], f(x)[1]["norm"])
    if verb == "rev":  # Equinox's forward mode rejects a string aux (as `jax.jacfwd` does)
        want, want_aux = theirs(f, has_aux=True)(x)
        assert aux == {**want_aux, "norm": aux["norm"]}
    else:
        want = theirs(lambda x: f(x)[0])(x)
    _same(jac, want)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_eager_calls_compile_once_per_shapes(verb, setting):
    ours, theirs = VERBS[verb]
    traces = []

    def f(x, scale):
        traces.append(x.shape)
        return jnp.tanh(x * scale), "aux"

    jac = ours(f, has_aux=True, **SETTINGS[setting])
    first = None
    for i in range(3):  # new values, the same shapes and statics
        x = jnp.linspace(0.0, 1.0 + i, 6)
        got, aux = jac(x, 2.0)
        _same(got, theirs(lambda x: jnp.tanh(x * 2.0))(x))
        assert aux == "aux"
        first = len(traces) if first is None else first
    assert first and len(traces) == first  # the second and third calls traced nothing
    jac(jnp.ones(4), 2.0)  # a new shape compiles again
    assert len(traces) > first and traces[-1] == (4,)
    again = len(traces)
    jac(jnp.ones(4), 3.0)  # and so does a new static (hashed, as `eqx.filter_jit` does)
    assert len(traces) > again


@pytest.mark.parametrize("kind", ["explicit", "auto", "mixed"])
@pytest.mark.parametrize("setting", ["int", "auto"])
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_input_sharded_over_a_mesh_as_equinox(verb, setting, kind):
    # The chunks of an output laid out on Explicit axes carry that layout in their type:
    # the buffer they are written into is laid out the same (was a ShardingTypeError).
    from helpers import make_mesh

    mesh = make_mesh(kind, (4, 2), ("rows", "cols"))
    x = jax.device_put(
        jnp.linspace(0.0, 1.0, 32).reshape(8, 4),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows")),
    )
    ours, theirs = VERBS[verb]
    options: dict[str, Any] = {"batch_size": 3} if setting == "int" else SETTINGS["auto"]
    got, want = ours(jnp.sin, **options)(x), theirs(jnp.sin)(x)
    _same(got, want)
    assert isinstance(want, jax.Array)  # Equinox's result is inferred as `jac` or `(jac, aux)`
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


@pytest.mark.parametrize("kind", ["explicit", "auto", "mixed"])
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_basis_split_over_the_inputs_own_mesh_as_equinox(verb, kind):
    # Reverse mode: each basis vector is typed as the output it is the cotangent of (laid
    # out on its Explicit axes), which `jax.vjp` requires (was "unexpected JAX type").
    from helpers import make_mesh

    mesh = make_mesh(kind, (4, 2), ("rows", "cols"))
    x = jax.device_put(
        jnp.linspace(0.0, 1.0, 32).reshape(8, 4),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows")),
    )
    ours, theirs = VERBS[verb]
    _same(ours(jnp.sin, mesh=mesh)(x), theirs(jnp.sin)(x))


class _Tanh(eqx.Module):
    """`fun` holding an array of its own: a leaf of the computation, as the inputs are."""

    w: Any

    def __call__(self, x, y):
        return jnp.tanh(self.w * x) * y


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("verb", ["fwd", "rev", "hessian"])
def test_inputs_committed_to_one_device_with_a_mesh_as_equinox(verb, kind):
    # Outside `jit`, arrays committed to one device (`device_put` to it, or an earlier
    # computation's output there) are moved onto the mesh whole, where `jit` over the mesh
    # puts uncommitted ones (it refuses committed ones: "incompatible devices").
    from helpers import make_mesh

    mesh = make_mesh(kind, (8,), ("basis",))
    one = jax.devices()[1]
    x = jax.device_put(jnp.linspace(0.0, 1.0, 8), one)
    y = jax.jit(lambda x: x * 2 + 1)(x)  # committed to `one` as well
    fun = _Tanh(jax.device_put(jnp.linspace(1.0, 2.0, 8), one))
    ours, theirs = VERBS[verb]
    got = ours(fun, mesh=mesh)(x, y)
    _same(got, theirs(fun)(x, y))
    # The layout `mesh=` promises: the one uncommitted inputs get.
    free = ours(_Tanh(np.asarray(fun.w)), mesh=mesh)(np.asarray(x), np.asarray(y))
    assert got.sharding.is_equivalent_to(free.sharding, got.ndim), (got.sharding, free.sharding)
    assert got.sharding.device_set == set(mesh.devices.flat)
    assert x.sharding.device_set == {one}  # the caller's arrays stay where they were


def test_inputs_on_the_mesh_devices_in_another_order_with_a_mesh_as_equinox():
    # The same devices in another order are another device assignment to `jit`.
    mesh = jax.make_mesh((8,), ("basis",), axis_types=(jax.sharding.AxisType.Auto,))
    other = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("basis",))
    x = jax.device_put(
        jnp.linspace(0.0, 1.0, 16),
        jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec("basis")),
    )
    got = eqxshard.filter_jacrev(jnp.sin, batch_size=8, mesh=mesh)(x)
    _same(got, eqx.filter_jacrev(jnp.sin)(x))
    assert got.sharding.mesh.devices.tolist() == mesh.devices.tolist()


@pytest.mark.parametrize("kind", ["explicit", "mixed", "auto"])
@pytest.mark.parametrize("verb", ["fwd", "rev"])
def test_eager_result_is_on_the_mesh_given(verb, kind):
    # Computed on an Auto copy of the mesh; handed back on `mesh` itself (no copy), so it
    # combines with the caller's arrays there (JAX: "Mesh for all inputs should be equal").
    from helpers import make_mesh

    mesh = make_mesh(kind, (8,), ("basis",))
    x = jax.device_put(
        jnp.linspace(0.0, 1.0, 16), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    ours, theirs = VERBS[verb]
    got = ours(jnp.sin, mesh=mesh)(x)
    _same(got, theirs(jnp.sin)(x))
    assert got.sharding.mesh == mesh
    np.testing.assert_allclose(jax.jit(jnp.matmul)(got, x), jnp.cos(x) * x, rtol=1e-6)
