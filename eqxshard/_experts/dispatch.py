"""The expert-parallel dispatch, per device inside `jax.shard_map`, in the order it runs:

1. `pack`: each device's (token, choice) assignments, in order of tokens then choices,
   written into one buffer per destination device (`dest = expert // per_device`) at
   the slot `slot_of` gives them; dropped assignments nowhere.
2. `lax.all_to_all` over the expert axis: each device now holds the rows every device
   sent it.
3. `run_experts`: its local experts on those rows.
4. `lax.all_to_all` back, each row to the device (and slot) it came from.
5. `combine`: `y[n] = sum_j weights[n, j] * row(n, j)`.

Slots. Dropless (`capacity=None`): the buffer to each destination has `n_local * k`
rows (every local assignment could go to one device), and an assignment's slot is its
rank among the local assignments to that device; each device runs each of its local
experts on every row it received and keeps, per row, the output of the expert the row was
sent to: exact, at `A * n_local * k` rows of buffer and `E/A` times the expert work of
those rows. With a capacity `C` per expert (GShard: `ceil(c * n_local * k / E)`), the
buffer to each destination holds `E/A` blocks of `C` rows, one per local expert, and an
assignment's slot is `local_expert * C + its rank among the local assignments to its
expert`; assignments ranked `C` or later are dropped. Each expert then runs on its own
`A * C` rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .checks import Problem


def rank_within(groups: jax.Array, count: int) -> jax.Array:
    """For each entry of `groups` (ints in `[0, count)`), how many earlier entries share
    its group: its place in order within its group."""
    onehot = jax.nn.one_hot(groups, count, dtype=jnp.int32)
    before = jnp.cumsum(onehot, axis=0) - onehot
    return jnp.take_along_axis(before, groups[:, None], axis=1)[:, 0]


def slot_of(experts: jax.Array, p: Problem) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each local assignment's destination device, its slot in the buffer to it, and
    whether it is kept (`experts`: the flat `(n_local * k,)` expert numbers)."""
    dest = experts // p.per_device
    capacity = p.capacity
    if capacity is None:
        return dest, rank_within(dest, p.mesh.shape[p.axis]), jnp.ones(dest.shape, bool)
    rank = rank_within(experts, p.n_experts)
    keep = rank < capacity
    return dest, (experts % p.per_device) * capacity + rank, keep


def rows_per_destination(p: Problem) -> int:
    """The rows of the buffer each device sends each other device."""
    capacity = p.capacity
    return p.local * p.k if capacity is None else p.per_device * capacity


def pack(
    values: jax.Array, dest: jax.Array, slot: jax.Array, keep: jax.Array, p: Problem
) -> jax.Array:
    """`values` (one row per assignment) written into `(A, rows, ...)` buffers at
    `[dest, slot]`; dropped assignments are left out (their slot is past the end)."""
    a, rows = p.mesh.shape[p.axis], rows_per_destination(p)
    slot = jnp.where(keep, slot, rows)
    buffer = jnp.zeros((a, rows, *values.shape[1:]), values.dtype)
    return buffer.at[dest, slot].set(values, mode="drop")


def run_experts(
    expert: Callable[[Any, jax.Array], jax.Array],
    blocks: Any,
    received: jax.Array,
    local_expert: jax.Array,
    p: Problem,
) -> jax.Array:
    """This device's `E/A` experts on the rows it received, `(A, rows, D)` in and out."""
    a, rows = received.shape[:2]
    params, static = eqx.partition(blocks, eqx.is_array)

    def one(params_i: Any, h: jax.Array) -> jax.Array:
        return expert(eqx.combine(params_i, static), h)

    capacity = p.capacity
    if capacity is not None:  # rows grouped by local expert: each runs on its own rows
        grouped = received.reshape(a, p.per_device, capacity, -1).swapaxes(0, 1)
        out = jax.vmap(one)(params, grouped.reshape(p.per_device, a * capacity, -1))
        out = out.reshape(p.per_device, a, capacity, -1).swapaxes(0, 1)
        return out.reshape(a, rows, -1)
    flat = received.reshape(a * rows, -1)
    which = local_expert.reshape(a * rows)

    def step(acc: jax.Array, xs: tuple[Any, jax.Array]) -> tuple[jax.Array, None]:
        params_i, i = xs
        return jnp.where((which == i)[:, None], one(params_i, flat), acc), None

    # The carry starts as zeros that vary over the mesh axes one expert's output does
    # (its rows' and its weights', an outer `shard_map`'s too); the compiler drops the
    # expert run that gives them their type.
    acc = jnp.zeros_like(one(jax.tree.map(lambda a: a[0], params), flat))
    out = jax.lax.scan(step, acc, (params, jnp.arange(p.per_device)))[0]
    return out.reshape(a, rows, -1)


def dispatch(
    expert: Callable[[Any, jax.Array], jax.Array],
    blocks: Any,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    p: Problem,
) -> tuple[jax.Array, jax.Array]:
    """One device's share of `moe`, inside `shard_map`: its tokens `x` `(n_local, D)` and
    their choices, its `E/A` experts `blocks`. Returns its tokens' outputs and the number
    of assignments dropped over the whole mesh."""
    n, k = indices.shape
    experts = indices.reshape(n * k).astype(jnp.int32)
    token = jnp.arange(n * k) // k
    dest, slot, keep = slot_of(experts, p)
    sent = pack(x[token], dest, slot, keep, p)
    which = pack(experts % p.per_device, dest, slot, keep, p)
    received = jax.lax.all_to_all(sent, p.axis, 0, 0, tiled=True)
    received_expert = jax.lax.all_to_all(which, p.axis, 0, 0, tiled=True)
    out = run_experts(expert, blocks, received, received_expert, p)
    back = jax.lax.all_to_all(out, p.axis, 0, 0, tiled=True)
    rows = rows_per_destination(p)
    mine = back[dest, jnp.minimum(slot, rows - 1)]
    mine = jnp.where(keep[:, None], mine, jnp.zeros((), mine.dtype))
    y = jnp.einsum("nk,nkd->nd", weights, mine.reshape(n, k, -1))
    dropped = jax.lax.psum(jnp.sum(~keep, dtype=jnp.int32), p.token_axes)
    return y, dropped
