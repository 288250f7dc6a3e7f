"""The small transformer and the synthetic data that `train_fsdp.py` and
`train_tensor_parallel.py` train; how they are sharded is in those scripts.

Not an example itself (`tests/test_examples.py` skips files starting with `_`); the
scripts import it from their own folder, which Python puts on `sys.path` when it runs
them.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB, SEQ, WIDTH, HEADS, HIDDEN, DEPTH = 32, 16, 32, 4, 64, 2


class Block(eqx.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp_up: eqx.nn.Linear
    mlp_down: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(WIDTH)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.norm2 = eqx.nn.LayerNorm(WIDTH)
        self.mlp_up = eqx.nn.Linear(WIDTH, HIDDEN, key=k2)
        self.mlp_down = eqx.nn.Linear(HIDDEN, WIDTH, key=k3)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda v: self.mlp_down(jax.nn.gelu(self.mlp_up(v))))(h)


class Transformer(eqx.Module):
    embedding: eqx.nn.Embedding
    position: jax.Array
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, DEPTH + 3)
        self.embedding = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
        self.position = 0.02 * jax.random.normal(keys[1], (SEQ, WIDTH))
        self.blocks = [Block(k) for k in keys[3:]]
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.unembed = eqx.nn.Linear(WIDTH, VOCAB, key=keys[2])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embedding)(tokens) + self.position
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))  # causal
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def make_batch(rng: np.random.Generator, batch_size: int) -> np.ndarray:
    """Counting sequences with a random start and step: the next token is predictable."""
    start = rng.integers(0, VOCAB, size=(batch_size, 1))
    step = rng.integers(1, 4, size=(batch_size, 1))
    return ((start + step * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def loss_fn(model: Transformer, batch: jax.Array) -> jax.Array:
    """Next-token cross-entropy over a batch of token sequences of length `SEQ + 1`."""
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
