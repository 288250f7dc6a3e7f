"""The pictures of a `ShardingTable`: per-device memory as bars, and each leaf's layout
over its mesh as a small grid of devices (devices holding the same block of the leaf share
a colour, so a replicated leaf is one colour and a leaf split 8 ways is 8).

`to_html` is what a notebook shows (`ShardingTable._repr_html_`); `to_rich` is what
`rich.print(table)` shows in a terminal (`ShardingTable.__rich__`). The numbers come from
the table; nothing here computes a plan.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import numpy as np
from jax.sharding import NamedSharding, Sharding

from .._tree import device_name, format_bytes


@dataclasses.dataclass(frozen=True)
class Pictures:
    """What the pictures show of a `ShardingTable` (`table.py`), as it passes them: the
    text columns (`header`, a row of cells per leaf), each leaf's layout grid
    (`layout_grid`, `None` where there is none to draw), the bytes on each device, and
    the summary lines."""

    header: list[str]
    body: list[list[str]]
    grids: list[np.ndarray | None]
    bytes_per_device: dict[Any, int]
    summary: list[str]


# Distinct, readable on white and on dark backgrounds; cycled beyond ten blocks.
PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
]
RICH_PALETTE = ["blue", "dark_orange", "green", "red", "cyan", "yellow", "magenta", "pink1"]
BAR_WIDTH = 30  # characters of the longest bar in a terminal
CELL = 14  # pixels of one device in an HTML grid


def layout_grid(shape: tuple[int, ...], sharding: Sharding | None) -> np.ndarray | None:
    """The leaf's block number on each device, laid out as its mesh (2-D: the first mesh
    axis down, the others across), or `None` when there is no mesh of devices to draw
    (not placed, or an abstract mesh)."""
    if sharding is None:
        return None
    try:
        indices = sharding.devices_indices_map(shape)
    except Exception:  # an abstract mesh: no devices
        return None
    if isinstance(sharding, NamedSharding):
        devices = np.asarray(sharding.mesh.devices)
    else:
        devices = np.asarray(sorted(indices, key=lambda d: d.id))
    devices = devices.reshape(devices.shape[0] if devices.ndim > 1 else 1, -1)
    blocks: dict[tuple, int] = {}
    grid = np.zeros(devices.shape, dtype=int)
    for pos, device in np.ndenumerate(devices):
        index = indices.get(device)
        key = tuple((s.start, s.stop) for s in index) if index is not None else None
        grid[pos] = blocks.setdefault(key, len(blocks))  # type: ignore[arg-type]
    return grid


def _bars(pictures: Pictures) -> list[tuple[str, int, float]]:
    """(device, bytes, fraction of the fullest device) for every device."""
    held = pictures.bytes_per_device
    most = max(held.values(), default=0) or 1
    return [(device_name(d), b, b / most) for d, b in held.items()]


def _grid_svg(grid: np.ndarray) -> str:
    rows, cols = grid.shape
    cells = "".join(
        f'<rect x="{c * CELL}" y="{r * CELL}" width="{CELL - 1}" height="{CELL - 1}" '
        f'fill="{PALETTE[int(grid[r, c]) % len(PALETTE)]}"><title>block {grid[r, c]}'
        f"</title></rect>"
        for r in range(rows)
        for c in range(cols)
    )
    return (
        f'<svg width="{cols * CELL}" height="{rows * CELL}" role="img" '
        f'aria-label="layout over a {rows}x{cols} device grid">{cells}</svg>'
    )


def to_html(pictures: Pictures) -> str:
    """A styled HTML table with a layout grid per leaf, then the per-device bars."""
    header, body = pictures.header, pictures.body
    td = 'style="padding:2px 8px;border-bottom:1px solid #8884;text-align:{}"'
    right = {4, 5}
    head = "".join(
        f"<th {td.format('right' if i in right else 'left')}>{html.escape(h)}</th>"
        for i, h in enumerate([*header, "layout"])
    )
    lines = []
    for grid, cells in zip(pictures.grids, body, strict=True):
        picture = "" if grid is None else _grid_svg(grid)
        tds = "".join(
            f"<td {td.format('right' if i in right else 'left')}>"
            f"{'<code>' if i in (0, 3) else ''}{html.escape(c)}{'</code>' if i in (0, 3) else ''}"
            "</td>"
            for i, c in enumerate(cells)
        )
        lines.append(f"<tr>{tds}<td {td.format('left')}>{picture}</td></tr>")
    bars = "".join(
        f'<div style="display:flex;align-items:center;gap:8px;margin:1px 0">'
        f'<span style="width:5em;font-family:monospace">{html.escape(name)}</span>'
        f'<span style="display:inline-block;height:10px;width:{max(fraction * 240, 1):.0f}px;'
        f'background:{PALETTE[0]}"></span><span>{format_bytes(n)}</span></div>'
        for name, n, fraction in _bars(pictures)
    )
    notes = "".join(f'<p style="margin:4px 0">{html.escape(s)}</p>' for s in pictures.summary)
    return (
        '<div class="eqxshard-describe">'
        f'<table style="border-collapse:collapse;font-size:90%"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(lines)}</tbody></table>"
        + (f"<p style='margin:8px 0 2px'><b>Bytes per device</b></p>{bars}" if bars else "")
        + f"{notes}</div>"
    )


def to_rich(pictures: Pictures) -> Any:
    """A rich renderable: the table with a coloured layout grid per leaf, then the bars."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header, body = pictures.header, pictures.body
    leaves = Table(show_edge=False, header_style="bold")
    for i, name in enumerate([*header, "layout"]):
        leaves.add_column(name, justify="right" if i in (4, 5) else "left")
    for grid, cells in zip(pictures.grids, body, strict=True):
        picture = Text()
        if grid is not None:
            for r in range(grid.shape[0]):
                if r:
                    picture.append("\n")
                for block in grid[r]:
                    picture.append("██", style=RICH_PALETTE[int(block) % len(RICH_PALETTE)])
        leaves.add_row(*cells, picture)
    parts: list[Any] = [leaves]
    if pictures.bytes_per_device:
        bars = Table(show_edge=False, show_header=False, box=None, title="bytes per device")
        bars.add_column("device")
        bars.add_column("bar", no_wrap=True)
        bars.add_column("bytes", justify="right")
        for name, n, fraction in _bars(pictures):
            bar = Text("█" * max(round(fraction * BAR_WIDTH), 1), style="blue")
            bars.add_row(name, bar, format_bytes(n))
        parts.append(bars)
    parts.extend(Text(line) for line in pictures.summary)
    return Group(*parts)
