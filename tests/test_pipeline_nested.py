"""`context_attention` and `Experts` inside a pipelined `Stacked`: their `shard_map` over
`context` / `expert` nested in the pipeline's over `stage`. The forward pass and the
gradients (whose lowering JAX gets wrong for a nested `shard_map`, see
`eqxshard._compat.nested`) are one device's, on `(stage=2, context=4)` and
`(stage=2, expert=4)`, with the mesh set or given to the layers."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

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


class MoEBlock(eqx.Module):
    router: eqx.nn.Linear
    experts: eqxshard.Experts

    def __init__(self, key, mesh):
        k1, k2 = jax.random.split(key)
        self.router = eqx.nn.Linear(D, E, use_bias=False, key=k1)
        make = lambda k: eqx.nn.MLP(D, D, HIDDEN, 1, key=k)
        self.experts = eqxshard.Experts(eqx.filter_vmap(make)(jax.random.split(k2, E)), mesh=mesh)

    def __call__(self, h):
        weights, indices = jax.lax.top_k(jax.nn.softmax(jax.vmap(self.router)(h)), 2)
        return h + self.experts(jax.nn.relu(h), indices, weights)


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
