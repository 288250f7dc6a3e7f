"""The collectives of a compiled program, read from its HLO text: kind, bytes, mesh axes.

Each collective instruction gives its result shape (the bytes it produces on one device)
and its device groups (`replica_groups`, in the explicit `{{0,1},{2,3}}`, the iota
`[2,4]<=[8]` or the mesh `mesh[...] {'axis_1'}` form; `source_target_pairs` for a
permute). The groups' positions in the mesh give the axes it runs over. A collective in
the body of a `while` loop with a known trip count is counted that many times.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
ITEMSIZE |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ITEMSIZE |= {"c64": 8, "c128": 16}

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
    r"(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9](?:fn|fnuz)?)?)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"\b(?:body|condition|calls|to_apply|branch_computations)=\{?([^,}]+(?:,\s*%[\w.\-]+)*)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled step: its kind, the bytes of its result on one device,
    the mesh axes it runs over, the devices in each group, and how often it runs."""

    kind: str
    bytes: int
    axes: tuple[str, ...]
    group_size: int
    count: int = 1


def _shape_bytes(type_text: str) -> list[int]:
    sizes = []
    for dtype, dims in _SHAPE.findall(type_text):
        itemsize = ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else 4)
        sizes.append(itemsize * math.prod(int(d) for d in dims.split(",") if d))
    return sizes


def _result_bytes(kind: str, start: bool, type_text: str) -> int:
    sizes = _shape_bytes(type_text)
    if not sizes:
        return 0
    if not start:
        return sum(sizes)
    # Async starts return (operands, results, ...): take the results.
    if kind == "all-gather":
        return max(sizes)
    if kind == "collective-permute":
        return sizes[0]
    return sum(sizes) // 2 if len(sizes) % 2 == 0 else sum(sizes)


def _groups(line: str, n_devices: int) -> list[list[int]] | None:
    """The device groups of a collective (flat mesh positions; only the first is needed),
    or None for one group of every device."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        # XLA's own mesh over the devices in order; the group spans the named axes.
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        spanned = set(re.findall(r"'([^']+)'", m.group(2)))
        ids = np.arange(math.prod(sizes)).reshape(sizes) if sizes else np.zeros((1,), int)
        index = tuple(slice(None) if a in spanned else 0 for a in names)
        return [np.asarray(ids[index]).reshape(-1).tolist()]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{}\s]*\})?\}", line)
    if m:
        groups = [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,\s]*)\}", m.group(0))
        ]
        groups = [g for g in groups if g]
        return groups or None
    return None


def _axes_of(positions: Sequence[int], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    names = list(mesh_shape)
    if not names:
        return ()
    coords = np.array(np.unravel_index(np.asarray(positions), tuple(mesh_shape.values())))
    return tuple(n for n, c in zip(names, coords, strict=True) if len(set(c.tolist())) > 1)


def _multipliers(lines: list[str]) -> tuple[dict[int, str], dict[str, int]]:
    """Each line's computation, and how many times each computation runs per step."""
    owner: dict[int, str] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, current = None, None
    for i, line in enumerate(lines):
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("(")[0]:
            current = m.group("name")
            calls.setdefault(current, [])
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        owner[i] = current
        trip = _TRIP.search(line)
        for group in _CALLEE.findall(line):
            for callee in re.findall(r"%?([\w.\-]+)", group):
                factor = int(trip.group(1)) if trip and " while(" in line else 1
                calls[current].append((callee, factor))
    counts: dict[str, int] = {}

    def visit(name: str, times: int, depth: int) -> None:
        if depth > 64:
            return
        counts[name] = counts.get(name, 0) + times
        for callee, factor in calls.get(name, []):
            visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1, 0)
    return owner, counts


def collectives(hlo_text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective of `hlo_text` (a compiled module's `as_text()`), on a mesh of
    `mesh_shape` (axis name -> size, in the mesh's order)."""
    lines = hlo_text.splitlines()
    owner, counts = _multipliers(lines)
    n_devices = math.prod(mesh_shape.values()) if mesh_shape else 1
    found = []
    for i, line in enumerate(lines):
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        kind, start = m.group("kind"), bool(m.group("start"))
        size = _result_bytes(kind, start, m.group("type"))
        count = max(1, counts.get(owner.get(i, ""), 1))
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
            moves = [
                (int(a), int(b))
                for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(0) if pairs else "")
                if a != b
            ]
            if not moves:
                continue
            axes = set()
            for a, b in moves:
                axes.update(_axes_of([a, b], mesh_shape))
            ordered = tuple(n for n in mesh_shape if n in axes)
            found.append(Collective(kind, size, ordered, 2, count))
            continue
        groups = _groups(line, n_devices)
        if groups is None:
            axes, size_n = tuple(n for n, s in mesh_shape.items() if s > 1), n_devices
        else:
            axes, size_n = _axes_of(groups[0], mesh_shape), len(groups[0])
        if size_n <= 1:
            continue
        found.append(Collective(kind, size, axes, size_n, count))
    return found
