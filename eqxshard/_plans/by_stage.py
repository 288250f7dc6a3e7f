"""A `ShardingTable` read by pipeline stage: which layers each stage holds and its bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from jax.sharding import AbstractMesh, NamedSharding

from .. import _compat
from .._tree import format_bytes


class _Row(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def sharding(self) -> Any: ...


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
    - `layers`: the layers of the stack it holds (of the first leaf whose leading dim is
        split over the axis), e.g. `range(2, 4)`.
    - `bytes`: the bytes on the fullest device of this stage (its layers and whatever
        else the tree puts there).
    """

    stage: int
    layers: range
    bytes: int

    def __str__(self) -> str:
        layers = self.layers
        held = (
            f"layer {layers.start}"
            if len(layers) == 1
            else f"layers {layers.start}-{layers.stop - 1}"
        )
        return f"stage {self.stage}: {held}, {format_bytes(self.bytes)} per device"


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
    per = first.shape[0] // size
    rows = []
    for s in range(size):
        devices = list(np.take(grid, [s], axis=where).flat)
        held = max(
            table.bytes_per_device.get(int(d) if isinstance(d, np.integer) else d, 0)
            for d in devices
        )
        rows.append(StageRow(stage=s, layers=range(s * per, (s + 1) * per), bytes=held))
    return rows
