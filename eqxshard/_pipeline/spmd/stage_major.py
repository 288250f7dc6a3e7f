"""Which layers each stage holds in the circular schedule: chunk `c` of `n/(S*R)` layers
runs on stage `c % S` as its local chunk `c // S` (`S` stages, `R` = `repeats`).

A layer stack is stored in one of two orders: layer order (layer `i` at index `i`, what
`filter_pipeline` takes) or stage-major (each stage's chunks next to each other, so that a
contiguous split of the layer dim over the stage axis gives each stage the chunks it runs;
what a circular `Stacked` stores). For `repeats=1` the two are the same. A stack in layer
order reaches the stages that run its chunks inside the step instead (`regroup`, one
all-to-all), and a circular `Stacked` that does so warns (`warn_regrouped`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def _swap_chunk_grid(blocks: Any, rows: int, columns: int) -> Any:
    """Every array leaf's leading dim, read as a `rows x columns` grid of equal chunks
    (row-major), rewritten column-major: the chunk at `(i, j)` moves to `j*rows + i`."""

    def move(a: Any) -> Any:
        if not eqx.is_array(a) or not a.ndim:
            return a
        chunk = a.shape[0] // (rows * columns)
        a = a.reshape(rows, columns, chunk, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(-1, *a.shape[3:])

    return jax.tree.map(move, blocks)


def to_stage_major(blocks: Any, stages: int, repeats: int) -> Any:
    """`blocks` (layer order) with its array leaves reordered stage-major: chunk `c` of
    `n/(S*R)` layers moves to place `(c % S) * R + c // S`."""
    # Layer order is an `R x S` grid (chunk `c = r*S + s`); stage-major is its transpose.
    return _swap_chunk_grid(blocks, repeats, stages)


def from_stage_major(blocks: Any, stages: int, repeats: int) -> Any:
    """The inverse of `to_stage_major`: a stage-major stack back in layer order."""
    return _swap_chunk_grid(blocks, stages, repeats)


def _send_tables(stages: int, repeats: int) -> tuple[np.ndarray, np.ndarray]:
    """For `regroup`: `send[d, e, k]`, the local chunk stage `d` sends to stage `e`
    in place `k`; `take[e, i]`, where (`d*Q + k`) stage `e` finds its local chunk `i`."""
    per = math.ceil(repeats / stages)  # Q: chunks one stage sends another, at most
    send = np.zeros((stages, stages, per), np.int32)
    slot: dict[tuple[int, int], int] = {}
    for d in range(stages):
        for j in range(repeats):
            e = (d * repeats + j) % stages
            k = sum(1 for jj in range(j) if (d * repeats + jj) % stages == e)
            send[d, e, k] = j
            slot[(d, j)] = k
    take = np.zeros((stages, repeats), np.int32)
    for e in range(stages):
        for i in range(repeats):
            d, j = divmod(i * stages + e, repeats)
            take[e, i] = d * per + slot[(d, j)]
    return send, take


def regroup(local: Any, axis: str, stages: int, repeats: int) -> Any:
    """Inside `shard_map`: each stage's slice of a layer stack split contiguously (chunks
    `s*R ..`) turned into the chunks it runs (`c` with `c % S == s`), by one all-to-all."""
    if repeats == 1 or stages == 1:
        return local
    send, take = _send_tables(stages, repeats)
    s = jax.lax.axis_index(axis)

    def move(a: jax.Array) -> jax.Array:
        chunks = a.reshape(repeats, a.shape[0] // repeats, *a.shape[1:])
        out = chunks[jnp.asarray(send)[s]]  # (S, Q, L, ...): what goes to each stage
        got = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)  # (S, Q, L, ...) by sender
        got = got.reshape(-1, *chunks.shape[1:])
        return got[jnp.asarray(take)[s]].reshape(a.shape)

    return jax.tree.map(move, local)


def warn_regrouped(verb: str, stage_major: bool, repeats: int, stages: int, axis: str) -> None:
    """The warning for a circular `Stacked` pipelined in layer order: its weights move by
    an all-to-all every step (and once more for their gradients)."""
    if verb != "Stacked" or stage_major or repeats == 1 or stages == 1:
        return
    warnings.warn(
        f"This circular `Stacked` (repeats={repeats}) is stored in layer order, as its stage "
        f"count was unknown when it was built, so each step regroups its weights by an "
        f"all-to-all over {axis!r} (and its gradients by another). Store it stage-major "
        "once: build it with `mesh=` or under `jax.set_mesh(mesh)`, with "
        "`eqxshard.filter_init(make_model, mesh, rules)`, or by a plan's `apply`; or "
        "`Stacked.from_layers(stack.to_layers(), axis=..., microbatches=..., "
        "repeats=..., mesh=mesh)`.",
        stacklevel=2,
    )
