"""`describe`: one row per array leaf (path, shape, dtype, spec, bytes per device), and
the total bytes on each device, for a plan or for a tree already placed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import (
    AbstractMesh,
    NamedSharding,
    PartitionSpec,
    Sharding,
    SingleDeviceSharding,
)
from jaxtyping import PyTree

from . import _compat
from ._plan import is_array_like, plan_shardings
from ._rules import dotted_path
from ._tree import Flat, shape_str

# How many of the largest unsharded leaves a table lists.
UNSHARDED_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class LeafRow:
    """One array leaf of a `ShardingTable`.

    - `path`: the dotted path (`layers.0.weight`), as `path_rules` match it.
    - `shape`, `dtype`: the leaf's global shape and dtype.
    - `sharding`: its `Sharding`, or `None` if it is not placed (host data, an abstract
        leaf without sharding, or a leaf the spec leaves alone).
    - `spec`: the layout in words: `P('data', None)`, `device 3`, or `-` (not placed).
    - `bytes`: the size of the whole leaf.
    - `bytes_per_device`: the most bytes of it on any one device (`None` if not placed).
    - `replicated`: whether every device of its sharding holds the whole leaf.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding | None
    spec: str
    bytes: int
    bytes_per_device: int | None
    replicated: bool


@dataclasses.dataclass(frozen=True)
class ShardingTable:
    """What `describe` returns: a row per array leaf and the bytes on each device.

    `print(table)` shows it in a terminal; a notebook shows it as an HTML table.

    - `rows`: a `LeafRow` per array leaf, in the tree's order.
    - `bytes_per_device`: each device and the bytes of all leaves on it. On an
        `AbstractMesh` (no devices), each position of the mesh, `0` to its size - 1.
    - `total_bytes`: the bytes of all array leaves, each counted once.
    - `unsharded`: the largest leaves that are whole on every device of a mesh of more
        than one device (at most 5, largest first): where sharding would save most.
    """

    rows: list[LeafRow]
    bytes_per_device: dict[Any, int]
    total_bytes: int
    unsharded: list[LeafRow]

    @property
    def max_bytes_per_device(self) -> int:
        """The bytes on the fullest device (0 if nothing is placed)."""
        return max(self.bytes_per_device.values(), default=0)

    def _columns(self) -> tuple[list[str], list[list[str]]]:
        header = ["path", "shape", "dtype", "spec", "per device", "total"]
        body = [
            [
                row.path or "<root>",
                shape_str(row.shape),
                row.dtype,
                row.spec,
                "-" if row.bytes_per_device is None else format_bytes(row.bytes_per_device),
                format_bytes(row.bytes),
            ]
            for row in self.rows
        ]
        return header, body

    def _summary(self) -> list[str]:
        lines = [f"{len(self.rows)} array leaves, {format_bytes(self.total_bytes)} in all."]
        per_device = self.bytes_per_device
        if per_device:
            values = set(per_device.values())
            if len(values) == 1:
                lines.append(
                    f"Each of the {len(per_device)} devices holds "
                    f"{format_bytes(next(iter(values)))}."
                )
            else:
                held = ", ".join(
                    f"{device_name(d)}: {format_bytes(b)}" for d, b in per_device.items()
                )
                lines.append(f"Bytes per device: {held}.")
        if self.unsharded:
            leaves = ", ".join(
                f"{r.path or '<root>'} ({format_bytes(r.bytes)})" for r in self.unsharded
            )
            lines.append(f"Largest unsharded leaves (whole on every device): {leaves}.")
        return lines

    def __str__(self) -> str:
        header, body = self._columns()
        rows = [header, *body]
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        right = {4, 5}  # byte counts right-aligned
        lines = [
            "  ".join(
                cell.rjust(w) if c in right else cell.ljust(w)
                for c, (cell, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
            for r in rows
        ]
        return "\n".join([*lines, *self._summary()])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        """A notebook's view: the table with each leaf's layout over its mesh as a grid of
        devices, and the bytes on each device as bars."""
        from ._describe_view import to_html

        return to_html(self)

    def __rich__(self) -> Any:
        """A terminal's view through `rich.print(table)`: the same pictures in colour."""
        from ._describe_view import to_rich

        return to_rich(self)


def format_bytes(n: int) -> str:
    """Bytes in binary units: `512 B`, `1.5 KiB`, `2.0 GiB`."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


def device_name(device: Any) -> str:
    if isinstance(device, int):  # a position of an abstract mesh
        return f"device {device}"
    return f"{device.platform}:{device.id}"


def _spec_str(sharding: Sharding | None) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, NamedSharding):
        entries = ", ".join(repr(e) for e in sharding.spec)
        return f"P({entries})"
    if isinstance(sharding, SingleDeviceSharding):
        return f"device {device_name(next(iter(sharding.device_set)))}"
    return type(sharding).__name__


def _per_device(sharding: Sharding, shape: tuple[int, ...], itemsize: int) -> dict[Any, int]:
    """The bytes of one leaf on each device of its sharding (padded shards, as XLA pads)."""
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        # No devices (a mesh to size a run before having it, or inside `jit`): each
        # position of the mesh, 0 to size - 1, stands for a device.
        devices = range(sharding.mesh.size)
    else:
        try:
            devices = sharding.device_set
        except Exception:  # no devices to count
            return {}
    if isinstance(sharding, NamedSharding):
        sizes = dict(sharding.mesh.shape)
        shard = list(shape)
        for dim, entry in enumerate(sharding.spec):
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            shard[dim] = -(-shape[dim] // math.prod(sizes[n] for n in names))
        return dict.fromkeys(devices, math.prod(shard) * itemsize)
    indices = sharding.devices_indices_map(shape)
    return {
        d: math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        * itemsize
        for d, index in indices.items()
    }


def _own_sharding(x: Any) -> Sharding | None:
    if _compat.is_tracer(x):
        return _compat.traced_sharding(x)
    sharding = getattr(x, "sharding", None)  # jax.Array, jax.ShapeDtypeStruct
    return sharding if isinstance(sharding, Sharding) else None


def describe(tree: PyTree, target: Any = None, spec: Any = None) -> ShardingTable:
    """A table of where each array leaf lives and how many bytes each device holds.

    With a `target` or `spec`, it describes the plan: the layout `filter_shard(tree,
    target, spec)` would give, checked the same way, without placing or allocating
    anything, so `tree` may be abstract (`eqx.filter_eval_shape(make_model, key)`).
    Without either, it reads each leaf's own sharding (a tree already placed; host NumPy
    leaves and abstract leaves without a sharding show as not placed).

    One row per array leaf: its dotted path (the form `path_rules` match), shape, dtype,
    spec, the bytes of it on one device, and its total bytes. Below: the bytes on each
    device, and the largest leaves left whole on every device.

    **Arguments:**

    - `tree`: any PyTree, concrete or abstract (`jax.ShapeDtypeStruct` leaves).
    - `target`: as for `filter_shard`; `None` with no `spec` reads the tree's own
        shardings.
        An `AbstractMesh` of any size sizes a run before having its devices
        (see docs/sizing.md).
    - `spec`: as for `filter_shard`: a `PartitionSpec`, a prefix PyTree, a callable or a
        rule.

    **Returns:**

    A `ShardingTable`: `print` it in a terminal; a notebook renders it as HTML. Its
    fields (`rows`, `bytes_per_device`, `total_bytes`, `unsharded`) are plain data.

    **Raises:**

    With a `target` or `spec`: the errors of `filter_plan`.

    !!! Example

        ```python
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        make_model = lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key)
        abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))
        print(eqxshard.describe(abstract, mesh, eqxshard.fsdp("data")))
        ```
    """
    if target is None and spec is None:
        flat = Flat(tree, is_array=is_array_like)
        shardings = {i: _own_sharding(flat.leaves[i]) for i in flat.array_indices}
    else:
        flat, planned = plan_shardings("describe", tree, target, spec, sync=False)
        shardings = {i: planned.get(i) for i in flat.array_indices}
    rows: list[LeafRow] = []
    per_device: dict[Any, int] = {}
    for i, sharding in shardings.items():
        x = flat.leaves[i]
        shape, itemsize = tuple(x.shape), x.dtype.itemsize
        held = {} if sharding is None else _per_device(sharding, shape, itemsize)
        for device, n in held.items():
            per_device[device] = per_device.get(device, 0) + n
        replicated = sharding is not None and sharding.is_fully_replicated
        rows.append(
            LeafRow(
                path=dotted_path(flat.paths[i]),
                shape=shape,
                dtype=str(x.dtype),
                sharding=sharding,
                spec=_spec_str(sharding),
                bytes=math.prod(shape) * itemsize,
                bytes_per_device=max(held.values()) if held else None,
                replicated=replicated,
            )
        )
    unsharded = sorted(
        (r for r in rows if r.replicated and r.sharding is not None and _size(r.sharding) > 1),
        key=lambda r: -r.bytes,
    )[:UNSHARDED_SHOWN]
    ordered = dict(sorted(per_device.items(), key=lambda item: _device_order(item[0])))
    return ShardingTable(
        rows=rows,
        bytes_per_device=ordered,
        total_bytes=sum(r.bytes for r in rows),
        unsharded=unsharded,
    )


def _device_order(device: Any) -> int:
    return device if isinstance(device, int) else device.id


def _size(sharding: Sharding) -> int:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh.size
    return len(sharding.device_set)
