"""What the benchmarks read from a compiled program: its collectives, counted from the
HLO text, and its bytes per device from `memory_analysis()`."""

from __future__ import annotations

import re
from typing import Any

# Each collective by its HLO name, and the short name the tables print (in this order).
KINDS = {
    "all-to-all": "a2a",
    "all-gather": "ag",
    "all-reduce": "ar",
    "collective-permute": "cp",
    "reduce-scatter": "rs",
}


def collectives(hlo: str) -> str:
    """`"a2a 4 ag 2"`: how many of each collective the compiled HLO runs (`-`: none)."""
    counts = {
        short: len(re.findall(rf"\b{kind}(?:-start)?\(", hlo)) for kind, short in KINDS.items()
    }
    return " ".join(f"{short} {n}" for short, n in counts.items() if n) or "-"


def per_device(compiled: Any) -> int:
    """Arguments, outputs and temporaries of a compiled program, in bytes per device."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
