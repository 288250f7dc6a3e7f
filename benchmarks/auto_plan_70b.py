"""`auto_plan` for a 70B decoder on 1024 devices of 8 per node, on this machine.

The decoder has Llama-2-70B's shapes: width 8192, 80 blocks, 64 query heads sharing 8
key/value heads (grouped-query attention, heads of 128), an MLP of 28672 with a SiLU
gate, a 32000-token vocabulary; 68.98 billion parameters. Its blocks are stacked and
scanned, each under `jax.checkpoint`, trained with AdamW on batches of 1024 sequences of
4096 tokens (4M tokens a step), planned as shapes only (`eqx.filter_eval_shape`) for an
80 GB accelerator, with 8 devices a node (`devices_per_node=8`: the mesh axes that span
nodes get the `inter_node` link). Meshes of more than `--compile-limit` devices are
estimated from compiles on at most that many. Prints the time it took and the plan's
table (docs/sizing.md shows it; benchmarks/results/auto_plan_70b_1024.txt holds a run).

    python benchmarks/auto_plan_70b.py [--devices 1024] [--batch 1024] [--compile-limit 8]
"""

from __future__ import annotations

import argparse
import math
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import eqxshard  # noqa: E402

VOCAB, WIDTH, HIDDEN, DEPTH, SEQ = 32000, 8192, 28672, 80, 4096
HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128


class Attention(eqx.Module):
    """Causal self-attention with 8 key/value heads shared by 64 query heads."""

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        kv = KV_HEADS * HEAD_DIM
        self.query_proj = eqx.nn.Linear(WIDTH, WIDTH, use_bias=False, key=k1)
        self.key_proj = eqx.nn.Linear(WIDTH, kv, use_bias=False, key=k2)
        self.value_proj = eqx.nn.Linear(WIDTH, kv, use_bias=False, key=k3)
        self.output_proj = eqx.nn.Linear(WIDTH, WIDTH, use_bias=False, key=k4)

    def __call__(self, x, mask):
        n = x.shape[0]
        q = jax.vmap(self.query_proj)(x).reshape(n, HEADS, HEAD_DIM)
        k = jax.vmap(self.key_proj)(x).reshape(n, KV_HEADS, HEAD_DIM)
        v = jax.vmap(self.value_proj)(x).reshape(n, KV_HEADS, HEAD_DIM)
        k = jnp.repeat(k, HEADS // KV_HEADS, axis=1)
        v = jnp.repeat(v, HEADS // KV_HEADS, axis=1)
        logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v).reshape(n, WIDTH)
        return jax.vmap(self.output_proj)(out)


class Block(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    attention: Attention
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attention_norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.attention = Attention(k1)
        self.mlp_norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.gate = eqx.nn.Linear(WIDTH, HIDDEN, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, use_bias=False, key=k4)

    def __call__(self, x, mask):
        x = x + self.attention(jax.vmap(self.attention_norm)(x), mask)
        h = jax.vmap(self.mlp_norm)(x)
        mlp = lambda v: self.down(jax.nn.silu(self.gate(v)) * self.up(v))
        return x + jax.vmap(mlp)(h)


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    layers: Block  # DEPTH blocks stacked: scanned over
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
        self.layers = eqx.filter_vmap(Block)(jax.random.split(k2, DEPTH))
        self.norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.head = eqx.nn.Linear(WIDTH, VOCAB, use_bias=False, key=k3)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
        params, static = eqx.partition(self.layers, eqx.is_array)

        @jax.checkpoint  # keep one activation per layer; recompute the rest
        def body(x, p):
            return eqx.combine(p, static)(x, mask), None

        x, _ = jax.lax.scan(body, x, params)
        return jax.vmap(lambda v: self.head(self.norm(v)))(x)


optimizer = optax.adamw(3e-4)


def step(model, opt_state, batch):
    def loss_fn(model):
        logits = jax.vmap(model)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--compile-limit", type=int, default=8)
    args = parser.parse_args()
    model = eqx.filter_eval_shape(Decoder, jax.random.key(0))
    count = sum(x.size for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct))
    batch = jax.ShapeDtypeStruct((args.batch, SEQ + 1), jnp.int32)
    start = time.perf_counter()
    plan = eqxshard.auto_plan(
        step,
        model,
        batch,
        devices=args.devices,
        devices_per_node=8,
        budget="80GB",
        optimizer=optimizer,
        compile_limit=args.compile_limit,
    )
    print(f"{count:,} parameters; auto_plan took {time.perf_counter() - start:.0f} s")
    print(plan)


if __name__ == "__main__":
    main()
