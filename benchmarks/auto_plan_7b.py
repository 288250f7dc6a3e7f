"""`auto_plan` for the 7B decoder of docs/sizing.md on 512 devices, on this machine.

The decoder (Llama 7B's shapes: width 4096, 32 blocks, 32 heads, MLP 11008, a 32000-token
vocabulary), its blocks stacked and scanned, each under `jax.checkpoint`, trained with
AdamW on batches of 512 sequences of 2048 tokens; planned as shapes only
(`eqx.filter_eval_shape`) for an 80 GB accelerator. Meshes of more than `--compile-limit`
devices are estimated from compiles on at most that many. Prints the time it took and
the plan's table (docs/auto_plan.md shows it; benchmarks/results/auto_plan_7b_512.txt
holds a run).

    python benchmarks/auto_plan_7b.py [--devices 512] [--batch 512] [--compile-limit 8]
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import eqxshard  # noqa: E402

VOCAB, WIDTH, HIDDEN, HEADS, DEPTH, SEQ = 32000, 4096, 11008, 32, 32, 2048


class Block(eqx.Module):
    attention_norm: eqx.nn.RMSNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.attention_norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.mlp_norm = eqx.nn.RMSNorm(WIDTH, use_bias=False)
        self.gate = eqx.nn.Linear(WIDTH, HIDDEN, use_bias=False, key=k2)
        self.up = eqx.nn.Linear(WIDTH, HIDDEN, use_bias=False, key=k3)
        self.down = eqx.nn.Linear(HIDDEN, WIDTH, use_bias=False, key=k4)

    def __call__(self, x, mask):
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, h, h, mask=mask)
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
    parser.add_argument("--devices", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--compile-limit", type=int, default=8)
    args = parser.parse_args()
    model = eqx.filter_eval_shape(Decoder, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((args.batch, SEQ + 1), jnp.int32)
    start = time.perf_counter()
    plan = eqxshard.auto_plan(
        step,
        model,
        batch,
        devices=args.devices,
        budget="80GB",
        optimizer=optimizer,
        compile_limit=args.compile_limit,
    )
    print(f"auto_plan took {time.perf_counter() - start:.0f} s")
    print(plan)


if __name__ == "__main__":
    main()
