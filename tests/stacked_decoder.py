"""A small decoder whose blocks are an `eqxshard.Stacked`, and its training step: the model
the tests of plans with remat and pipeline choices use (`test_plan_stacked`,
`test_auto_plan_stages`); and one with two stacks of different widths (`TwoStacks`,
`test_auto_plan_remat_mix`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxshard

OPTIMIZER = optax.adamw(1e-2)


class Block(eqx.Module):
    """A residual MLP block on one example `(T, W)` (or a batch of them)."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(width, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, width, key=k2)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + jax.vmap(self.down)(jnp.tanh(jax.vmap(self.up)(h)))


class Decoder(eqx.Module):
    """Per example: `(T, D)` inputs, through `embed`, the stacked blocks and `head`."""

    embed: eqx.nn.Linear
    blocks: eqxshard.Stacked
    head: eqx.nn.Linear

    def __call__(self, x: Any) -> jax.Array:
        return jax.vmap(self.head)(self.blocks(jax.vmap(self.embed)(x)))


def make(key: jax.Array, *, d: int = 8, width: int = 32, hidden: int = 64, layers: int = 4):
    k1, k2, k3 = jax.random.split(key, 3)
    keys = jax.random.split(k2, layers)
    blocks = eqx.filter_vmap(lambda k: Block(width, hidden, k))(keys)
    return Decoder(
        eqx.nn.Linear(d, width, key=k1), eqxshard.Stacked(blocks), eqx.nn.Linear(width, d, key=k3)
    )


class TwoStacks(eqx.Module):
    """Per example: `(T, D)` inputs, through `embed`, a `wide` stack (a large hidden width:
    most of the activations), a `narrow` one, and `head`."""

    embed: eqx.nn.Linear
    wide: eqxshard.Stacked
    narrow: eqxshard.Stacked
    head: eqx.nn.Linear

    def __call__(self, x: Any) -> jax.Array:
        return jax.vmap(self.head)(self.narrow(self.wide(jax.vmap(self.embed)(x))))


def make_two(key: jax.Array, *, d: int = 8, width: int = 32) -> TwoStacks:
    """`wide`: 3 layers of hidden width 512; `narrow`: 5 layers of 64 (neither splits
    over 2 stages)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def stack(key: jax.Array, layers: int, hidden: int) -> eqxshard.Stacked:
        keys = jax.random.split(key, layers)
        return eqxshard.Stacked(eqx.filter_vmap(lambda k: Block(width, hidden, k))(keys))

    return TwoStacks(
        eqx.nn.Linear(d, width, key=k1),
        stack(k2, 3, 512),
        stack(k3, 5, 64),
        eqx.nn.Linear(width, d, key=k4),
    )


def loss_fn(model: Any, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def data(batch: int = 16, tokens: int = 4, d: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, tokens, d)).astype(np.float32)
    return x, np.tanh(x[..., ::-1]).copy()


def shapes(batch: int = 16, tokens: int = 4, d: int = 8) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((batch, tokens, d), jnp.float32),) * 2
