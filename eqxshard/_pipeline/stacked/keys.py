"""Per-layer PRNG keys for a `Stacked` whose blocks take `key=` (as `eqx.nn` layers do).

One key is split into a key per layer (`jax.random.split(key, n)[i]` for layer `i`).
The key travels beside the activations as raw key data, and each layer splits it itself
by its index, which travels beside its weights: so the plain scan, its remat and the
pipeline (where a stage holds some layers and a microbatch some examples) give every
layer the same key, and a batch of per-example keys under `jax.vmap` is one more batched
input rather than something that stops the pipeline from seeing the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def takes_key(block: Any) -> bool:
    """Whether calling `block` accepts a `key=` keyword (or any keyword)."""
    try:
        parameters = inspect.signature(block).parameters.values()
    except (TypeError, ValueError):  # not callable, or a builtin without a signature
        return False
    return any(
        p.kind == p.VAR_KEYWORD or (p.name == "key" and p.kind != p.POSITIONAL_ONLY)
        for p in parameters
    )


def key_parts(key: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """`key` as raw data (arrays of `uint32`, which `where`, `psum` and collective permutes
    take) and the function that turns such data back into a key of `key`'s kind."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(key)
        return jax.random.key_data(key), lambda data: jax.random.wrap_key_data(data, impl=impl)
    return key, lambda data: data  # a raw `jax.random.PRNGKey`


def layer_key(wrap: Callable[[jax.Array], Any], data: jax.Array, n: int, index: Any) -> Any:
    """Layer `index`'s key of `n`, from the raw data of the stack's key."""
    return jax.random.split(wrap(data), n)[index]


def microbatch_keys(key: Any, batch: int, microbatches: int) -> jax.Array:
    """For a pipeline called on a batch: row `j`'s key data, that of
    `fold_in(key, j % microbatches)`, so that the rows of microbatch `m` (rows `m, m+M,
    ...`) share a key of their own."""
    rows = jnp.arange(batch) % microbatches
    return jax.vmap(lambda m: key_parts(jax.random.fold_in(key, m))[0])(rows)


def keyed_forms(wrap: Callable[[Any], Any], n: int) -> tuple[Any, Any, Any]:
    """The three forms of a layer whose block takes `key=`: its block comes with its layer
    index, `(block, i)`, and its input with the key's raw data, `(h, data)` (a microbatch
    on the caller's batch: its rows' shared key in each row)."""

    def one(bi: Any, hk: Any) -> Any:
        (block, i), (h, data) = bi, hk
        return block(h, key=layer_key(wrap, data, n, i)), data

    def rows(bi: Any, hk: Any) -> Any:
        (block, i), (h, data) = bi, hk
        return block(h, key=layer_key(wrap, data[0], n, i)), data

    def vmapped(bi: Any, hk: Any) -> Any:
        (block, i), (h, data) = bi, hk
        run = lambda h, d: block(h, key=layer_key(wrap, d, n, i))  # noqa: E731
        return jax.vmap(run)(h, data), data

    return one, rows, vmapped
