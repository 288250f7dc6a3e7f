"""`filter_jit`: Equinox's own `filter_jit` behaviour (each test runs against both
`eqx.filter_jit` and `eqxshard.filter_jit`, with the same results), then layouts,
donation, and errors."""

import contextlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxshard

_filter_jit = eqxshard.filter_jit

JITS = pytest.mark.parametrize("jit", [eqx.filter_jit, _filter_jit], ids=["eqx", "eqxshard"])


def _same(a, b):
    la, da = jtu.tree_flatten(a)
    lb, db = jtu.tree_flatten(b)
    assert da == db
    for x, y in zip(la, lb, strict=True):
        if eqx.is_array(x):
            assert eqx.is_array(y) and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x is y or x == y


@JITS
@pytest.mark.parametrize("donate", ["all", "none"])
def test_values_and_static_leaves(jit, donate):
    key = jax.random.key(0)
    a, b, c = jnp.arange(6.0).reshape(2, 3), jnp.arange(3.0), jnp.ones((1, 4))
    marker = object()
    mlp = eqx.nn.MLP(2, 2, 2, 2, key=key)
    general = [1, True, marker, {"a": a, "tuple": (2.0, b)}, c, mlp, np.arange(3)]
    copy = lambda t: jtu.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, t)

    @jit(donate=donate)
    def f(x):
        return jtu.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, x)

    out = f(copy(general))
    assert out[2] is marker and out[0] == 1 and out[1] is True
    assert out[5].activation is mlp.activation
    assert isinstance(out[6], jax.Array)  # NumPy inputs are traced, as in Equinox
    _same(out, jtu.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, general))


@JITS
def test_num_traces(jit):
    n = 0

    def f(x):
        nonlocal n
        n += 1

    f = jit(f)
    f(jnp.zeros(2))
    f(jnp.zeros(2))
    assert n == 1
    f(jnp.zeros(3))
    assert n == 2
    f([jnp.zeros(2)])
    f([jnp.zeros(2), jnp.zeros(3)])
    f([jnp.zeros(2), True])
    assert n == 5
    f(jnp.zeros(2, jnp.int32))
    assert n == 6
    f(np.zeros(2, np.float32))  # NumPy and JAX arrays of one shape and dtype: one trace
    assert n == 6

    n = 0

    def h(x, y, z, w):
        nonlocal n
        n += 1

    h = jit(h)
    h(True, {"a": 1, "b": 1}, True, True)
    h(False, {"a": 1, "b": 1}, True, True)
    h(True, {"a": 1, "b": 0}, True, True)
    h(True, {"a": 1, "b": 1}, True, 2)
    assert n == 4
    h(True, {"a": 1, "b": 1}, True, True)
    assert n == 4


@JITS
@pytest.mark.parametrize("call", [False, True])
@pytest.mark.parametrize("outer", [False, True])
def test_methods_and_bound_modules(jit, call, outer):
    n = 0

    class M(eqx.Module):
        increment: int | jax.Array

        def __call__(self, x):
            nonlocal n
            n += 1
            return x + self.increment

        def method(self, x):
            nonlocal n
            n += 1
            return x + self.increment

        jitted_call = jit(__call__)
        jitted_method = jit(method)

    def run(m):
        y = jnp.array(1.0)
        if outer:
            return jit(m)(y) if call else jit(m.method)(y)
        return m.jitted_call(y) if call else m.jitted_method(y)

    assert run(M(1)) == 2 and run(M(1)) == 2 and n == 1
    assert run(M(2)) == 3 and n == 2
    assert run(M(jnp.array(1))) == 2
    assert run(M(jnp.array(2))) == 3
    assert n == 3


@JITS
def test_args_kwargs_and_nesting(jit):
    n = 0

    @jit
    def f(*args, **kwargs):
        nonlocal n
        n += 1
        return kwargs["x"], args

    assert f(x=jnp.array(2))[0] == 2
    assert f(x=jnp.array(3))[0] == 3
    assert n == 1
    assert f(1, 2, x=jnp.array(3))[1] == (1, 2)
    assert n == 2

    @jit
    def g(x):
        nonlocal n
        n += 1
        return x + 1

    assert jit(g)(jnp.array(1)) == 2
    assert jit(g)(jnp.array(2)) == 3  # a new wrapper of an equal function: no new trace
    assert n == 3
    assert jit(eqx.filter_grad(lambda x: x**2))(jnp.array(3.0)) == 6.0
    assert jax.jit(lambda x: g(x) * 2)(jnp.array(1)) == 4  # inside another jit


@JITS
def test_donation(jit):
    @jit(donate="all")
    def f(x):
        return x + 1

    x = jnp.array(0.0)
    pointer = x.unsafe_buffer_pointer()
    y = f(x)
    assert x.is_deleted() and y.unsafe_buffer_pointer() == pointer

    @jit(donate="warn-except-first")
    def g(x, y):
        return x + y

    x, y = jnp.array(0.0), jnp.array(1.0)
    g(x, y)
    assert not x.is_deleted() and y.is_deleted()

    @jit(donate="warn")
    def h(x, y):
        return x + jnp.sum(y)

    with pytest.warns(UserWarning, match="Some donated buffers were not usable"):
        h(jnp.array(1.0), jnp.ones((10,)))

    @jit(donate="all")
    def quiet(x, y):
        return x + jnp.sum(y)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet(jnp.array(1.0), jnp.ones((10,)))


@JITS
def test_donation_of_bound_module(jit):
    class F(eqx.Module):
        buffer: jax.Array

        def __call__(self, x):
            return x, eqx.tree_at(lambda s: s.buffer, self, self.buffer.at[0].add(1))

    f = F(jnp.zeros(8))
    _, new = jit(f, donate="all")(jnp.ones(2))
    assert f.buffer.is_deleted() and new.buffer[0] == 1


@JITS
@pytest.mark.parametrize("donate", ["all", "all-except-first", "none"])
def test_lower_and_compile(jit, donate):
    def f(x, y):
        return 2 * x + y

    x, y = jnp.array(3), 4
    lowered = jit(f, donate=donate).lower(x, y)
    assert "stablehlo" in lowered.as_text()
    assert lowered.compile()(jnp.array(3), 4) == 10


# --- layouts, donation by leaf, and the program a hand-written `jax.jit` compiles ---------

import re  # noqa: E402

from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

AXES = pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])


def _mesh(axis_type):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _setup(axis_type):
    mesh = _mesh(axis_type)
    model = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = jnp.ones((8, 8))

    def step(params, x):
        def loss(params):
            model = eqx.combine(params, static)
            return jnp.mean(jax.vmap(model)(x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return value, jtu.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    return mesh, params, x, step


def _rule():
    return eqxshard.path_rules([(r".*weight", P("model")), (r".*", P())])


def _compiled_hlo(lowered):
    # The optimised, partitioned program; only the source locations (which Python files
    # and frames traced it) differ.
    debug = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    blocks = lowered.compile().as_text().split("\n\n")
    text = "\n\n".join(b for b in blocks if b.strip().split("\n")[0] not in debug)
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def _hlo(lowered):
    # Equal programs; only the names of the results JAX writes for readers differ.
    text = lowered.as_text(debug_info=False)
    return re.sub(r'jax\.result_info = "[^"]*"(, )?', "", text)


@AXES
def test_program_equals_hand_written_jit(axis_type):
    mesh, params, x, step = _setup(axis_type)
    rule = _rule()
    plan = eqxshard.filter_shardings(params, mesh, rule)
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    ours = _filter_jit(
        step,
        donate=(True, False),
        in_shardings=(rule, P("data")),
        out_shardings=(P(), rule),
        mesh=mesh,
    )
    hand = jax.jit(
        step, in_shardings=(plan, rows), out_shardings=(replicated, plan), donate_argnums=0
    )
    # Both given inputs laid out as asked (`filter_jit` lays them out before its `jax.jit`).
    placed, x = eqxshard.filter_shard((params, x), (plan, rows))
    # `filter_jit` is typed as Equinox types its own: a callable like `fun` (no `.lower`).
    lower = ours.lower  # pyright: ignore[reportFunctionMemberAccess]
    # On Explicit axes `filter_jit` traces with its mesh in context, as `jax.set_mesh` does
    # for a hand-written `jit` (jax >= 0.11 then constrains more of the program).
    with jax.set_mesh(mesh) if axis_type == AxisType.Explicit else contextlib.nullcontext():
        hand_lowered = hand.lower(placed, x)
    assert _hlo(lower(placed, x)) == _hlo(hand_lowered)
    assert _compiled_hlo(lower(placed, x)) == _compiled_hlo(hand_lowered)
    value, new = ours(jtu.tree_map(jnp.copy, placed), x)
    want_value, want = hand(jtu.tree_map(jnp.copy, placed), x)
    assert value.sharding.is_equivalent_to(replicated, 0)
    for a, b, s in zip(
        jtu.tree_leaves(new), jtu.tree_leaves(want), jtu.tree_leaves(plan), strict=True
    ):
        assert a.sharding == b.sharding and a.sharding.is_equivalent_to(s, a.ndim)
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)


def test_inputs_moved_in_one_batched_transfer(monkeypatch):
    mesh, params, x, step = _setup(AxisType.Explicit)
    rule = _rule()
    f = _filter_jit(step, in_shardings=(rule, P("data")), mesh=mesh)
    f(params, x)  # compiled once
    calls = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or device_put(*a, **k))
    on_one = jax.device_put(x, jax.devices()[1])
    f(params, on_one)
    assert len(calls) == 2  # ours above, then one for every leaf not laid out as asked
    moved = calls[1][0]
    assert len(moved) == len(jtu.tree_leaves(params)) + 1
    plan = eqxshard.filter_shardings(params, mesh, rule)
    placed = eqxshard.filter_shard((params, x), (plan, NamedSharding(mesh, P("data"))))
    calls.clear()
    f(*placed)  # laid out already: nothing moves
    assert calls == []


@AXES
@pytest.mark.parametrize("out_shardings", [None, P("data")], ids=["no-out", "out"])
def test_mixed_misplaced_inputs_moved_in_one_device_put(axis_type, out_shardings, monkeypatch):
    mesh = _mesh(axis_type)
    f = _filter_jit(
        lambda a, b, c: a + b + c, in_shardings=P("data"), out_shardings=out_shardings, mesh=mesh
    )
    ones = jnp.ones((8, 4))
    a = jax.device_put(ones, jax.devices()[1])  # on one device
    b = jax.device_put(ones, NamedSharding(mesh, P()))  # replicated
    c = jax.device_put(ones, NamedSharding(mesh, P(None, "model")))  # split along dim 1
    calls = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or device_put(*a, **k))
    for _ in range(3):  # the first call (which compiles) and later ones
        calls.clear()
        out = f(a, b, c)
        assert len(calls) == 1 and len(calls[0][0]) == 3  # one batched transfer of all three
        np.testing.assert_array_equal(out, 3.0)
    rows = NamedSharding(mesh, P("data"))
    placed = [device_put(x, rows) for x in (a, b, c)]
    calls.clear()
    f(*placed)
    assert calls == []


@AXES
def test_layouts_resolved_once_per_signature(axis_type):
    mesh = _mesh(axis_type)
    n = 0

    def f(x):
        nonlocal n
        n += 1
        return x * 2

    g = _filter_jit(f, in_shardings=P("data"), out_shardings=P(None, "model"), mesh=mesh)
    for shape in [(8, 2), (8, 2), (16, 4), (8, 2), (16, 4), (8, 2)]:
        out = g(jnp.ones(shape))
        assert out.shape == shape and out.sharding.spec == P(None, "model")
        np.testing.assert_array_equal(out, 2.0)
    assert n == 2  # one trace per input signature, however they alternate
    with pytest.raises(ValueError, match=r"In `in_shardings`(.|\n)*6 is not divisible by 4"):
        g(jnp.ones((6, 2)))  # a new signature is resolved (and checked) anew


def test_move_inputs_false_names_leaf_and_layouts():
    mesh = _mesh(AxisType.Explicit)
    f = _filter_jit(lambda x, y: x + y, in_shardings=P("data"), mesh=mesh, move_inputs=False)
    good = eqxshard.filter_shard(jnp.ones((8, 2)), mesh, P("data"))
    f(good, np.ones((8, 2), np.float32))  # NumPy is placed by `jit` itself, as `jax.jit` does
    wrong = eqxshard.filter_shard(jnp.ones((8, 2)), mesh, P(None, "model"))
    with pytest.raises(
        ValueError,
        match=r"move_inputs=False(.|\n)*args\.1.*P\(None, 'model'\).*asked P\('data',\)",
    ):
        f(good, wrong)


@AXES
def test_inside_another_jit_and_grad(axis_type):
    mesh = _mesh(axis_type)
    f = _filter_jit(
        lambda x: x * 2, in_shardings=P("data"), out_shardings=P(None, "model"), mesh=mesh
    )
    out = jax.jit(lambda x: f(x) + 1)(jnp.ones((8, 2)))
    np.testing.assert_array_equal(out, 3.0)
    # (An eager `grad` of it fails on Explicit axes, as it does for a hand-written `jax.jit`
    # with these shardings: JAX's transpose passes the cotangent in another layout.)
    grad = jax.jit(jax.grad(lambda x: f(x).sum()))(jnp.ones((8, 2)))
    np.testing.assert_array_equal(grad, 2.0)
    eager = f(jnp.ones((8, 2)))
    assert eager.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)


def test_layout_forms():
    mesh = _mesh(AxisType.Explicit)
    a, b, c = jnp.ones((8, 4)), jnp.ones((4, 8)), jnp.ones((8,))
    rows = NamedSharding(mesh, P("data"))
    f = _filter_jit(
        lambda t: t,
        in_shardings=({"a": {"w": rows}, "b": None, "c": mesh},),
        out_shardings={
            "a": eqxshard.path_rules([("w", P(None, "model"))]),  # paths from "a" down
            "b": lambda path, leaf: P("model"),
            "c": NamedSharding(mesh, P("data")),
        },
        mesh=mesh,
    )
    out = f({"a": {"w": a}, "b": b, "c": c})
    assert out["a"]["w"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    assert out["b"].sharding.is_equivalent_to(NamedSharding(mesh, P("model")), 2)
    assert out["c"].sharding.is_equivalent_to(rows, 1)
    on_two = _filter_jit(lambda x: x + 1, in_shardings=jax.devices()[2])(c)
    assert on_two.devices() == {jax.devices()[2]}
    with jax.set_mesh(mesh):  # specs against the ambient mesh
        g = _filter_jit(lambda x: x + 1, out_shardings=P("data"))
        assert g(a).sharding.is_equivalent_to(rows, 2)


def test_donate_by_leaf():
    def f(params, batch):
        return jtu.tree_map(lambda p: p + batch.sum(), params)

    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    batch = jnp.ones(4)
    out = _filter_jit(f, donate=({"w": True, "b": False}, False))(params, batch)
    assert params["w"].is_deleted() and not params["b"].is_deleted()
    assert not batch.is_deleted() and out["w"][0, 0] == 5
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    _filter_jit(f, donate=lambda x: x.ndim == 2)(params, batch)
    assert params["w"].is_deleted() and not params["b"].is_deleted() and not batch.is_deleted()


def test_bad_arguments():
    mesh = _mesh(AxisType.Explicit)
    with pytest.raises(TypeError, match="callable `fun`"):
        _filter_jit(3)  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(ValueError, match="`donate`.*'sometimes'"):
        _filter_jit(lambda x: x, donate="sometimes")
    with pytest.raises(TypeError, match=r"`donate`(.|\n)*\n  1  int 1"):
        _filter_jit(lambda x, y: x, donate=(True, 1))
    with pytest.raises(TypeError, match=r"`donate` filter(.|\n)*\n  0  returned str"):
        _filter_jit(lambda x: x, donate=lambda x: "yes")(jnp.ones(2))
    with pytest.raises(ValueError, match="`donate` tree whose structure is not a prefix"):
        _filter_jit(lambda x: x, donate=(True, False, True))(jnp.ones(2))
    with pytest.raises(TypeError, match=r"`in_shardings`(.|\n)*\n  1  str 'data'"):
        _filter_jit(lambda x, y: x, in_shardings=(None, "data"))
    with pytest.raises(TypeError, match=r"`out_shardings`(.|\n)*\n  a  int 3"):
        _filter_jit(lambda x: x, out_shardings={"a": 3})
    with pytest.raises(ValueError, match="`in_shardings` whose structure is not a prefix"):
        _filter_jit(lambda x: x, in_shardings=(P(), P()), mesh=mesh)(jnp.ones(8))
    with pytest.raises(ValueError, match="`out_shardings` whose structure is not a prefix"):
        _filter_jit(lambda x: x, out_shardings=(P(), P()), mesh=mesh)(jnp.ones(8))
    with pytest.raises(ValueError, match=r"no mesh(.|\n)*\n  0\.0  spec"):
        _filter_jit(lambda x: x, in_shardings=P("data"))(jnp.ones(8))
    divisible = r"In `in_shardings`(.|\n)*\n  0\.0\.b(.|\n)*not divisible"
    with pytest.raises(ValueError, match=divisible):
        _filter_jit(lambda t: t, in_shardings=P("data"), mesh=mesh)(
            {"a": jnp.ones(8), "b": jnp.ones(3)}
        )
    with pytest.raises(TypeError, match="`mesh` as a `jax.sharding.Mesh`"):
        _filter_jit(lambda x: x, mesh="data")
    with pytest.raises(TypeError, match="`move_inputs` as a bool"):
        _filter_jit(lambda x: x, move_inputs="no")  # pyright: ignore[reportArgumentType, reportCallIssue]
    with pytest.raises(ValueError, match=r"`\*\*kwargs`(.|\n)*kwargs\.y"):
        _filter_jit(lambda x, **kw: x, in_shardings=(P(),), mesh=mesh)(jnp.ones(8), y=jnp.ones(8))
    with pytest.raises(TypeError, match=r"hashable(.|\n)*args\.1  Unhashable"):

        class Unhashable:
            __hash__ = None  # type: ignore[assignment]

        _filter_jit(lambda x, y: x)(jnp.ones(2), Unhashable())


@JITS
def test_runtime_errors_as_equinox_reports_them(jit):
    @jit
    def f(x):
        return eqx.error_if(x, x > 0, "x is positive")

    assert f(jnp.array(-1.0)) == -1.0
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is positive"):
        f(jnp.array(1.0))


@JITS
def test_vmap_and_partials_inside(jit):
    n = 0

    def f(x):
        nonlocal n
        n += 1
        return x + 1

    out = jit(eqx.filter_vmap(f))(jnp.array([1, 2]))
    assert n == 1 and (np.asarray(out) == [2, 3]).all()
    jit(eqx.filter_vmap(f))(jnp.array([2, 3]))
    assert n == 1  # an equal function in a new wrapper: no new trace
    partial = jtu.Partial(lambda x, y: x + y, jnp.array(1.0))
    assert jit(partial)(jnp.array(2.0)) == 3.0
    wrapped = jit(f)
    assert wrapped.__wrapped__ is f and wrapped.__name__ == "f"


def test_compiled_lays_out_its_inputs_too():
    mesh = _mesh(AxisType.Explicit)
    f = _filter_jit(lambda x: x * 2, in_shardings=P("data"), out_shardings=P(), mesh=mesh)
    compiled = f.lower(jnp.ones((8, 2))).compile()  # pyright: ignore[reportFunctionMemberAccess]
    assert compiled.memory_analysis() is not None
    out = compiled(jax.device_put(jnp.ones((8, 2)), jax.devices()[0]))  # moved as asked
    assert out.sharding.is_fully_replicated and (np.asarray(out) == 2).all()


def test_a_plan_and_like_as_in_shardings():
    mesh, params, x, step = _setup(AxisType.Explicit)
    plan = eqxshard.filter_shardings(params, mesh, _rule())
    moments = jtu.tree_map(jnp.zeros_like, params)  # mirrors `params`, as optax state does
    placed = eqxshard.filter_shard(params, plan)
    f = _filter_jit(
        lambda p, s: (p, jtu.tree_map(lambda a: a + 1, s)),
        in_shardings=(plan, {"mu": eqxshard.like(placed)}),
        mesh=mesh,
    )
    p, s = f(params, {"mu": moments})
    for a, b in zip(jtu.tree_leaves(p), jtu.tree_leaves(plan), strict=True):
        assert a.sharding.is_equivalent_to(b, a.ndim)
    for a, b in zip(jtu.tree_leaves(s["mu"]), jtu.tree_leaves(plan), strict=True):
        assert a.sharding.is_equivalent_to(b, a.ndim)


@JITS
def test_donating_method_decorated_in_the_class_body(jit):
    n = 0

    class M(eqx.Module):
        buffer: jax.Array

        @jit(donate="all")
        def __call__(self, x):
            nonlocal n
            n += 1
            return x, eqx.tree_at(lambda s: s.buffer, self, self.buffer.at[0].add(1))

    m = M(jnp.zeros(8))
    pointer = m.buffer.unsafe_buffer_pointer()
    _, new = m(jnp.ones(2))
    _, new = new(jnp.ones(2))
    assert n == 1 and m.buffer.is_deleted() and new.buffer[0] == 2
    assert new.buffer.unsafe_buffer_pointer() == pointer


@JITS
def test_donating_a_bound_method_deletes_its_module_as_equinox_does(jit):
    # `donate="all"` donates the arrays of `fun` itself, as `eqx.filter_jit` does: the
    # module a method is bound to is gone after the first call.
    class M(eqx.Module):
        w: jax.Array

        def scale(self, x):
            return self.w * x

    m = M(jnp.ones(3))
    step = jit(m.scale, donate="all")
    np.testing.assert_array_equal(step(jnp.ones(())), np.ones(3))
    assert m.w.is_deleted()
    if jit is _filter_jit:  # a donate tree over the arguments keeps the arrays of `fun`
        m, x = M(jnp.ones(3)), jnp.ones(3)
        _filter_jit(m.scale, donate=(True,))(x)
        assert not m.w.is_deleted() and x.is_deleted()


def test_calling_again_with_donated_arrays_names_them():
    class M(eqx.Module):
        w: jax.Array

        def scale(self, x):
            return self.w * x

        @_filter_jit(donate="all")
        def __call__(self, x):
            return self.w * x

    m = M(jnp.ones(3))
    step = _filter_jit(m.scale, donate="all")
    step(jnp.ones(()))
    with pytest.raises(ValueError, match=r"earlier call donated(.|\n)*<fun>.*\.w  shape \(3,\)"):
        step(jnp.ones(()))
    m = M(jnp.ones(3))
    m(jnp.ones(()))
    with pytest.raises(ValueError, match=r"earlier call donated(.|\n)*\n  0\.w(.|\n)*all-except"):
        m(jnp.ones(()))

    class Kept(eqx.Module):  # `"all-except-first"` keeps `self`, the first argument
        w: jax.Array

        @_filter_jit(donate="all-except-first")
        def __call__(self, x):
            return self.w * x

    kept = Kept(jnp.ones(3))
    kept(jnp.ones(()))
    kept(jnp.ones(()))
    assert not kept.w.is_deleted()


def test_a_step_is_traced_with_its_explicit_mesh_in_context():
    # jax >= 0.11 looks Explicit axes up in the context mesh (an `Embedding` lookup of a
    # split batch failed with "Resource axis: data ... not found in mesh: ()" there).
    from jax.sharding import AxisType, PartitionSpec as P

    seen = []

    def f(x):
        seen.append(jax.sharding.get_abstract_mesh())
        return x * 2

    for kind in (AxisType.Explicit, AxisType.Auto):
        seen.clear()
        mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
        out = _filter_jit(f, in_shardings=P("data"), mesh=mesh)(jnp.ones(16))
        np.testing.assert_array_equal(out, np.full(16, 2.0))
        if kind == AxisType.Explicit:  # (Auto axes are left as `jax.jit` leaves them)
            assert seen[0].axis_names == ("data",) and seen[0].axis_types == (kind,)
    # A mesh the caller set stays the one in context.
    explicit = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    two = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    seen.clear()
    with jax.set_mesh(two):
        _filter_jit(f, mesh=explicit)(jnp.ones(16))
    assert seen[0].axis_names == ("a", "b")
