"""The 1F1B order of the MPMD pipeline: one forward, one backward.

Stage `s` of `S` runs `min(S-s-1, M)` forwards (the warm-up), then alternates one forward
and the backward of the oldest microbatch it holds until its `M` forwards are done, then
runs the backwards left (the cool-down). A backward frees what its forward kept, so stage
`s` never holds more than `S-s` microbatches' residuals (at most `S`, whatever `M`).
"""

from __future__ import annotations


def one_f_one_b_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The forwards (`"F"`) and backwards (`"B"`) of each microbatch stage `stage` runs,
    in the 1F1B order."""
    M = microbatches
    warm = min(stages - stage - 1, M)
    order = [("F", m) for m in range(warm)]
    for m in range(warm, M):  # one forward, then the backward of the oldest held
        order += [("F", m), ("B", m - warm)]
    return order + [("B", m) for m in range(M - warm, M)]
