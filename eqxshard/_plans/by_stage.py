"""A `ShardingTable` read by pipeline stage: which layers each stage holds and its bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from .. import _compat
from .._pipeline.spmd.stage_major import to_stage_major
from .._pipeline.stacked.stacked import Stacked
from .._tree import format_bytes


class _Row(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def sharding(self) -> Any: ...
    @property
    def stage_major(self) -> tuple[int, int] | None: ...


class _Table(Protocol):
    """What `by_stage` reads of a `ShardingTable` (named, not imported: `table` imports
    this module)."""

    @property
    def rows(self) -> Sequence[_Row]: ...
    @property
    def bytes_per_device(self) -> dict[Any, int]: ...


@dataclasses.dataclass(frozen=True)
class StageRow:
    """One stage of `ShardingTable.by_stage(axis)`.

    - `stage`: its index along the stage axis.
    - `layers`: the model's layer numbers it holds, in the order it stores them (of the
        first leaf whose leading dim is split over the axis), e.g. `(2, 3)`; for a
        circular `Stacked` stored stage-major, its chunks `s, s+S, ..`, e.g.
        `(0, 1, 8, 9)`, numbered as `Stacked.to_layers` orders them.
    - `bytes`: the bytes on the fullest device of this stage (its layers and whatever
        else the tree puts there).
    """

    stage: int
    layers: tuple[int, ...]
    bytes: int

    def __str__(self) -> str:
        runs: list[list[int]] = []
        for i in self.layers:
            if runs and i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        held = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
        word = "layer" if len(self.layers) == 1 else "layers"
        return f"stage {self.stage}: {word} {held}, {format_bytes(self.bytes)} per device"


def _names(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def by_stage(table: _Table, axis: str) -> list[StageRow]:
    """See `ShardingTable.by_stage`."""
    stacked = [
        (row, row.sharding)
        for row in table.rows
        if isinstance(row.sharding, NamedSharding)
        and row.shape
        and axis in _names((_compat.spec_entries(row.sharding.spec) or (None,))[0])
    ]
    if not stacked:
        raise ValueError(
            f"`ShardingTable.by_stage` found no leaf whose leading (layer) dim is split over "
            f"the mesh axis {axis!r}. Lay the stack out with `eqxshard.stages({axis!r})` (or a "
            f"spec with {axis!r} first), or pass the stage axis's name."
        )
    first, sharding = stacked[0]
    mesh = sharding.mesh
    where = list(mesh.axis_names).index(axis)
    size = dict(mesh.shape)[axis]
    if isinstance(mesh, AbstractMesh):  # positions of the mesh, as `describe` counts them
        grid = np.arange(mesh.size).reshape(tuple(mesh.axis_sizes))
    else:
        grid = mesh.devices
    n = first.shape[0]
    per = n // size
    # Storage position -> layer number: the identity, or a stage-major stack's order.
    number = np.arange(n)
    if first.stage_major is not None:
        number = to_stage_major(number, *first.stage_major)
    rows = []
    for s in range(size):
        devices = list(np.take(grid, [s], axis=where).flat)
        held = max(
            table.bytes_per_device.get(int(d) if isinstance(d, np.integer) else d, 0)
            for d in devices
        )
        layers = tuple(int(i) for i in number[s * per : (s + 1) * per])
        rows.append(StageRow(stage=s, layers=layers, bytes=held))
    return rows


def stage_major_paths(tree: Any) -> list[tuple[tuple[Any, ...], tuple[int, int]]]:
    """The key path of the blocks of every `Stacked` in `tree` stored stage-major, with
    the `(stages, repeats)` it is stored for: a leaf under such a path is in that order."""
    is_stacked = lambda x: isinstance(x, Stacked)  # noqa: E731
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_stacked)[0]
    return [
        ((*path, jax.tree_util.GetAttrKey("blocks")), (x.stages, x.repeats))
        for path, x in found
        if isinstance(x, Stacked) and x.stages is not None
    ]
