"""The tiny layer stack the pipeline tests compare against `jax.lax.scan`: `N` layers of
`tanh(h @ w + b)` on `D` features, the same weights in every test file that uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

D = 4  # features
N = 8  # layers


def layer(block, h):
    return jnp.tanh(h @ block["w"] + block["b"])


def blocks(n=N):
    w = jax.random.normal(jax.random.key(0), (n, D, D)) * 0.6
    b = jax.random.normal(jax.random.key(1), (n, D)) * 0.1
    return {"w": w, "b": b}
