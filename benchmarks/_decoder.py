"""The decoders `auto_plan_7b.py` and `auto_plan_70b.py` plan (Llama's shapes), and their
training step: blocks stacked by `eqx.filter_vmap` in an `eqxshard.Stacked` (one scan, each
layer rematerialised in full, as under `jax.checkpoint`; `auto_plan` can also pipeline it
over a `stage` axis); an RMSNorm before attention and before a SiLU-gated MLP."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxshard


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's sizes. `kv_heads=None`: `eqx.nn.MultiheadAttention` (every head its own
    keys and values); else grouped-query attention, `heads // kv_heads` query heads
    sharing each key/value head."""

    vocab: int
    width: int
    hidden: int
    heads: int
    depth: int
    seq: int
    kv_heads: int | None = None


class GroupedAttention(eqx.Module):
    """Causal self-attention with `kv_heads` key/value heads shared by `heads` query heads."""

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, shape: Shape, key):
        assert shape.kv_heads is not None
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.heads, self.kv_heads = shape.heads, shape.kv_heads
        kv = shape.kv_heads * (shape.width // shape.heads)
        self.query_proj = eqx.nn.Linear(shape.width, shape.width, use_bias=False, key=k1)
        self.key_proj = eqx.nn.Linear(shape.width, kv, use_bias=False, key=k2)
        self.value_proj = eqx.nn.Linear(shape.width, kv, use_bias=False, key=k3)
        self.output_proj = eqx.nn.Linear(shape.width, shape.width, use_bias=False, key=k4)

    def __call__(self, x, mask):
        n, width = x.shape
        head_dim = width // self.heads
        q = jax.vmap(self.query_proj)(x).reshape(n, self.heads, head_dim)
        k = jax.vmap(self.key_proj)(x).reshape(n, self.kv_heads, head_dim)
        v = jax.vmap(self.value_proj)(x).reshape(n, self.kv_heads, head_dim)
        k = jnp.repeat(k, self.heads // self.kv_heads, axis=1)
        v = jnp.repeat(v, self.heads // self.kv_heads, axis=1)
        logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v).reshape(n, width)
        return jax.vmap(self.output_proj)(out)


class Block(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention | GroupedAttention
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, shape: Shape, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        width, hidden = shape.width, shape.hidden
        self.attention_norm = eqx.nn.RMSNorm(width, use_bias=False)
        if shape.kv_heads is None:
            self.attention = eqx.nn.MultiheadAttention(shape.heads, width, key=k1)
        else:
            self.attention = GroupedAttention(shape, k1)
        self.mlp_norm = eqx.nn.RMSNorm(width, use_bias=False)
        self.gate = eqx.nn.Linear(width, hidden, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(width, hidden, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(hidden, width, use_bias=False, key=k4)

    def __call__(self, x):
        mask = jnp.tril(jnp.ones((x.shape[0],) * 2, bool))
        h = jax.vmap(self.attention_norm)(x)
        if isinstance(self.attention, eqx.nn.MultiheadAttention):
            x = x + self.attention(h, h, h, mask=mask)
        else:
            x = x + self.attention(h, mask)
        h = jax.vmap(self.mlp_norm)(x)
        mlp = lambda v: self.down(jax.nn.silu(self.gate(v)) * self.up(v))
        return x + jax.vmap(mlp)(h)


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    layers: eqxshard.Stacked  # `depth` blocks stacked: scanned over, or pipelined
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, shape: Shape, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(shape.vocab, shape.width, key=k1)
        blocks = eqx.filter_vmap(lambda k: Block(shape, k))(jax.random.split(k2, shape.depth))
        # Each layer keeps only its input for the backward pass and recomputes the rest.
        self.layers = eqxshard.Stacked(blocks, remat="full")
        self.norm = eqx.nn.RMSNorm(shape.width, use_bias=False)
        self.head = eqx.nn.Linear(shape.width, shape.vocab, use_bias=False, key=k3)

    def __call__(self, tokens):
        x = self.layers(jax.vmap(self.embed)(tokens))
        return jax.vmap(lambda v: self.head(self.norm(v)))(x)


optimizer = optax.adamw(3e-4)


def step(model, opt_state, batch):
    def loss_fn(model):
        logits = jax.vmap(model)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss
