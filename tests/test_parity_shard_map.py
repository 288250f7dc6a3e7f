"""Parity: `filter_shard_map` against `jax.shard_map`, same cases through both.

Each case runs through eqxshard and through JAX and asserts equal values and equal output
shardings (the physical layout, `is_equivalent_to`, and the type-level spec JAX tracks,
`jax.typeof(x).sharding.spec`). The cases are those of JAX's own `shard_map_test.py` that
use only public API: specs, collectives, `axis_names` subsets, `vmap`/`grad`/`jit` around
the map, Auto and Explicit meshes, `unreduced`, and mutable arrays (`jax.new_ref`).
Where eqxshard deliberately differs, the test says so and asserts eqxshard's behaviour.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

from eqxshard import _compat, filter_shard_map

HAS_UNREDUCED = (
    hasattr(P(), "unreduced") and hasattr(P(), "partitions") and hasattr(jax.lax, "pcast")
)
HAS_REF = hasattr(jax, "new_ref") and hasattr(jax, "Ref")
HAS_VMAP_MESH_AXES = hasattr(
    __import__("jax._src.core", fromlist=["get_axis_env"]).get_axis_env(),
    "explicit_mesh_axis_names",
)


def mesh2(kind: str):
    return make_mesh(kind, shape=(2, 4), names=("x", "y"))


def laid_out(mesh, shape, spec):
    x = jnp.arange(float(np.prod(shape))).reshape(shape) / 7.0
    return jax.device_put(x, NamedSharding(mesh, spec))


def assert_same(out, expected):
    """Equal structure, values and output shardings (layout and type-level spec)."""
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    exp_leaves, exp_def = jax.tree_util.tree_flatten(expected)
    assert out_def == exp_def
    for a, b in zip(out_leaves, exp_leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec


def both(fun, transform=lambda f: f, **kwargs):
    """The same map built by eqxshard and by JAX, each wrapped by `transform`."""
    return transform(filter_shard_map(fun, **kwargs)), transform(jax.shard_map(fun, **kwargs))


def ring(x):
    return jax.lax.ppermute(x, "y", [(j, (j + 1) % 4) for j in range(4)])


# id, fun, in_specs, out_specs, axis_names, inputs as (shape, layout spec)
CASES = [
    ("identity", lambda x: x, P("x", "y"), P("x", "y"), None, [((8, 8), P("x", "y"))]),
    ("psum", lambda x: jax.lax.psum(x, "y"), P("x", "y"), P("x"), None, [((8, 8), P("x", "y"))]),
    (
        "pmean_replicated_out",
        lambda x: jax.lax.pmean(jnp.sum(x, keepdims=True), ("x", "y")),
        P("x", "y"),
        P(),
        None,
        [((8, 8), P("x", "y"))],
    ),
    (
        "all_gather",
        lambda x: jax.lax.all_gather(x, "y", axis=1, tiled=True),  # varying over 'y'
        P("x", "y"),
        P("x", "y"),
        None,
        [((8, 8), P("x", "y"))],
    ),
    (
        "psum_scatter",
        lambda x: jax.lax.psum_scatter(x, "y", scatter_dimension=1, tiled=True),
        P("x"),
        P("x", "y"),
        None,
        [((8, 8), P("x"))],
    ),
    ("ppermute", ring, P(None, "y"), P(None, "y"), None, [((4, 8), P(None, "y"))]),
    (
        "all_to_all",
        lambda x: jax.lax.all_to_all(x, "y", split_axis=1, concat_axis=0, tiled=True),
        P("y"),
        P(None, "y"),
        None,
        [((8, 8), P("y"))],
    ),
    (
        "axis_index",
        lambda x: x + jax.lax.axis_index("y"),
        P("x", "y"),
        P("x", "y"),
        None,
        [((8, 8), P("x", "y"))],
    ),
    (
        "matmul_psum",
        lambda a, b: jax.lax.psum(a @ b, "y"),
        (P("x", "y"), P("y", None)),
        P("x"),
        None,
        [((4, 8), P("x", "y")), ((8, 4), P("y"))],
    ),
    (
        "pytree_specs",
        lambda t: {"a": t["a"] * 2, "b": jax.lax.psum(t["b"], "x")},
        ({"a": P("x", "y"), "b": P("x")},),
        {"a": P("x", "y"), "b": P()},
        None,
        [],  # built in the test: one dict argument
    ),
    # `axis_names` a subset: the other axes stay as the inputs had them (item 2 of issue 9).
    ("partial_manual", lambda x: x * x, P("x"), P("x"), {"x"}, [((4, 8), P("x", "y"))]),
    (
        "partial_manual_psum",
        lambda x: jax.lax.psum(x, "y"),
        P(None, "y"),
        P(),
        {"y"},
        [((4, 8), P("x", "y"))],
    ),
]


def _args(case_id, mesh, inputs):
    if case_id == "pytree_specs":
        return ({"a": laid_out(mesh, (4, 8), P("x", "y")), "b": laid_out(mesh, (8,), P("x"))},)
    return tuple(laid_out(mesh, shape, spec) for shape, spec in inputs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_as_jax(case, kind, jit):
    case_id, fun, in_specs, out_specs, axis_names, inputs = case
    mesh = mesh2(kind)
    kwargs = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if axis_names is not None:
        kwargs["axis_names"] = axis_names
    ours, theirs = both(fun, jax.jit if jit else (lambda f: f), **kwargs)
    args = _args(case_id, mesh, inputs)
    assert_same(ours(*args), theirs(*args))


def test_partial_manual_keeps_the_other_axes_sharded():
    """Issue 9 item 2: with `axis_names={'x'}` the 'y' split of the input is kept."""
    mesh = mesh2("explicit")
    v = laid_out(mesh, (4, 8), P("x", "y"))
    kw: dict[str, Any] = dict(mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
    out = filter_shard_map(lambda x: x * x, **kw)(v)
    assert out.sharding.spec == P("x", "y")
    assert out.sharding.spec == jax.shard_map(lambda x: x * x, **kw)(v).sharding.spec


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_grad_and_jit_of_grad(kind):
    mesh = mesh2(kind)
    x = laid_out(mesh, (8, 8), P("x", "y"))

    def fun(x):
        return jnp.sin(x) * jax.lax.psum(jnp.sum(x), ("x", "y"))

    for transform in (lambda f: f, jax.jit):
        ours, theirs = both(fun, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
        grad = lambda f, t=transform: t(jax.grad(lambda x: jnp.sum(f(x) ** 2)))
        # The scalar loss of an Explicit-sharded array needs the mesh in context (plain JAX).
        with jax.set_mesh(mesh):
            assert_same(grad(ours)(x), grad(theirs)(x))


def test_vmap_over_a_plain_batch():
    mesh = mesh2("auto")
    xs = jnp.arange(3 * 8 * 8.0).reshape(3, 8, 8)

    def fun(x):
        return x / jax.lax.psum(jnp.sum(x), ("x", "y"))

    for transform in (jax.vmap, lambda f: jax.jit(jax.vmap(f))):
        ours, theirs = both(fun, transform, mesh=mesh, in_specs=P("x", "y"), out_specs=P("x", "y"))
        assert_same(ours(xs), theirs(xs))


@pytest.mark.skipif(not HAS_VMAP_MESH_AXES, reason="JAX records no vmap-taken mesh axes")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_over_a_batch_sharded_on_an_explicit_axis(jit):
    """Issue 9 item 1: `vmap` takes 'x'; the map runs over the axes left ('y')."""
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    arr = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P("x", "y")))
    wrap = (lambda f: jax.jit(jax.vmap(f))) if jit else jax.vmap
    ours, theirs = both(
        lambda x: jax.lax.psum(x, "y"), wrap, mesh=mesh, in_specs=P("y"), out_specs=P()
    )
    out = ours(arr)
    assert_same(out, theirs(arr))
    assert out.sharding.spec == P("x", None)


@pytest.mark.skipif(not HAS_VMAP_MESH_AXES, reason="JAX records no vmap-taken mesh axes")
def test_vmap_spec_naming_the_taken_axis():
    """Both refuse a spec naming the axis `vmap` took. Deliberate difference: eqxshard says
    so in its own `ValueError` naming `in_specs` and the leaf (JAX: "must refer to an axis
    marked as manual")."""
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    arr = jax.device_put(jnp.arange(16.0).reshape(2, 8), NamedSharding(mesh, P("x", "y")))
    ours, theirs = both(lambda x: x, jax.vmap, mesh=mesh, in_specs=P("x"), out_specs=P())
    with pytest.raises(ValueError, match="manual"):
        theirs(arr)
    with pytest.raises(
        ValueError, match=r"(?s)`in_specs` naming mesh axes outside `axis_names`.*\n  0"
    ):
        ours(arr)


@pytest.mark.skipif(not HAS_UNREDUCED, reason="PartitionSpec has no `unreduced`/`partitions`")
def test_unreduced_out_specs():
    """Issue 9 item 3: a matmul with its contraction split on 'y', left unreduced."""
    mesh = mesh2("explicit")
    a, b = laid_out(mesh, (4, 8), P("x", "y")), laid_out(mesh, (8, 4), P("y"))
    out_spec = P("x", None, unreduced=frozenset({"y"}))
    ours, theirs = both(
        lambda a, b: jax.lax.pcast(a @ b, "y", to="unreduced"),  # varying -> unreduced
        jax.jit,
        mesh=mesh,
        in_specs=(P("x", "y"), P("y", None)),
        out_specs=out_spec,
    )
    out, expected = ours(a, b), theirs(a, b)
    assert jax.typeof(out).sharding.spec == jax.typeof(expected).sharding.spec == out_spec
    reduce = jax.jit(lambda u: jax.sharding.reshard(u, NamedSharding(mesh, P("x", None))))
    assert_same(reduce(out), reduce(expected))
    np.testing.assert_allclose(reduce(out), np.asarray(a) @ np.asarray(b), rtol=1e-5)


@pytest.mark.skipif(not HAS_UNREDUCED, reason="PartitionSpec has no `unreduced`/`partitions`")
def test_unreduced_axis_outside_axis_names_is_refused():
    """JAX raises `NotImplementedError` for unreduced axes in partial manual mode; eqxshard
    refuses an unreduced axis that is not mapped first, with its own `ValueError`."""
    mesh = mesh2("explicit")
    f = filter_shard_map(
        lambda a: a,
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x", unreduced=frozenset({"y"})),
        axis_names={"x"},
    )
    with pytest.raises(ValueError, match=r"(?s)`out_specs` naming mesh axes outside.*\['y'\]"):
        jax.jit(f)(laid_out(mesh, (4, 8), P("x")))


@pytest.mark.skipif(not HAS_REF, reason="this JAX has no `jax.new_ref`")
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_ref_is_an_argument(kind):
    """Issue 9 item 4: a `jax.Ref` is passed in (and written to), not closed over."""
    mesh = mesh2(kind)
    x = laid_out(mesh, (8, 8), P("x", "y"))

    def fun(x, ref):
        ref[...] += x
        return x * 2

    results = []
    for make in (filter_shard_map, jax.shard_map):
        ref = jax.new_ref(laid_out(mesh, (8, 8), P("x", "y")) * 0)
        f = jax.jit(
            make(fun, mesh=mesh, in_specs=(P("x", "y"), P("x", "y")), out_specs=P("x", "y"))
        )
        out = f(x, ref)
        results.append((out, ref[...]))
    assert_same(results[0], results[1])
    np.testing.assert_allclose(results[0][1], x)


@pytest.mark.skipif(not HAS_REF, reason="this JAX has no `jax.new_ref`")
def test_ref_not_laid_out_is_refused():
    """A Ref cannot be copied to another layout without losing its writes: where JAX says
    "does not match the specs of the input", eqxshard names the leaf and the fix."""
    mesh = mesh2("explicit")
    ref = jax.new_ref(jnp.zeros(8))
    f = filter_shard_map(lambda r: r[...], mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match=r"(?s)mutable arrays.*\n  0.*laid out as"):
        jax.jit(f)(ref)
    assert not _compat.is_ref(jnp.zeros(2))


@pytest.mark.skipif(not HAS_UNREDUCED, reason="PartitionSpec has no `reduced`/`partitions`")
def test_reduced_in_specs():
    """A weight replicated for reduction (`reduced={'y'}`) passed in as such: eqxshard
    leaves that type for JAX to check instead of re-laying the input out."""
    mesh = mesh2("explicit")
    w, x = laid_out(mesh, (8, 4), P("y")), laid_out(mesh, (4, 8), P("x"))
    reduced = NamedSharding(mesh, P(None, None, reduced=frozenset({"y"})))
    results = []
    for make in (filter_shard_map, jax.shard_map):
        f = make(
            lambda w, x: x @ w,
            mesh=mesh,
            in_specs=(P(None, None, reduced=frozenset({"y"})), P("x")),
            out_specs=P("x"),
        )
        results.append(jax.jit(lambda w, x, f=f: f(jax.sharding.reshard(w, reduced), x))(w, x))
    assert_same(results[0], results[1])
    np.testing.assert_allclose(results[0], np.asarray(x) @ np.asarray(w), rtol=1e-6)


MIXED_CASES = [c for c in CASES if c[0] in ("psum", "ppermute", "pytree_specs", "partial_manual")]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", MIXED_CASES, ids=[c[0] for c in MIXED_CASES])
def test_same_as_jax_on_a_mixed_mesh(case, jit):
    """'x' Explicit, 'y' Auto."""
    test_same_as_jax(case, "mixed", jit)


def test_nested_maps():
    """An inner map over 'y' inside an outer map over 'x'. Deliberate difference: JAX wants
    the inner map given the mesh in context (`jax.sharding.get_abstract_mesh()`, its 'x' now
    Manual) and raises on the mesh itself; eqxshard takes either."""
    mesh = mesh2("explicit")
    x = laid_out(mesh, (8, 8), P("x", "y"))

    def build(make, inner_mesh):
        def outer_body(x):
            inner = make(
                lambda x: jax.lax.psum(x, "y"),
                mesh=inner_mesh(),
                in_specs=P(None, "y"),
                out_specs=P(),
                axis_names={"y"},
            )
            return inner(x) * 2

        outer = make(outer_body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x"})
        return jax.jit(outer)

    context = jax.sharding.get_abstract_mesh
    expected = build(jax.shard_map, context)(x)
    assert_same(build(filter_shard_map, context)(x), expected)
    assert_same(build(filter_shard_map, lambda: mesh)(x), expected)
    with pytest.raises(ValueError, match="context mesh"):
        build(jax.shard_map, lambda: mesh)(x)


@pytest.mark.parametrize("axis_names", [None, {"x"}], ids=["all", "partial"])
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_inputs_committed_to_one_device(kind, axis_names):
    """Deliberate difference: outside `jit`, `jax.shard_map` refuses arrays committed to
    other devices than the mesh's ("incompatible devices" on Auto axes, a spec mismatch on
    Explicit ones); eqxshard moves them onto the mesh as their in_specs say (as it lays out
    every input on Explicit axes), so the result is JAX's on the inputs laid out so."""
    mesh = mesh2(kind)
    one = jax.devices()[1]
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), one)
    w = jax.jit(lambda x: x[0] + 1)(x)  # an earlier computation's output, on `one` too
    axes = ("x", "y") if axis_names is None else ("x",)
    in_specs, out_specs = (P(*axes), P()), (P(*axes), P())

    def f(x, w):
        return x * w, jax.lax.psum(jnp.sum(x), axes)

    kwargs: dict[str, Any] = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if axis_names is not None:
        kwargs["axis_names"] = axis_names
    with pytest.raises(ValueError):
        jax.shard_map(f, **kwargs)(x, w)
    pairs = zip((x, w), in_specs, strict=True)
    laid = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in pairs]
    assert_same(filter_shard_map(f, **kwargs)(x, w), jax.shard_map(f, **kwargs)(*laid))
    assert x.sharding.device_set == {one}  # the caller's arrays stay where they were
