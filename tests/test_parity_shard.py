"""Parity: `filter_shard` against `eqx.filter_shard`, same cases through both.

`filter_shard(tree, device_or_shardings)` is a drop-in replacement for `eqx.filter_shard`
wherever that one works: equal values, equal output shardings, same `committed`, and the
very same non-array objects, eagerly and inside `eqx.filter_jit`. The cases are Equinox's
own sharding test and its autoparallelism example, and each form of `device_or_shardings`.
Where eqxshard deliberately differs (it places on Explicit meshes and across device sets,
where `eqx.filter_shard` raises), the test says so and asserts eqxshard's behaviour.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import eqxshard


def mlp():
    """An `eqx.nn.MLP` with small deterministic weights: its structure from
    `filter_eval_shape` (random init compiles slowly on a busy CPU), values filled in."""
    shapes = eqx.filter_eval_shape(eqx.nn.MLP, 4, 4, 8, 2, key=jax.random.key(0))

    def fill(s):
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s  # the activation functions and other statics, as built
        return jnp.linspace(-0.5, 0.5, int(np.prod(s.shape)), dtype=s.dtype).reshape(s.shape)

    return jax.tree.map(fill, shapes)


def assert_same(out, expected, tree):
    """Equal values, shardings and `committed`; non-array leaves the very same objects."""
    out_leaves, out_def = jax.tree_util.tree_flatten(out)
    exp_leaves, exp_def = jax.tree_util.tree_flatten(expected)
    assert out_def == exp_def
    for a, b, x in zip(out_leaves, exp_leaves, jax.tree_util.tree_leaves(tree), strict=True):
        if not eqx.is_array(b):
            assert a is b is x
            continue
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        assert a.committed == b.committed


def _targets(mesh):
    named = lambda *spec: NamedSharding(mesh, P(*spec))
    return {
        "device": jax.devices()[2],
        "single_device": SingleDeviceSharding(jax.devices()[3]),
        "replicated": named(),
        "split": named("data"),
        "split_2d": named("data", "model"),
        # Issue 9 item 5: outside `jit` an unconstrained dim is left unsplit, as in Equinox.
        "unconstrained": named(P.UNCONSTRAINED, "model"),
        "prefix_tree": {"w": named("data", "model"), "b": named("model"), "act": named()},
    }


IDS = list(_targets(make_mesh("auto")))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("target_id", IDS)
def test_same_as_equinox(target_id, jit):
    mesh = make_mesh("auto")  # Auto axes: the meshes `eqx.filter_shard` works on
    target = _targets(mesh)[target_id]
    tree = {
        "w": jnp.arange(32.0).reshape(8, 4),
        "b": jnp.arange(16.0).reshape(8, 2),
        "act": jax.nn.relu,
    }
    ours = lambda t: eqxshard.filter_shard(t, target)
    theirs = lambda t: eqx.filter_shard(t, target)
    if jit:
        ours, theirs = eqx.filter_jit(ours), eqx.filter_jit(theirs)
    assert_same(ours(tree), theirs(tree), tree)


def test_equinox_sharding_test():
    """Equinox's `tests/test_sharding.py`: an MLP committed to one CPU device."""
    [cpu, *_] = jax.local_devices(backend="cpu")
    sharding = SingleDeviceSharding(cpu)
    model = mlp()
    out, expected = eqxshard.filter_shard(model, sharding), eqx.filter_shard(model, sharding)
    assert_same(out, expected, model)
    assert all(
        x.committed and x.sharding == sharding
        for x in jax.tree.leaves(eqx.filter(out, eqx.is_array))
    )


def test_equinox_autoparallelism_example():
    """Equinox's autoparallelism example: a replicated model, a batch split over 'batch',
    one `filter_jit` train step constraining its outputs; run with each library."""
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    split, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    x = jnp.linspace(-1, 1, 64 * 4).reshape(64, 4)
    y = jnp.sin(x)
    optim = optax.adam(1e-2)

    def run(filter_shard):
        model = filter_shard(mlp(), replicated)
        opt_state = optim.init(eqx.filter(model, eqx.is_array))
        xs, ys = filter_shard((x, y), split)

        @eqx.filter_jit
        def step(model, opt_state, xs, ys):
            xs, ys = filter_shard((xs, ys), split)
            model, opt_state = filter_shard((model, opt_state), replicated)
            loss, grads = eqx.filter_value_and_grad(
                lambda m: jnp.mean((jax.vmap(m)(xs) - ys) ** 2)
            )(model)
            updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            model = eqx.apply_updates(model, updates)
            return filter_shard((model, opt_state), replicated), loss

        loss = None
        for _ in range(2):
            (model, opt_state), loss = step(model, opt_state, xs, ys)
        return model, loss, xs

    ours, theirs = run(eqxshard.filter_shard), run(eqx.filter_shard)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        if eqx.is_array(a):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        else:
            assert a is b


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_unconstrained_dim(jit):
    """Issue 9 item 5 on its own: `P(P.UNCONSTRAINED, 'model')` gives `P(None, 'model')`."""
    mesh = make_mesh("auto")
    sharding = NamedSharding(mesh, P(P.UNCONSTRAINED, "model"))
    f = lambda t: eqxshard.filter_shard(t, sharding)
    out = (jax.jit(f) if jit else f)(jnp.ones((8, 4)))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_explicit_mesh_deliberately_differs(jit):
    """Deliberate difference: on Explicit axes (`jax.make_mesh`'s default from jax 0.9)
    `eqx.filter_shard` raises (its `with_sharding_constraint` refers only to Auto axes);
    eqxshard lays the leaves out (a `device_put` outside `jit`, a reshard inside)."""
    mesh = make_mesh("explicit")
    sharding = NamedSharding(mesh, P("data", "model"))
    tree = {"w": jnp.arange(32.0).reshape(8, 4), "act": jax.nn.relu}
    wrap = eqx.filter_jit if jit else (lambda f: f)
    with pytest.raises(ValueError, match="Auto"):
        wrap(lambda t: eqx.filter_shard(t, sharding))(tree)
    out = wrap(lambda t: eqxshard.filter_shard(t, sharding))(tree)
    assert out["act"] is jax.nn.relu
    assert out["w"].sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(out["w"], tree["w"])


def test_move_across_device_sets_deliberately_differs():
    """Deliberate difference: outside `jit` eqxshard moves a committed array to another
    device set (one `device_put`); `eqx.filter_shard`'s `with_sharding_constraint` raises."""
    x = jax.device_put(jnp.arange(8.0), jax.devices()[0])
    target = NamedSharding(
        jax.make_mesh(
            (4,), ("data",), devices=jax.devices()[4:], axis_types=(jax.sharding.AxisType.Auto,)
        ),
        P("data"),
    )
    with pytest.raises(ValueError, match="incompatible devices"):
        eqx.filter_shard(x, target)
    out = eqxshard.filter_shard(x, target)
    assert out.sharding.is_equivalent_to(target, 1)
    np.testing.assert_array_equal(out, np.arange(8.0))
