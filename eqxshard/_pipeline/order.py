"""The two orders a layer stack can be stored in: layer order (layer `i` at index `i`, what
`filter_pipeline` takes) and stage-major (each stage's chunks next to each other, so that
a split of the layer dim over the stage axis gives each stage the chunks the circular
schedule runs on it). For `repeats=1` the two are the same. Also the warning for a circular
`Stacked` pipelined in layer order (`warn_regrouped`)."""

from __future__ import annotations

import warnings
from typing import Any

import equinox as eqx
import jax


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
