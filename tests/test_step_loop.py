"""`StepLoop`: the same results, layouts, donation and errors as calling the `filter_jit`
step itself, with the state kept flat between calls."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxshard

AXES = pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])


def _mesh(axis_type):
    return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


def _copy(tree):
    return jtu.tree_map(lambda x: jnp.array(x) if eqx.is_array(x) else x, tree)


def _arrays(tree):
    return jtu.tree_leaves(eqx.filter(tree, eqx.is_array))


def _batches(n):
    return [np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32) for i in range(n)]


@AXES
def test_same_results_and_layouts_as_per_call_filter_jit(axis_type):
    mesh = _mesh(axis_type)
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    rule = eqxshard.path_rules([(r".*weight", P("data")), (r".*", P())])
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(params)

    @eqxshard.filter_jit(
        donate=(True, True, False),
        in_shardings=(rule, eqxshard.like(params), P("data")),
        out_shardings=(rule, eqxshard.like(params), P()),
        mesh=mesh,
    )
    def step(model, opt_state, x):
        # Elementwise only, so that Explicit axes need no resharding inside.
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((m.layers[0].weight.sum() + x) ** 2)
        )(model)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    batches = _batches(4)
    m1, s1 = _copy(model), _copy(opt_state)
    want = []
    for x in batches:
        m1, s1, loss = step(m1, s1, x)
        want.append(loss)
    loop = eqxshard.StepLoop(step, _copy(model), _copy(opt_state))
    got = [loop(x) for x in batches]
    m2, s2 = loop.state
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jtu.tree_structure((m1, s1)) == jtu.tree_structure((m2, s2))
    assert m2.activation is model.activation  # static leaves are the same objects
    for a, b in zip(_arrays((m1, s1)), _arrays((m2, s2)), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)
    assert m2.layers[0].weight.sharding.spec == P("data")
    assert got[-1].sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)


def test_donates_the_state_not_the_batch():
    mesh = _mesh(AxisType.Auto)
    step = eqxshard.filter_jit(
        lambda w, x: (w + x.sum(), x.sum()), donate=(True, False), in_shardings=P(), mesh=mesh
    )
    loop = eqxshard.StepLoop(step, jnp.zeros(8))
    x = eqxshard.filter_shard(jnp.ones(8), mesh)
    loop(x)
    (before,) = loop.state
    assert loop(x) == 8.0
    assert before.is_deleted() and not x.is_deleted()
    (after,) = loop.state
    np.testing.assert_array_equal(after, 16.0)


def test_moves_a_misplaced_batch_in_one_transfer(monkeypatch):
    mesh = _mesh(AxisType.Explicit)
    step = eqxshard.filter_jit(
        lambda w, x: (w + 1, x * 2), in_shardings=(None, P("data")), mesh=mesh
    )
    loop = eqxshard.StepLoop(step, eqxshard.filter_shard(jnp.zeros(4), mesh))
    placed = eqxshard.filter_shard(jnp.ones(8), mesh, P("data"))
    loop(placed)  # built and compiled
    calls = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or device_put(*a, **k))
    out = loop(placed)
    assert calls == []  # laid out already, and the state is the step's own output
    assert out.sharding.spec == P("data")
    on_one = device_put(jnp.ones(8), jax.devices()[3])
    out = loop(on_one)
    assert len(calls) == 1 and len(calls[0][0]) == 1  # only the batch moves
    np.testing.assert_array_equal(out, 2.0)
    np.testing.assert_array_equal(loop.state[0], 3.0)


def test_traces_once_and_reuses_filter_jits_program():
    n = 0

    def f(w, x):
        nonlocal n
        n += 1
        return w + x, w.sum()

    step = eqxshard.filter_jit(f)
    step(jnp.zeros(3), jnp.ones(3))
    loop = eqxshard.StepLoop(step, jnp.zeros(3))
    for _ in range(4):
        loop(jnp.ones(3))
    assert n == 1
    loop(jnp.ones(3, jnp.int32))  # another batch signature: traced again, once
    loop(jnp.ones(3, jnp.int32))
    assert n == 2


def test_outputs_after_the_state_and_a_plain_function():
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(1))
    one = eqxshard.StepLoop(lambda m, x: (m, m(x)), mlp)
    np.testing.assert_allclose(one(jnp.ones(2)), mlp(jnp.ones(2)), rtol=1e-6)
    none = eqxshard.StepLoop(lambda a, b: (b, a), jnp.zeros(2), jnp.ones(2))
    assert none() is None and none() is None
    np.testing.assert_array_equal(none.state[0], 0.0)  # swapped twice
    several = eqxshard.StepLoop(lambda a: (a + 1, a, "tag"), jnp.zeros(()))
    value, tag = several()
    assert value == 0.0 and tag == "tag"
    value, _ = several()
    assert value == 1.0


def test_carry_holds_the_other_state_arguments():
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(1))
    evaluate = eqxshard.StepLoop(lambda m, x: {"y": m(x)}, mlp, carry=0)
    for x in (jnp.ones(2), jnp.zeros(2)):
        np.testing.assert_allclose(evaluate(x)["y"], mlp(x), rtol=1e-6)
    assert evaluate.state[0] is not None and evaluate.state[0].layers[0].weight is not None
    # The first argument carried, the second (a scale) held as it is.
    loop = eqxshard.StepLoop(
        lambda w, scale, x: (w * scale + x, w.sum()), jnp.ones(2), 2.0, carry=1
    )
    assert loop(jnp.zeros(2)) == 2.0
    assert loop(jnp.ones(2)) == 4.0
    w, scale = loop.state
    np.testing.assert_array_equal(w, 5.0)
    assert scale == 2.0


def test_state_that_changes_dtype_or_structure():
    loop = eqxshard.StepLoop(lambda a: (a.astype(jnp.float32) * 2, a.dtype.name), jnp.ones(2, int))
    assert loop() == "int32"
    assert loop() == "float32"
    assert loop() == "float32"
    np.testing.assert_array_equal(loop.state[0], 8.0)
    grow = eqxshard.StepLoop(lambda t: ((*t, t[-1] + 1), len(t)), (jnp.zeros(()),))
    assert [grow() for _ in range(3)] == [1, 2, 3]
    assert len(grow.state[0]) == 4


def test_runtime_errors_as_equinox_reports_them():
    loop = eqxshard.StepLoop(
        lambda x: (eqx.error_if(x, x >= 0, "x is positive") + 1,), jnp.array(-1.0)
    )
    loop()
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is positive"):
        loop()


def test_errors():
    with pytest.raises(TypeError, match=r"`StepLoop` takes a callable `step`.*int"):
        eqxshard.StepLoop(3, jnp.zeros(2))  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"initial state after `step`.*got none"):
        eqxshard.StepLoop(lambda x: (x,))
    with pytest.raises(TypeError, match=r"`carry` as an int.*float 1.0"):
        eqxshard.StepLoop(lambda x: (x,), jnp.zeros(2), carry=1.0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"carry=2\)` must be between 0.*the 1 state"):
        eqxshard.StepLoop(lambda x: (x,), jnp.zeros(2), carry=2)
    loop = eqxshard.StepLoop(lambda a, b: a + b, jnp.zeros(2), jnp.zeros(2))
    with pytest.raises(TypeError, match=r"new state \(2 entries\), but it returns an array"):
        loop()
    short = eqxshard.StepLoop(lambda a, b: (a,), jnp.zeros(2), jnp.zeros(2))
    with pytest.raises(TypeError, match=r"\(2 entries\), but it returns a tuple of 1"):
        short()
    loop = eqxshard.StepLoop(lambda a, x: (a, x), jnp.zeros(2))
    with pytest.raises(ValueError, match=r"outside `jit`.*traced"):
        jax.jit(lambda x: loop(x))(jnp.ones(2))
    with pytest.raises(ValueError, match=r"outside `jit`.*traced"):
        jax.jit(lambda a: eqxshard.StepLoop(lambda a: (a,), a))(jnp.ones(2))

    class Unhashable:
        __hash__ = None  # pyright: ignore[reportAssignmentType]

    with pytest.raises(TypeError, match=r"must be hashable(.|\n)*args\.1.*Unhashable"):
        eqxshard.StepLoop(lambda a, s: (a, 0), jnp.zeros(2))(Unhashable())


def test_a_bound_method_runs_its_own_filter_jit_not_one_around_it():
    # `model.step` (decorated in the class body) is an `eqx.Partial` of its wrapper and the
    # module: the loop runs that wrapper, with its donation, once traced, and builds no
    # second `filter_jit` around it (nor for `filter_jit(model.step)`).
    from eqxshard._step import jit as call

    traces = []

    class M(eqx.Module):
        w: jax.Array

        @eqxshard.filter_jit(donate=(False, True, False))
        def step(self, c, x):
            traces.append(1)
            return c + self.w * x, jnp.sum(self.w * x)

        def plain(self, c, x):
            traces.append(1)
            return c + self.w * x, jnp.sum(self.w * x)

    m = M(jnp.arange(3.0))
    for step in (m.step, eqxshard.filter_jit(m.step)):
        call.SITES.clear()
        state = jnp.zeros(3)
        loop = eqxshard.StepLoop(step, state)
        losses = [loop(jnp.full(3, float(i))) for i in range(4)]
        assert len(traces) == 1 and len(call.SITES) == 1  # the second: JAX's cache
        assert state.is_deleted()  # the wrapper's own donation of `c`
        np.testing.assert_array_equal(loop.state[0], np.arange(3.0) * 6)
        assert [float(v) for v in losses] == [0.0, 3.0, 6.0, 9.0]
        assert not m.w.is_deleted()
    # A plain method, bound: one `filter_jit` of it, the module's arrays traced.
    traces.clear()
    call.SITES.clear()
    loop = eqxshard.StepLoop(m.plain, jnp.zeros(3))
    loop(jnp.ones(3))
    loop(jnp.ones(3))
    assert len(traces) == 1 and len(call.SITES) == 1
