"""The experts of an `Experts` with `axis=None`: not laid out over any axis, every
expert run on every token where the tokens are (what `auto_plan` weighs for the layouts
without an expert axis, and what a plan without one runs)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .dispatch import rank_within


def unsplit(
    expert: Callable[[Any, jax.Array], jax.Array],
    blocks: Any,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    capacity_factor: float | None,
) -> tuple[jax.Array, jax.Array]:
    """`y[n] = sum_j weights[n, j] * expert(blocks[indices[n, j]], x[n])`, every expert
    computed on every token (`E` times the work of one, no collective of its own: the
    compiler lays it out as the tokens and experts are), and how many assignments were
    dropped. With a `capacity_factor` `c`, GShard's rule over the `N` tokens as one group:
    each expert takes its first `ceil(c * N * k / E)` assignments, in order of tokens,
    then of choices."""
    params, static = eqx.partition(blocks, eqx.is_array)
    every = jax.vmap(lambda p: expert(eqx.combine(p, static), x))(params)  # (E, N, D_out)
    n, k = indices.shape
    picked = every[indices, jnp.arange(n)[:, None]]  # (N, k, D_out)
    if capacity_factor is None:
        return jnp.einsum("nk,nkd->nd", weights, picked), jnp.zeros((), jnp.int32)
    e = every.shape[0]
    capacity = math.ceil(capacity_factor * n * k / e)
    flat = indices.reshape(n * k).astype(jnp.int32)
    keep = (rank_within(flat, e) < capacity).reshape(n, k)
    y = jnp.einsum("nk,nkd->nd", jnp.where(keep, weights, 0), picked)
    return y, jnp.sum(~keep, dtype=jnp.int32)
