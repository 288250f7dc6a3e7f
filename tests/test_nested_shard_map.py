"""`context_attention` and `Experts` nested in a `shard_map`.

Inside a pipelined `Stacked` (their `shard_map` over `context` / `expert` nested in the
pipeline's over `stage`), the forward pass and the gradients (whose lowering JAX gets
wrong for a nested `shard_map`, see `eqxshard._compat.nested`) are one device's, on
`(stage=2, context=4)` and `(stage=2, expert=4)`, with the mesh set or given to the
layers. Inside a `shard_map` already Manual over `context`, `context_attention` attends
each device's blocks where they are."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MoELayer
from jax.sharding import AxisType, PartitionSpec as P

import eqxshard
from eqxshard._experts.module import configured

AUTO = (AxisType.Auto,) * 2
WIDTH, T = 16, 32


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


def _sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))


class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention

    def __init__(self, key):
        self.attention = eqx.nn.MultiheadAttention(4, WIDTH, key=key)

    def __call__(self, h):  # h: (batch, T, WIDTH)
        return jax.vmap(lambda x: x + self.attention(x, x, x))(h)


@pytest.mark.parametrize(
    ("strategy", "causal", "given"), [("ring", True, False), ("all_to_all", False, True)]
)
def test_context_attention_in_a_pipelined_stack_trains_as_one_device(strategy, causal, given):
    mesh = jax.make_mesh((2, 4), ("stage", "context"), axis_types=AUTO)
    blocks = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 2))
    # The reference: the unsplit layers, causal as the converted ones are.
    plain = eqxshard.Stacked(blocks)
    plain = eqxshard.context_parallel(plain, strategy="all_gather", causal=causal)
    one = jax.make_mesh((1, 1), ("stage", "context"), axis_types=AUTO, devices=jax.devices()[:1])
    piped = eqxshard.Stacked(blocks, axis="stage", microbatches=2)
    piped = eqxshard.context_parallel(
        piped, strategy=strategy, causal=causal, mesh=mesh if given else None
    )
    x = jax.random.normal(jax.random.key(1), (4, T, WIDTH))
    loss = lambda m, x: jnp.mean(m(x) ** 2)
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    for _ in range(2):  # two steps of SGD: the losses and the gradients match
        with jax.set_mesh(one):
            value_ref, grads_ref = step(plain, x)
        with jax.set_mesh(mesh):
            value, grads = step(piped, x)
        _close(value, value_ref)
        _close(eqx.filter(grads, eqx.is_array), eqx.filter(grads_ref, eqx.is_array))
        plain, piped = _sgd(plain, grads_ref), _sgd(piped, grads)


D, HIDDEN, E = 8, 16, 8


def MoEBlock(key, mesh) -> MoELayer:
    return MoELayer(key, width=D, hidden=HIDDEN, experts=E, mesh=mesh)


@pytest.mark.parametrize("given", [False, True])
def test_experts_in_a_pipelined_stack_have_one_devices_gradients(given):
    mesh = jax.make_mesh((2, 4), ("stage", "expert"), axis_types=AUTO)
    make = lambda k: MoEBlock(k, mesh if given else None)
    blocks = eqx.filter_jit(eqx.filter_vmap(make))(jax.random.split(jax.random.key(0), 2))
    plain = configured(eqxshard.Stacked(blocks), axis=None, mesh=None)
    piped = eqxshard.Stacked(blocks, axis="stage", microbatches=2)
    x = jax.random.normal(jax.random.key(1), (32, D))
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value_ref, grads_ref = grad(plain, x)
    with jax.set_mesh(mesh):
        value, grads = grad(piped, x)
        gx = eqx.filter_jit(jax.grad(loss, argnums=1))(piped, x)
    _close(value, value_ref)
    _close(eqx.filter(grads, eqx.is_array), eqx.filter(grads_ref, eqx.is_array))
    _close(gx, jax.grad(loss, argnums=1)(plain, x))


@pytest.mark.parametrize(("strategy", "causal"), [("ring", True), ("all_to_all", False)])
def test_context_attention_inside_a_shard_map_over_its_axis_attends_the_blocks_there(
    strategy, causal
):
    # Inside `filter_shard_map` Manual over ('data', 'context'), each device holds its
    # examples' block of the sequence: `context_attention` attends those blocks where they
    # are (no `shard_map` of its own) and gives the blocks of the attention computed whole.
    mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=AUTO)
    q, k, v = jax.random.normal(jax.random.key(2), (3, 4, T, 4, 8))
    mask = jax.random.bernoulli(jax.random.key(3), 0.8, (4, T, T))
    split = P("data", "context")
    options = {"strategy": strategy, "causal": causal, "mesh": mesh}

    def inside(q, k, v, mask):
        attend = lambda q, k, v, mask: eqxshard.context_attention(q, k, v, mask=mask, **options)
        return eqxshard.filter_shard_map(
            attend, mesh=mesh, in_specs=(split, split, split, split), out_specs=split
        )(q, k, v, mask)

    def whole(q, k, v, mask):
        return eqxshard.context_attention(q, k, v, mask=mask, **options)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    grads = eqx.filter_jit(jax.value_and_grad(loss(inside), argnums=(0, 1, 2)))
    grads_ref = eqx.filter_jit(jax.value_and_grad(loss(whole), argnums=(0, 1, 2)))
    _close(eqx.filter_jit(inside)(q, k, v, mask), whole(q, k, v, mask))
    _close(grads(q, k, v, mask), grads_ref(q, k, v, mask))


def test_context_attention_inside_a_shard_map_needs_its_heads_axis_manual_too():
    mesh = jax.make_mesh((2, 4), ("model", "context"), axis_types=AUTO)
    q = jnp.ones((2, T, 4, 8))

    def attend(q):
        return eqxshard.context_attention(q, q, q, mesh=mesh, heads_axis="model")

    mapped = eqxshard.filter_shard_map(
        attend,
        mesh=mesh,
        in_specs=P(None, "context"),
        out_specs=P(None, "context"),
        axis_names={"context"},
    )
    with pytest.raises(ValueError, match=r"`heads_axis=.model.`, which that `shard_map` leaves"):
        jax.eval_shape(mapped, q)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_inside_a_shard_map_over_its_axis_runs_each_devices_experts_and_tokens(
    capacity_factor,
):
    # Inside `filter_shard_map` Manual over ('data', 'expert'), each device holds its E/4
    # experts and its tokens: `moe` dispatches them where they are and gives the outputs
    # (and the count of dropped assignments) of the call outside.
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=AUTO)
    make = lambda k: eqx.nn.MLP(D, D, HIDDEN, 1, key=k)
    experts = eqx.filter_vmap(make)(jax.random.split(jax.random.key(4), E))
    x = jax.random.normal(jax.random.key(5), (64, D))
    weights, indices = jax.lax.top_k(jax.nn.softmax(x @ jnp.ones((D, E)) + x[:, :E]), 2)
    expert = lambda block, h: jax.vmap(block)(h)
    options = {"mesh": mesh, "capacity_factor": capacity_factor, "return_dropped": True}
    tokens = P(("data", "expert"))

    def inside(experts, x, weights):
        run = lambda e, x, i, w: eqxshard.moe(expert, e, x, i, w, **options)
        return eqxshard.filter_shard_map(
            run, mesh=mesh, in_specs=(P("expert"), tokens, tokens, tokens), out_specs=(tokens, P())
        )(experts, x, indices, weights)

    def whole(experts, x, weights):
        return eqxshard.moe(expert, experts, x, indices, weights, **options)

    (y, dropped), (y_ref, dropped_ref) = inside(experts, x, weights), whole(experts, x, weights)
    _close(y, y_ref)
    assert int(dropped) == int(dropped_ref) and (capacity_factor is None) == (int(dropped) == 0)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)[0]))
    grad = lambda f: eqx.filter_jit(eqx.filter_grad(lambda a: loss(f)(*a)))
    _close(grad(inside)((experts, x, weights)), grad(whole)((experts, x, weights)))


def test_moe_inside_a_shard_map_takes_only_its_axes_as_data_axes():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=AUTO)
    experts = jnp.ones((E, D, D))
    x, indices = jnp.ones((16, D)), jnp.zeros((16, 2), jnp.int32)
    run = lambda e, x, i: eqxshard.moe(
        lambda w, h: h @ w, e, x, i, jnp.ones(i.shape), mesh=mesh, data_axes="data"
    )
    mapped = eqxshard.filter_shard_map(
        run,
        mesh=mesh,
        in_specs=(P("expert"), P("expert"), P("expert")),
        out_specs=P("expert"),
        axis_names={"expert"},
    )
    with pytest.raises(ValueError, match=r"but that `shard_map` leaves \['data'\] to the compiler"):
        jax.eval_shape(mapped, experts, x, indices)
