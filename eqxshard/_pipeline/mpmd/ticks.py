"""The clock of the MPMD pipeline: which stage runs the forward (`"F"`) or the backward
(`"B"`) of which microbatch at each tick, each stage following its own order
(`one_f_one_b`, or `gpipe`).

`ticks` runs the stages' orders against each other: at each tick every stage takes the
next item of its order if its input came in an earlier tick (a forward needs the previous
stage's forward of that microbatch; a backward needs its own forward and the next stage's
backward). Forwards and backwards take one tick each here; on devices a backward takes
about twice a forward, which moves the ticks but not the order.
"""

from __future__ import annotations

from collections.abc import Callable

from .gpipe import gpipe_order
from .one_f_one_b import one_f_one_b_order

# Each schedule's order: `order(stage, stages, microbatches) -> [("F" or "B", microbatch)]`.
ORDERS: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {
    "1f1b": one_f_one_b_order,
    "gpipe": gpipe_order,
}
SCHEDULES = tuple(ORDERS)

Item = tuple[int, str, int]  # (stage, "F" or "B", microbatch)


def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The forwards and backwards stage `stage` runs, in its order under `schedule`."""
    return ORDERS[schedule](stage, stages, microbatches)


def ticks(schedule: str, stages: int, microbatches: int) -> list[list[Item]]:
    """The items each tick runs, every stage in its own order, each as soon as its inputs
    came in an earlier tick."""
    orders = [stage_order(schedule, s, stages, microbatches) for s in range(stages)]
    done: set[Item] = set()
    at = [0] * stages
    out: list[list[Item]] = []

    def ready(s: int, kind: str, m: int) -> bool:
        if kind == "F":
            return s == 0 or (s - 1, "F", m) in done
        return (s, "F", m) in done and (s == stages - 1 or (s + 1, "B", m) in done)

    while any(at[s] < len(orders[s]) for s in range(stages)):
        tick = [
            (s, *orders[s][at[s]])
            for s in range(stages)
            if at[s] < len(orders[s]) and ready(s, *orders[s][at[s]])
        ]
        if not tick:  # every order in ORDERS is a valid one: a stall is a bug here
            raise RuntimeError(f"the {schedule} order stalled at tick {len(out)}")
        for s, _, _ in tick:
            at[s] += 1
        done.update(tick)
        out.append(tick)
    return out


def held(schedule: str, stages: int, microbatches: int) -> list[int]:
    """The most microbatches' residuals each stage holds at once in this order."""
    peaks = []
    for s in range(stages):
        count = peak = 0
        for kind, _ in stage_order(schedule, s, stages, microbatches):
            count += 1 if kind == "F" else -1
            peak = max(peak, count)
        peaks.append(peak)
    return peaks
