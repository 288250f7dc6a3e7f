"""The GPipe order of the MPMD pipeline: every forward, then every backward.

Each stage holds all `M` microbatches' residuals before its first backward; the values are
1F1B's (for comparison, and where memory allows).
"""

from __future__ import annotations


def gpipe_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The forwards (`"F"`) and backwards (`"B"`) of each microbatch stage `stage` runs,
    in the GPipe order (the same on every stage)."""
    del stage, stages
    return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
