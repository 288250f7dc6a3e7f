"""`filter_shard_map`: equal to `jax.shard_map` and `pmap`, statics kept, grad, vmap, errors."""

from __future__ import annotations

import contextlib
from functools import partial

import equinox as eqx
import jax
import jax._src.core  # private: whether this JAX records the mesh axes `vmap` takes
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_equal_value, assert_statics_same, make_mesh, make_model
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard._shard_map.shard_map as _shard_map_module
from eqxshard import filter_shard_map

KINDS = ("auto", "explicit")
N = 8  # devices


def mesh1(kind: str = "auto"):
    return make_mesh(kind, shape=(N,), names=("i",))


def put(x, mesh, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def normalize(x):
    return x / jax.lax.psum(jnp.sum(x), "i")


def send_right(x):
    return jax.lax.ppermute(x, "i", [(j, (j + 1) % N) for j in range(N)])


def send_left(x):
    return jax.lax.ppermute(x, "i", [((j + 1) % N, j) for j in range(N)])


def rule30_step(board):
    """One Rule 30 step on this device's cells, with one halo cell from each neighbour."""
    left, right = send_right(board[-1:]), send_left(board[:1])
    wide = jnp.concatenate([left, board, right])
    return jnp.bitwise_xor(wide[:-2], jnp.bitwise_or(wide[1:-1], wide[2:]))


def rule30_board():
    board = np.zeros(40, dtype=bool)
    board[20] = True
    return board


def rule30_numpy(board, steps):
    for _ in range(steps):
        wide = np.concatenate([board[-1:], board, board[:1]])  # periodic, as the ring above
        board = wide[:-2] ^ (wide[1:-1] | wide[2:])
    return board


# --- equal results -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [False, True])
def test_psum_matches_jax_shard_map(kind, jit):
    mesh = mesh1(kind)
    x = put(jnp.arange(32.0), mesh, "i")  # laid out as in_specs say (Explicit axes need it)
    ours = filter_shard_map(normalize, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    theirs = jax.shard_map(normalize, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    if jit:
        ours, theirs = jax.jit(ours), jax.jit(theirs)
    out, expected = ours(x), theirs(x)
    assert_equal_value(out, expected)
    np.testing.assert_allclose(out, np.arange(32.0) / np.arange(32.0).sum(), rtol=1e-6)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("i")), 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [False, True])
def test_inputs_laid_out_as_in_specs(kind, jit):
    # Host data, an uncommitted array and one replicated on the mesh all work on Explicit
    # meshes too (where `jax.shard_map` requires inputs already laid out as `in_specs`).
    mesh = mesh1(kind)
    f = filter_shard_map(normalize, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    f = jax.jit(f) if jit else f
    expected = np.arange(16.0) / np.arange(16.0).sum()
    for x in (np.arange(16.0, dtype=np.float32), jnp.arange(16.0), put(jnp.arange(16.0), mesh)):
        out = f(x)
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("i")), 1)
        assert out.sharding.device_set == set(mesh.devices.flat)


def test_matches_pmap():
    mesh = mesh1()
    x = jnp.arange(8.0)
    square = filter_shard_map(lambda x: x**2, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    assert_equal_value(square(x), jax.pmap(lambda x: x**2)(x))
    # pmap maps a leading axis away; shard_map keeps each device's block as an array.
    norm_pmap = jax.pmap(lambda x: x / jax.lax.psum(x, "i"), axis_name="i")
    norm = filter_shard_map(normalize, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    assert_equal_value(norm(x), norm_pmap(x))

    board = rule30_board()
    ours = jax.jit(filter_shard_map(rule30_step, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    theirs = jax.pmap(lambda b: rule30_step(b), axis_name="i")
    b1, b2 = jnp.asarray(board), jnp.asarray(board.reshape(N, -1))
    for _ in range(10):  # each step waited for: many CPU collectives in flight can deadlock
        b1, b2 = jax.block_until_ready((ours(b1), theirs(b2)))
    np.testing.assert_array_equal(b1, np.asarray(b2).reshape(-1))
    np.testing.assert_array_equal(b1, rule30_numpy(board, 10))


@pytest.mark.parametrize("kind", KINDS)
def test_loop_in_jit_stays_sharded(kind):
    # A multi-step loop inside one `jit`: the state never leaves the mesh.
    mesh = mesh1(kind)
    step = filter_shard_map(rule30_step, mesh=mesh, in_specs=P("i"), out_specs=P("i"))

    @jax.jit
    def run(board):
        return jax.lax.fori_loop(0, 20, lambda _, b: step(b), board)

    out = run(put(jnp.asarray(rule30_board()), mesh, "i"))
    np.testing.assert_array_equal(out, rule30_numpy(rule30_board(), 20))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("i")), 1)
    assert out.sharding.device_set == set(mesh.devices.flat)


def test_random_matrices_per_device():
    mesh = mesh1()
    keys = jax.random.split(jax.random.key(0), N)
    make = filter_shard_map(
        lambda k: jax.random.normal(k[0], (1, 6, 5)), mesh=mesh, in_specs=P("i"), out_specs=P("i")
    )
    mats = make(keys)
    assert mats.shape == (N, 6, 5)
    expected = jax.vmap(lambda k: jax.random.normal(k, (6, 5)))(keys)
    np.testing.assert_allclose(mats, expected, rtol=1e-6)
    gram = filter_shard_map(
        lambda m: m @ jnp.swapaxes(m, 1, 2), mesh=mesh, in_specs=P("i"), out_specs=P("i")
    )
    np.testing.assert_allclose(gram(mats), expected @ jnp.swapaxes(expected, 1, 2), rtol=1e-5)


# --- statics -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [False, True])
def test_statics_in_and_out(kind, jit):
    mesh = mesh1(kind)
    model = make_model()
    seen = []

    def fun(model, x, label):
        seen.append((model.fn, model.activation, model.name, model.count, label))
        y = jax.vmap(lambda row: model.activation(model.linear(row)))(x)
        return {"y": y, "model": model, "label": label, "fn": jnp.tanh, "n": 3}

    specs = {"y": P("i"), "model": P(), "label": None, "fn": None, "n": None}
    f = filter_shard_map(fun, mesh=mesh, in_specs=(P(), P("i"), None), out_specs=specs)
    f = eqx.filter_jit(f) if jit else f
    x = jnp.arange(16 * 8.0).reshape(16, 8)
    out = f(model, x, "hello")
    assert seen == [(model.fn, model.activation, "model", 3, "hello")]
    assert seen[0][0] is model.fn and seen[0][1] is model.activation
    assert out["label"] == "hello" and out["fn"] is jnp.tanh and out["n"] == 3
    assert_statics_same(out["model"], model)
    for a, b in zip(jax.tree.leaves(out["model"]), jax.tree.leaves(model), strict=True):
        if eqx.is_array(b):
            assert_equal_value(a, b)
    assert model.linear.bias is not None
    expected = jax.nn.relu(x @ model.linear.weight.T + model.linear.bias)
    np.testing.assert_allclose(out["y"], expected, rtol=1e-5)


def test_no_array_outputs_and_no_array_inputs():
    mesh = mesh1()
    f = filter_shard_map(lambda s: (s, len(s)), mesh=mesh, in_specs=None, out_specs=None)
    assert f("abc") == ("abc", 3)


def test_trace_once_under_filter_jit():
    mesh = mesh1()
    calls = []

    def fun(x, act):
        calls.append(1)
        return act(x), act

    f = eqx.filter_jit(filter_shard_map(fun, mesh=mesh, in_specs=P("i"), out_specs=(P("i"), None)))
    x = jnp.arange(8.0) - 4
    for _ in range(3):
        y, act = f(x, jax.nn.relu)
        assert act is jax.nn.relu
        np.testing.assert_array_equal(y, jax.nn.relu(x))
    assert len(calls) == 1


# --- transformations -----------------------------------------------------------------------


def _loss(w, x):
    return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "i")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [False, True])
def test_grad(kind, jit):
    mesh = mesh1(kind)
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = jnp.linspace(0.0, 2.0, 64).reshape(16, 4)
    loss = filter_shard_map(_loss, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    grad = jax.grad(loss)
    grad = jax.jit(grad) if jit else grad
    expected = jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2))(w, x)
    # Outside `jit` on Explicit axes, JAX needs the mesh in context to differentiate
    # `jax.shard_map` (its cotangent seed is otherwise on one device).
    context = jax.set_mesh(mesh) if kind == "explicit" and not jit else contextlib.nullcontext()
    with context:
        np.testing.assert_allclose(grad(w, x), expected, rtol=1e-5, atol=1e-7)


def test_filter_grad_of_a_model_with_statics():
    mesh = mesh1()
    model = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.softplus, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 64).reshape(16, 4)

    @filter_shard_map(mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    def sharded_loss(model, x):
        return jax.lax.pmean(jnp.mean(jax.vmap(model)(x) ** 2), "i")

    grads = eqx.filter_jit(eqx.filter_grad(sharded_loss))(model, x)
    expected = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))(model, x)
    assert_statics_same(grads, expected)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_nested_grad_like_the_cookbook():
    # The cookbook's pmap-of-grad-of-pmap, on a (rows, cols) mesh: the inner map over
    # 'cols' becomes collectives over 'cols' in one map; the reference is the same code
    # with `vmap` and axis names.
    mesh = make_mesh("auto", shape=(4, 2), names=("rows", "cols"))
    x = jnp.arange(1.0, 9.0).reshape(4, 2) / 8

    def per_device(x):
        y = jnp.sin(x)
        g = lambda z: (
            jnp.cos(z) * jnp.tan(jax.lax.psum(y, "cols")) * jax.lax.psum(jnp.tanh(x), "cols")
        )
        return jax.grad(lambda w: jnp.sum(g(w)))(x)

    f = filter_shard_map(
        per_device, mesh=mesh, in_specs=P("rows", "cols"), out_specs=P("rows", "cols")
    )
    ref = jax.vmap(jax.vmap(per_device, axis_name="cols"), axis_name="rows")
    np.testing.assert_allclose(jax.jit(f)(x), ref(x), rtol=1e-6)
    outer = lambda f: jax.grad(lambda x: jnp.sum(f(x)))
    np.testing.assert_allclose(jax.jit(outer(f))(x), outer(ref)(x), rtol=1e-5)


def test_nested_maps_like_nested_pmap():
    # The cookbook's `pmap` over 'rows' of a `pmap` over 'cols', with the same `mesh`
    # passed to both maps; the reference is the same code with `vmap` and axis names.
    mesh = make_mesh("auto", shape=(4, 2), names=("rows", "cols"))
    x = jnp.arange(1.0, 9.0).reshape(4, 2)

    def normed(x):
        return (x / jax.lax.psum(x, "rows"),)

    def cols_normed(x):
        return x / jax.lax.psum(x, "cols")

    inner = filter_shard_map(
        cols_normed,
        mesh=mesh,
        in_specs=P(None, "cols"),
        out_specs=P(None, "cols"),
        axis_names={"cols"},
    )
    outer = filter_shard_map(
        lambda x: (inner(x), *normed(x)),
        mesh=mesh,
        in_specs=P("rows"),
        out_specs=P("rows"),
        axis_names={"rows"},
    )
    ref = jax.vmap(
        jax.vmap(lambda x: (cols_normed(x), *normed(x)), axis_name="cols"), axis_name="rows"
    )
    for out in (outer(x), jax.jit(outer)(x)):
        for a, b in zip(out, ref(x), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_vmap():
    mesh = mesh1()
    f = filter_shard_map(normalize, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    xs = jnp.arange(3 * 16.0).reshape(3, 16) + 1
    expected = jnp.stack([f(x) for x in xs])
    np.testing.assert_allclose(jax.vmap(f)(xs), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(xs), expected, rtol=1e-6)


# --- forms of the arguments ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_ambient_mesh(kind):
    mesh = mesh1(kind)
    f = filter_shard_map(normalize, in_specs=P("i"), out_specs=P("i"))
    x = put(jnp.arange(8.0), mesh, "i")
    with jax.set_mesh(mesh):
        out, out_jit = f(x), jax.jit(f)(x)
    expected = np.arange(8.0) / 28
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(out_jit, expected, rtol=1e-6)


def test_spec_forms():
    mesh = make_mesh("auto", shape=(4, 2), names=("data", "model"))
    tree = {"w": jnp.ones((8, 4)), "b": jnp.arange(8.0), "s": "static"}

    def fun(tree):
        return {k: v.shape if k != "s" else v for k, v in tree.items()}

    def shapes(in_specs):
        out = {}

        def record(tree):
            out.update(fun(tree))
            return ()

        filter_shard_map(record, mesh=mesh, in_specs=in_specs, out_specs=())(tree)
        return out

    # A PartitionSpec for all, a prefix tree (None = replicated on arrays, nothing on
    # statics), a NamedSharding on the mesh, and a callable.
    assert shapes(P("data")) == {"w": (2, 4), "b": (2,), "s": "static"}
    assert shapes(({"w": P("data", "model"), "b": None, "s": None},)) == {
        "w": (2, 2),
        "b": (8,),
        "s": "static",
    }
    named = NamedSharding(mesh, P(None, "model"))
    assert shapes(({"w": named, "b": P(), "s": None},))["w"] == (8, 2)
    by_rank = lambda path, leaf: P("data", "model") if leaf.ndim == 2 else P("model")
    assert shapes(by_rank) == {"w": (2, 2), "b": (4,), "s": "static"}

    class Rule:  # a sharding rule: `spec_for(path, leaf, mesh)`, called with the map's mesh
        def spec_for(self, path, leaf, rule_mesh):
            assert rule_mesh is mesh
            return P("model") if jax.tree_util.keystr(path) == "[0]['b']" else None

    assert shapes(Rule()) == {"w": (8, 4), "b": (4,), "s": "static"}


def test_axis_names_leaves_other_axes_to_the_compiler():
    mesh = make_mesh("auto", shape=(4, 2), names=("data", "model"))
    f = filter_shard_map(
        lambda x: x / jax.lax.psum(jnp.sum(x), "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
        axis_names={"data"},
    )
    x = jnp.arange(1.0, 17.0).reshape(8, 2)
    np.testing.assert_allclose(jax.jit(f)(x), x / x.sum(), rtol=1e-6)


def test_decorator_and_wraps():
    mesh = mesh1()

    @filter_shard_map(mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    def double(x):
        """Doubles."""
        return 2 * x

    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert_equal_value(double(jnp.arange(8.0)), 2 * jnp.arange(8.0))


def test_public_name():
    import eqxshard

    # Exported from the package (eqxshard/__init__.py re-exports it).
    assert eqxshard.filter_shard_map is _shard_map_module.filter_shard_map


# --- errors --------------------------------------------------------------------------------


def test_error_no_mesh():
    f = filter_shard_map(normalize, in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(ValueError, match=r"without a `mesh` and no mesh is set.*jax\.set_mesh"):
        f(jnp.arange(8.0))


def test_error_mesh_type():
    f = filter_shard_map(normalize, mesh=jax.devices(), in_specs=P("i"), out_specs=P("i"))  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(TypeError, match=r"`filter_shard_map\(mesh=...\)` must be a .*Mesh"):
        f(jnp.arange(8.0))


def test_error_fun_and_kwargs():
    with pytest.raises(TypeError, match="needs a callable `fun`"):
        filter_shard_map(3, mesh=mesh1(), in_specs=P(), out_specs=P())  # pyright: ignore[reportArgumentType, reportCallIssue]
    f = filter_shard_map(lambda x: x, mesh=mesh1(), in_specs=P(), out_specs=P())
    with pytest.raises(TypeError, match=r"positional arguments only.*\['x'\]"):
        f(x=jnp.ones(8))


def test_error_in_specs_not_a_prefix():
    f = filter_shard_map(lambda a, b: a, mesh=mesh1(), in_specs=(P("i"),), out_specs=P("i"))
    with pytest.raises(ValueError, match=r"`in_specs` whose structure is not a prefix"):
        f(jnp.ones(8), jnp.ones(8))


def test_error_spec_on_non_array_input():
    f = filter_shard_map(lambda t: t["x"], mesh=mesh1(), in_specs=P("i"), out_specs=P("i"))
    f({"x": jnp.ones(8), "n": 3})  # a spec over a subtree applies to its arrays only
    g = filter_shard_map(
        lambda t: t["x"], mesh=mesh1(), in_specs=({"x": P("i"), "n": P("i")},), out_specs=P("i")
    )
    with pytest.raises(ValueError, match=r"(?s)`in_specs` for leaves that are not arrays.*\n  0.n"):
        g({"x": jnp.ones(8), "n": "tag"})
    # A Python scalar with a spec of its own is an array, as in `jax.shard_map`: here a 0-d
    # one that P("i") cannot split.
    with pytest.raises(ValueError, match=r"(?s)more entries than their leaves have dims.*\n  0\.n"):
        g({"x": jnp.ones(8), "n": 3})


def test_error_in_specs_bad_leaves_listed_together():
    mesh = make_mesh("auto", shape=(4, 2), names=("data", "model"))
    tree = {"a": jnp.ones((6, 4)), "b": jnp.ones((10,)), "c": jnp.ones((8,))}
    f = filter_shard_map(lambda t: (), mesh=mesh, in_specs=P("data"), out_specs=())
    with pytest.raises(ValueError, match=r"(?s)evenly.*\n  0\.a.*dim 0 = 6.*\n  0\.b.*dim 0 = 10"):
        f(tree)
    f = filter_shard_map(lambda t: (), mesh=mesh, in_specs=P("nope"), out_specs=())
    with pytest.raises(ValueError, match=r"(?s)axes its mesh does not have.*\n  0\.a.*\n  0\.c"):
        f(tree)
    f = filter_shard_map(lambda t: (), mesh=mesh, in_specs=P("data", "data"), out_specs=())
    with pytest.raises(ValueError, match=r"more than once"):
        f({"a": jnp.ones((8, 8))})
    f = filter_shard_map(lambda t: (), mesh=mesh, in_specs=P(None, "data"), out_specs=())
    with pytest.raises(ValueError, match=r"(?s)more entries than.*\n  0\.b"):
        f(tree)


def test_error_spec_type():
    f = filter_shard_map(lambda x: x, mesh=mesh1(), in_specs=("i",), out_specs=P("i"))
    with pytest.raises(TypeError, match=r"(?s)not PartitionSpecs.*\n  0.*'i' of type str"):
        f(jnp.ones(8))
    f = filter_shard_map(lambda x: x, mesh=mesh1(), in_specs=P("i"), out_specs=lambda p, x: 3)
    with pytest.raises(TypeError, match=r"`out_specs` entries that are not PartitionSpecs"):
        f(jnp.ones(8))


def test_error_named_sharding_on_another_mesh():
    other = make_mesh("auto", shape=(4,), names=("i",), devices=jax.devices()[:4])
    f = filter_shard_map(
        lambda x: x, mesh=mesh1(), in_specs=NamedSharding(other, P("i")), out_specs=P("i")
    )
    with pytest.raises(ValueError, match=r"(?s)NamedShardings on another mesh.*\n  0"):
        f(jnp.ones(8))


def test_error_axis_names():
    mesh = make_mesh("auto", shape=(4, 2), names=("data", "model"))
    f = filter_shard_map(
        lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"batch"}
    )
    with pytest.raises(ValueError, match=r"names axes \['batch'\] that the mesh"):
        f(jnp.ones(8))
    f = filter_shard_map(
        lambda x: x, mesh=mesh, in_specs=P("model"), out_specs=P("data"), axis_names={"data"}
    )
    with pytest.raises(ValueError, match=r"(?s)outside `axis_names` \['data'\].*\n  0"):
        f(jnp.ones(8))


@pytest.mark.skipif(
    not hasattr(jax._src.core.get_axis_env(), "explicit_mesh_axis_names"),
    reason="this JAX records no mesh axes taken by `vmap`",
)
def test_error_axis_names_taken_by_vmap():
    mesh = make_mesh("explicit", shape=(2, 4), names=("x", "y"))
    xs = jax.device_put(jnp.ones((2, 8)), NamedSharding(mesh, P("x", "y")))
    f = filter_shard_map(
        lambda x: x, mesh=mesh, in_specs=P("y"), out_specs=P("y"), axis_names={"x", "y"}
    )
    with pytest.raises(ValueError, match=r"names axes \['x'\] that an enclosing `jax.vmap`"):
        jax.vmap(f)(xs)
    g = filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("y"), out_specs=P("y"))
    np.testing.assert_array_equal(jax.vmap(g)(xs), xs)  # `axis_names=None`: the axes left


def test_error_out_specs():
    mesh = mesh1()
    x = jnp.ones(8)
    f = filter_shard_map(lambda x: (x, x), mesh=mesh, in_specs=P("i"), out_specs=(P("i"), None))
    with pytest.raises(
        ValueError, match=r"(?s)`None` in `out_specs` for these array outputs.*\n  1"
    ):
        f(x)
    f = filter_shard_map(lambda x: (x, "s"), mesh=mesh, in_specs=P("i"), out_specs=(P("i"), P()))
    with pytest.raises(ValueError, match=r"(?s)`out_specs` for leaves that are not arrays.*\n  1"):
        f(x)
    f = filter_shard_map(lambda x: (x, x), mesh=mesh, in_specs=P("i"), out_specs=(P("i"),))
    with pytest.raises(ValueError, match=r"`out_specs` whose structure is not a prefix"):
        f(x)
    f = filter_shard_map(lambda x: x.sum(), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(ValueError, match=r"(?s)more entries than the per-device.*x\[None\]"):
        f(x)
    f = filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("i"), out_specs=P("j"))
    with pytest.raises(ValueError, match=r"(?s)`out_specs` naming axes its mesh does not have"):
        f(x)
    f = filter_shard_map(lambda x: x[None], mesh=mesh, in_specs=P("i"), out_specs=P("i", "i"))
    with pytest.raises(ValueError, match=r"`out_specs` using a mesh axis more than once"):
        f(x)


def test_error_from_jax_for_unequal_replicated_output():
    # An output said to be equal on every device (P()) that is not: JAX's check_vma.
    f = filter_shard_map(lambda x: x, mesh=mesh1(), in_specs=P("i"), out_specs=P())
    with pytest.raises(ValueError, match="out_specs"):
        f(jnp.ones(8))
    g = filter_shard_map(lambda x: x, mesh=mesh1(), in_specs=P("i"), out_specs=P(), check_vma=False)
    assert g(jnp.arange(8.0)).shape == (1,)


def test_pmap_still_runs_here():
    # The comparisons above use `pmap` as the reference; fail loudly when it is gone.
    assert_equal_value(jax.pmap(partial(jnp.add, 1.0))(jnp.zeros(N)), jnp.ones(N))
