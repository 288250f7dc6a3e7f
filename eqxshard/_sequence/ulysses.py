"""The `"all_to_all"` strategy (DeepSpeed-Ulysses): heads and sequence exchanged.

An `all_to_all` turns each device's block of the sequence for every head into the whole
sequence for `1/C` of the heads; each device attends those heads on one device, and a
second `all_to_all` turns the output back. The key/value heads are split the same way, so
each device gets the key heads its query heads use; where the key heads do not divide
over the axis (grouped-query attention with fewer key heads than devices), keys and values
are first repeated to one per query head. Each device holds `T x S` scores for its heads,
the caller's mask whole, and all segment ids. Gradients are JAX's. With dropout, each
device draws the factors of its heads' weights (each head by its global index).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .blocks import Across, Block, attend, dropout_factors


def ulysses_attention(
    across: Across, q: Any, k: Any, v: Any, mask: Any, seg: Any, key: Any = None
) -> Any:
    """A device's attention output `(B, Tq, G, R, Dv)` float32, from its plain blocks
    (`key`: where the dropout bits come from, a `Draw`; `None` without dropout)."""
    axis, size, causal, scale, dropout = across
    b, tq, g, r, dk = q.shape
    if g % size:  # one key head per query head: then the heads divide (checked before)
        k, v = (jnp.repeat(x, r, axis=2) for x in (k, v))
        q = q.reshape(b, tq, g * r, 1, dk)

    def heads_out(x: Any) -> Any:  # (B, T/C, heads, ...) -> (B, T, heads/C, ...)
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = heads_out(q), heads_out(k), heads_out(v)
    mask, seg = jax.lax.all_gather((mask, seg), axis, axis=1, tiled=True)
    (_, t, gh, rh, _), s = q.shape, k.shape[1]
    drop = None
    if key is not None:  # this device's heads, over the whole sequence
        first = key.head + jax.lax.axis_index(axis) * gh * rh
        drop = dropout_factors(key._replace(head=first), dropout, (b, gh, rh, t, s))
    block = Block(q, jnp.arange(t), seg, k, v, jnp.arange(s), seg, mask, drop)
    out = attend(block, causal=causal, scale=scale)
    out = jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
    return out.reshape(b, tq, g, r, out.shape[-1])
