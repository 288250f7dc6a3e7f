"""The table `describe` returns: a row per array leaf and the bytes on each device, as
plain data that prints as text, and draws as pictures in a notebook or a terminal."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Sharding

from .._tree import device_name, format_bytes, shape_str
from . import describe_view
from .by_stage import StageRow, by_stage

# The last line of a table: what it does not count, and where that is counted.
FOOTPRINT = (
    "These leaves only: a training step also holds gradients, optimiser state and "
    "activations: `eqxshard.describe_step` compiles it and gives its total per device."
)


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
    - `stage_major`: for a leaf of a circular `Stacked` stored stage-major, the
        `(stages, repeats)` its layer dim is ordered for (`by_stage` numbers its layers
        from it); `None` for a leaf in layer order (every other leaf).
    - `memory_kind`: `"device"`, or the host memory it lives in (`"pinned_host"`,
        `"unpinned_host"`: counted in `host_bytes_per_device`, not `bytes_per_device`);
        `None` if not placed.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding | None
    spec: str
    bytes: int
    bytes_per_device: int | None
    replicated: bool
    stage_major: tuple[int, int] | None = None
    memory_kind: str | None = None


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
    - `parts`: for a tree of several parts at its top (a dict, tuple or module, e.g.
        `{"params": params, "opt_state": opt_state}`), each part's dotted name and the
        bytes of it on its fullest device: the optimiser state's next to the
        parameters'. Empty for a tree of one part.
    - `left_replicated`: for a plan made by rules, why they left leaves whole on every
        device of a mesh of several (e.g. `fsdp`'s "fewer than `min_size` elements"),
        each reason with how many leaves and bytes. Printed below the table.
    - `host_bytes_per_device`: the bytes each device holds in host memory (leaves placed
        with a `pinned_host` or `unpinned_host` memory kind, e.g. an offloaded optimiser
        state), not counted in `bytes_per_device`. Empty when nothing is offloaded.
    - `unmatched`: for a plan made by rules, the parts of them that gave no leaf its spec
        (`"path_rules pattern '...' (near misses: ...)"`), as `filter_shard` warns about
        them. Printed below the table.
    """

    rows: list[LeafRow]
    bytes_per_device: dict[Any, int]
    total_bytes: int
    unsharded: list[LeafRow]
    parts: dict[str, int] = dataclasses.field(default_factory=dict)
    left_replicated: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    host_bytes_per_device: dict[Any, int] = dataclasses.field(default_factory=dict)
    unmatched: list[str] = dataclasses.field(default_factory=list)

    @property
    def max_bytes_per_device(self) -> int:
        """The bytes on the fullest device (0 if nothing is placed)."""
        return max(self.bytes_per_device.values(), default=0)

    def by_stage(self, axis: str = "stage") -> list[StageRow]:
        """Each pipeline stage along the mesh axis `axis`: the layers it holds and the
        bytes on its fullest device (a `StageRow` each; `print` one for a line).

        **Raises:**

        - `ValueError`: if no leaf has its leading (layer) dim split over `axis`.
        """
        return by_stage(self, axis)

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
        if self.host_bytes_per_device:
            values = set(self.host_bytes_per_device.values())
            held = (
                f"{format_bytes(next(iter(values)))} on each of its "
                f"{len(self.host_bytes_per_device)} devices"
                if len(values) == 1
                else ", ".join(
                    f"{device_name(d)}: {format_bytes(b)}"
                    for d, b in self.host_bytes_per_device.items()
                )
            )
            lines.append(f"In host memory (offloaded, not counted above): {held}.")
        if self.parts:
            held = ", ".join(f"{name}: {format_bytes(b)}" for name, b in self.parts.items())
            lines.append(f"On the fullest device, by part: {held}.")
        if self.unsharded:
            leaves = ", ".join(
                f"{r.path or '<root>'} ({format_bytes(r.bytes)})" for r in self.unsharded
            )
            lines.append(f"Largest unsharded leaves (whole on every device): {leaves}.")
        if self.left_replicated:
            n = sum(k for k, _ in self.left_replicated.values())
            size = sum(b for _, b in self.left_replicated.values())
            why = "; ".join(
                f"{k} ({format_bytes(b)}) by {reason}"
                for reason, (k, b) in self.left_replicated.items()
            )
            lines.append(f"Left replicated by the rules: {n} leaves ({format_bytes(size)}): {why}.")
        if self.unmatched:
            lines.append(
                f"Rules that gave no leaf its spec: {', '.join(self.unmatched)}. A pattern "
                "must match a whole dotted path (`re.fullmatch`) as printed above."
            )
        lines.append(FOOTPRINT)
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
        return describe_view.to_html(self._pictures())

    def __rich__(self) -> Any:
        """A terminal's view through `rich.print(table)`: the same pictures in colour."""
        return describe_view.to_rich(self._pictures())

    def _pictures(self) -> describe_view.Pictures:
        header, body = self._columns()
        return describe_view.Pictures(
            header=header,
            body=body,
            grids=[describe_view.layout_grid(r.shape, r.sharding) for r in self.rows],
            bytes_per_device=self.bytes_per_device,
            summary=self._summary(),
        )
