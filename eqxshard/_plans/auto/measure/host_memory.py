"""Bytes a compiled step keeps in host memory, read from its HLO text.

A step whose optimiser state lives in pinned host memory has those arguments and outputs
in memory space 5 (`f32[256,1024]{1,0:S(5)}`) in the module's `entry_computation_layout`
(per-device shapes, after partitioning). On GPU `memory_analysis()` counts them apart
(`host_argument_size_in_bytes`); on CPU, where host and device memory are one, it counts
them with the rest. Reading the layout gives the same figure on every backend.
"""

from __future__ import annotations

import math
import re

from .collectives import ITEMSIZE

_LAYOUT = "entry_computation_layout={("
_HOST_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]\{[^}]*S\(5\)[^}]*\}")


def _bytes(text: str) -> int:
    total = 0
    for dtype, dims in _HOST_SHAPE.findall(text):
        size = math.prod(int(d) for d in dims.split(",") if d)
        total += size * ITEMSIZE.get(dtype, 4)
    return total


def host_bytes(hlo_text: str, alias: int) -> int:
    """Bytes per device of the step's arguments and outputs in host memory, counting once
    the outputs that reuse a donated argument's buffer (up to `alias` bytes)."""
    header = hlo_text.split("\n", 1)[0]
    if _LAYOUT not in header or ")->" not in header:
        return 0
    arguments, outputs = header.split(_LAYOUT, 1)[1].split(")->", 1)
    args, outs = _bytes(arguments), _bytes(outputs)
    return args + outs - min(args, outs, alias)
