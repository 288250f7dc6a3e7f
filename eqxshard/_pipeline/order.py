"""The two orders a layer stack can be stored in: layer order (layer `i` at index `i`, what
`filter_pipeline` takes) and stage-major (each stage's chunks next to each other, so that
a split of the layer dim over the stage axis gives each stage the chunks the circular
schedule runs on it). For `repeats=1` the two are the same."""

from __future__ import annotations

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
