"""The order of a pipeline's work when each stage is its own program (the MPMD form): which
stage runs the forward (`"F"`) or the backward (`"B"`) of which microbatch at each tick.

Each stage follows its own list (`stage_order`):

- `"1f1b"`: stage `s` of `S` runs `min(S-s-1, M)` forwards (the warm-up), then alternates
  one forward and one backward until its `M` forwards are done, then runs the backwards
  left (the cool-down). A backward frees what its forward kept, so stage `s` never holds
  more than `S-s` microbatches' residuals (at most `S`, whatever `M`).
- `"gpipe"`: every forward, then every backward: each stage holds all `M` microbatches'
  residuals before its first backward.

`ticks` then runs the lists against each other on a clock: at each tick every stage takes
the next item of its list if its input came in an earlier tick (a forward needs the
previous stage's forward of that microbatch; a backward needs its own forward and the next
stage's backward). Forwards and backwards take one tick each here; on devices a backward
takes about twice a forward, which moves the ticks but not the order.
"""

from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe")

Item = tuple[int, str, int]  # (stage, "F" or "B", microbatch)


def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The forwards and backwards stage `stage` runs, in its order."""
    M = microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    warm = min(stages - stage - 1, M)
    order = [("F", m) for m in range(warm)]
    for m in range(warm, M):  # one forward, then the backward of the oldest held
        order += [("F", m), ("B", m - warm)]
    return order + [("B", m) for m in range(M - warm, M)]


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
        if not tick:  # every order above is a valid one: a stall is a bug here
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
