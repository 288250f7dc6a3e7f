"""The zoo's models and, for each, its batch, its loss and a uniform training step.

Every model is driven the same way: `loss(model, state, batch, key) -> (loss, state)`,
where `state` is an `eqx.nn.State` for a model with one and `None` otherwise, and `key`
is a PRNG key (used by the models with dropout). `Zoo` entries bundle a constructor,
a batch maker and the loss, so that the tests are written once for all models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


class TiedAttention(eqx.Module):
    """A one-block language model: token embedding, attention with rotary position
    embeddings, a layer norm, dropout, and an output head tied to the embedding."""

    tied: eqx.nn.Shared
    attention: eqx.nn.MultiheadAttention
    rope: eqx.nn.RotaryPositionalEmbedding
    norm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, vocab: int = 64, width: int = 16, heads: int = 2, *, key: Any):
        k_embed, k_head, k_attention = jax.random.split(key, 3)
        embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        head = eqx.nn.Linear(width, vocab, use_bias=False, key=k_head)
        # The head's weight *is* the embedding table: one array, two uses.
        self.tied = eqx.nn.Shared(
            (embedding, head), lambda pair: pair[1].weight, lambda pair: pair[0].weight
        )
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k_attention)
        self.rope = eqx.nn.RotaryPositionalEmbedding(width // heads)
        self.norm = eqx.nn.LayerNorm(width)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, tokens: jax.Array, *, key: Any) -> jax.Array:
        embedding, head = self.tied()
        x = jax.vmap(embedding)(tokens)

        def rotate(
            q: jax.Array, k: jax.Array, v: jax.Array
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            by_head = jax.vmap(self.rope, in_axes=1, out_axes=1)
            return by_head(q), by_head(k), v

        x = x + self.attention(x, x, x, process_heads=rotate)
        x = self.dropout(jax.vmap(self.norm)(x), key=key)
        return jax.vmap(head)(x)


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    def __init__(self, width: int, *, key: Any):
        self.norm = eqx.nn.LayerNorm(width)
        self.linear = eqx.nn.Linear(width, width, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jax.nn.gelu(self.linear(self.norm(x)))


class ScannedStack(eqx.Module):
    """`depth` residual blocks stored as one stacked block (built by `eqx.filter_vmap`,
    every array leaf with a leading `depth` dim) and run by `jax.lax.scan`."""

    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, width: int = 32, depth: int = 3, *, key: Any):
        keys = jax.random.split(key, depth + 1)
        self.blocks = eqx.filter_vmap(lambda k: Block(width, key=k))(keys[:depth])
        self.head = eqx.nn.Linear(width, "scalar", key=keys[depth])

    def __call__(self, x: jax.Array) -> jax.Array:
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x: jax.Array, block_params: Any) -> tuple[jax.Array, None]:
            return eqx.combine(block_params, static)(x), None

        x, _ = jax.lax.scan(layer, x, params)
        return self.head(x)


class ConvNet(eqx.Module):
    """A convolution, batch norm (running statistics in an `eqx.nn.State`), pooling and a
    linear classifier."""

    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, channels: int = 8, features: int = 16, classes: int = 8, *, key: Any):
        k_conv, k_head = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(channels, features, 3, padding=1, key=k_conv)
        self.norm = eqx.nn.BatchNorm(features, axis_name="batch", mode="ema")
        self.head = eqx.nn.Linear(features, classes, key=k_head)

    def __call__(self, image: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, Any]:
        x, state = self.norm(self.conv(image), state)
        return self.head(jax.nn.relu(x).mean(axis=(1, 2))), state


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def tied_loss(model: TiedAttention, state: None, batch: Any, key: Any) -> tuple[Any, None]:
    tokens = batch
    logits = jax.vmap(lambda t: model(t, key=key))(tokens)  # one dropout mask for all rows
    return _cross_entropy(logits[:, :-1], tokens[:, 1:]), state


def stack_loss(model: ScannedStack, state: None, batch: Any, key: Any) -> tuple[Any, None]:
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2), state


def conv_loss(model: ConvNet, state: Any, batch: Any, key: Any) -> tuple[Any, Any]:
    images, labels = batch
    logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        images, state
    )
    return _cross_entropy(logits, labels), state


def tied_predict(model: TiedAttention, state: None, row: Any) -> jax.Array:
    return eqx.nn.inference_mode(model)(row, key=None)


def stack_predict(model: ScannedStack, state: None, row: Any) -> jax.Array:
    return model(row[0])


def conv_predict(model: ConvNet, state: Any, row: Any) -> jax.Array:
    return eqx.nn.inference_mode(model)(row[0], state)[0]  # the running statistics


@dataclass(frozen=True)
class Zoo:
    """One model of the zoo: how to make it (and its state), a batch, its loss, and its
    prediction for one row of a batch (in inference mode)."""

    name: str
    make: Callable[[Any], tuple[Any, Any]]  # key -> (model, state or None)
    batch: Callable[[int], Any]  # rows -> a batch of host NumPy arrays
    loss: Callable[..., tuple[Any, Any]]
    predict: Callable[[Any, Any, Any], jax.Array]

    def __repr__(self) -> str:
        return self.name


def _tokens(rows: int) -> Any:
    return np.random.default_rng(0).integers(0, 64, size=(rows, 8)).astype(np.int32)


def _vectors(rows: int) -> Any:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(rows, 32)).astype(np.float32)
    return x, np.tanh(x.sum(1) / 4).astype(np.float32)


def _images(rows: int) -> Any:
    rng = np.random.default_rng(2)
    images = rng.normal(size=(rows, 8, 6, 6)).astype(np.float32)
    return images, rng.integers(0, 8, size=rows).astype(np.int32)


ZOO = [
    Zoo(
        "tied_attention",
        lambda key: (TiedAttention(key=key), None),
        _tokens,
        tied_loss,
        tied_predict,
    ),
    Zoo(
        "scanned_stack",
        lambda key: (ScannedStack(key=key), None),
        _vectors,
        stack_loss,
        stack_predict,
    ),
    Zoo(
        "conv_batchnorm",
        lambda key: eqx.nn.make_with_state(ConvNet)(key=key),
        _images,
        conv_loss,
        conv_predict,
    ),
]
