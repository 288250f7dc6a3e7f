"""The `"all_gather"` strategy: every device gathers all keys and values over the context
axis and attends its own queries to them. The simplest and, for short sequences, the
fastest; each device holds the whole sequence's keys and values and a `T/C x S` block of
scores. Gradients are JAX's (the gather's transpose is a reduce-scatter)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .blocks import Across, Block, attend, dropout_factors


def gather_attention(
    across: Across, q: Any, k: Any, v: Any, mask: Any, seg: Any, key: Any = None
) -> Any:
    """A device's attention output `(B, Tq, G, R, Dv)` float32, from its plain blocks
    (`key`: where the dropout bits come from, a `Draw`; `None` without dropout)."""
    axis, causal, scale, dropout = across.axis, across.causal, across.scale, across.dropout
    everything = jax.lax.all_gather((k, v, seg), axis, axis=1, tiled=True)
    k, v, kseg = everything
    (b, tq, g, r, _), s = q.shape, k.shape[1]
    me = jax.lax.axis_index(axis)
    qpos = me * tq + jnp.arange(tq)
    drop = None if key is None else dropout_factors(key, dropout, (b, g, r, tq, s), me)
    block = Block(q, qpos, seg, k, v, jnp.arange(s), kseg, mask, drop)
    return attend(block, causal=causal, scale=scale)
