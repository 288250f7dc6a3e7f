"""Optimiser state in pinned host memory: when `auto_plan` tries it, what it costs.

A layout with the state offloaded keeps it in `pinned_host` memory between steps; the
step moves it to the device for the update and back (`filter_put` inside `jit`), so it
crosses the `host` link twice per step. It saves the state's bytes in device memory, so
it is tried only for a layout that does not fit without it and would with the state's
bytes gone: a layout that fits already is faster without (no host traffic), and one
still over budget without the state cannot fit with it. A layout whose stacks were
rematerialised and that is still over is tried with its state offloaded too, by the
same test. Backends without pinned host
memory, and JAX versions that cannot move memory kinds inside `jit`, are not offered it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .... import _compat
from ..candidate import Candidate, not_compiled
from ..choices import HOST_MEMORY_KIND
from ..layout import Layout
from ..links import host_round_trip
from ..rank.row import not_measured
from ..trace.phase import Traced
from ..view import seconds_str
from .base import Dimension, Measured, Search

# What the table calls a layout with the state in host memory.
SUFFIX = " + offload"


def supported(devices: list[Any]) -> bool:
    """Whether the devices have pinned host memory and JAX can move to it inside `jit`."""
    if not devices or not _compat.memory_kinds_in_jit():
        return False
    try:
        kinds = {m.kind for m in devices[0].addressable_memories()}
    except (AttributeError, RuntimeError):
        return False
    return HOST_MEMORY_KIND in kinds


def could_fit(total: int | None, state: int, budget: int) -> bool:
    """Whether a layout of `total` bytes per device (None: not known) that is over budget
    fits with its optimiser state's `state` bytes moved to host memory."""
    return total is not None and total > budget and total - state <= budget


def dominated(floor: float, best: float) -> str:
    """Why an offload variant is not compiled: it cannot beat a layout that fits."""
    return (
        f"not compiled: dominated, at least {seconds_str(floor)} per step with the optimiser "
        f"state's trips over PCIe, slower than {seconds_str(best)} of a layout that fits"
    )


def variant(layout: Layout) -> Layout:
    return dataclasses.replace(layout, name=layout.name + SUFFIX, offload=True)


def after_remat(
    tried: list[tuple[Layout, Layout, Candidate, Candidate]],
    *,
    best: float | None,
    traced: Traced,
) -> tuple[list[tuple[Layout, Layout, Candidate]], list[tuple[Layout, Candidate]]]:
    """The rematerialised layouts (`tried`: each variant, its base layout and row, and its
    own row) still over budget that would fit with their optimiser state in host memory:
    those worth compiling (with their base layout and row), and each dominated (with its row)
    by `best`, the fastest step of a layout that fits."""
    todo, slow = [], []
    for v, base, c, r in tried:
        state = r.bytes.get("optimizer state", 0)
        if (
            r.fits
            or v.offload
            or r.time is None
            or not could_fit(r.total_bytes, state, traced.budget)
        ):
            continue
        layout = variant(v)
        floor = r.time + host_round_trip(state, traced.axis_links(v.shape))
        if best is not None and floor >= best:
            slow.append((layout, not_compiled(layout, dominated(floor, best))))
        else:
            todo.append((layout, base, c))
    return todo, slow


class Offload(Dimension):
    """The optimiser state in pinned host memory: proposes nothing of its own; refines
    the measured layouts over budget by no more than their state (see the module)."""

    name = "offload"

    def refine(self, search: Search) -> Measured:
        traced, measured = search.traced, search.measured
        if not traced.problem.trains or not supported(traced.available):
            return measured
        # The state in host memory, for the layouts only that would then fit, and could
        # then be faster than the fastest that fits already.
        best = min((c.time or 0 for c in measured.rows if c.fits), default=None)
        todo, rows = [], []
        for job, c in measured.measured_rows():
            state = job.exact.get("optimizer state", 0)
            if not could_fit(c.total_bytes, state, traced.budget):
                continue
            layout = variant(job.layout)
            trips = host_round_trip(state, traced.axis_links(job.layout.shape))
            floor = (c.time or 0.0) + trips
            if best is None or floor < best:
                todo.append(search.lay_out(layout))
                continue
            exact = job.exact | {"optimizer state": 0}
            reason = dominated(floor, best)
            rows.append(not_measured(layout, exact=exact, reason=reason, host=state))
        search.compile(todo)
        return measured.plus(rows=rows + [search.row(job) for job in todo])
