"""Rematerialisation candidates: a remat policy for the model's `eqxshard.Stacked` layers.

Remat only trades time for activation memory, so it is weighed only where it can help,
by arithmetic before anything is compiled:

- a layout that fits already gets none (remat would only add recomputed flops);
- a layout over budget before its activations (parameters, gradients, optimiser state
  and batch alone) is rejected before it is compiled at all, remat or not;
- a layout over budget whose step is already slower than a layout that fits is
  dominated: remat only makes it slower (a row says so, nothing is compiled);
- the others are compiled with `"dots"` (keep the matmul outputs); those still over
  budget then with `"full"` (keep only each layer's input) and, where the devices have
  pinned host memory, `"offload"` (the matmul outputs in host memory).

Each policy is first given to every stack of the model; where that fits and the model has
several stacks, only those whose activations are largest are then tried with it
(`remat_mix`). The recomputed flops come from the
compiled program: its `cost_analysis()` flops over those of the layout without remat.
`"offload"` also moves the activations it saves to host memory and back each step, over
the `host` link.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..._tree import format_bytes
from . import links as links_
from .candidate import Candidate, not_compiled
from .candidates import Layout
from .view import seconds_str

FIRST = ("dots",)
THEN = ("full", "offload")


def variant(layout: Layout, paths: list[str], policy: str) -> Layout:
    remat = tuple((p, policy) for p in paths)
    return dataclasses.replace(layout, name=f"{layout.name} + remat {policy}", remat=remat)


def policy_of(layout: Layout) -> str:
    """The remat policy of a variant: the one its stacks get that is not `"none"`."""
    return next((p for _, p in layout.remat if p != "none"), "none")


def _paths_str(paths: list[str]) -> str:
    return ", ".join(f"`{p}`" if p else "the model" for p in paths)


def worth(
    rows: list[tuple[Layout, Candidate]],
    paths: list[str],
    policies: tuple[str, ...],
    best: float | None,
) -> tuple[list[tuple[Layout, Layout, Candidate]], list[tuple[Layout, Candidate]]]:
    """The remat variants of `rows` (compiled layouts and their rows) worth compiling,
    each with its base layout and row, and each variant left out with its base row
    (dominated by `best`, the fastest step of a layout that fits)."""
    out: list[tuple[Layout, Layout, Candidate]] = []
    pruned: list[tuple[Layout, Candidate]] = []
    for layout, c in rows:
        if c.fits or c.time is None or c.total_bytes is None or layout.remat:
            continue
        for policy in policies:
            v = variant(layout, paths, policy)
            if best is not None and c.time >= best:
                pruned.append((v, c))
            else:
                out.append((v, layout, c))
    return out, pruned


def dominated(v: Layout, base: Candidate, best: float) -> Candidate:
    """The row of a remat variant not compiled: it cannot beat a layout that fits."""
    why = (
        f"not compiled: dominated, remat {policy_of(v)} only adds to {seconds_str(base.time)} "
        f"per step without it, slower than {seconds_str(best)} of a layout that fits"
    )
    return not_compiled(
        v,
        why,
        offload=base.offload,
        host_bytes=base.host_bytes,
        host_time=base.host_time,
        remat=dict(v.remat),
    )


def described(
    c: Candidate,
    v: Layout,
    base: Candidate,
    ratio: float,
    budget: int,
    links: dict[str, links_.Link],
) -> Candidate:
    """A compiled remat row saying what it chose and why (`ratio`: its compiled flops
    over those of `base`); `"offload"` pays the host link for the activations it moves
    out and back."""
    policy = policy_of(v)
    on = [p for p, q in v.remat if q != "none"]
    kept = [p for p, q in v.remat if q == "none"]
    head = f"remat {policy} on {_paths_str(on)}"
    if kept:
        head += f" only ({_paths_str(kept)} kept whole: less to save there)"
    total = c.total_bytes or 0
    fit = (
        f"fits with {format_bytes(budget - total)} to spare"
        if total <= budget
        else f"still {format_bytes(total - budget)} over"
    )
    without = f"without it {format_bytes((base.total_bytes or 0) - budget)} over"
    extra = max(ratio, 1.0) - 1
    parts = [f"{head}: {fit}; {without}", f"recomputes {extra:.0%} more flops"]
    host_time = c.host_time
    if policy == "offload":
        moved = max((base.total_bytes or 0) - total, 0)
        link = links.get("host", links_.LINKS["host"])
        trips = 2 * (link.latency + moved / link.bandwidth)
        host_time += trips
        parts.append(f"{format_bytes(moved)} of activations over PCIe: {seconds_str(trips)}")
    reason = "; ".join(parts) + (f"; {c.reason}" if c.reason else "")
    time = None if c.time is None else c.time - c.host_time + host_time
    return dataclasses.replace(c, reason=reason, host_time=host_time, time=time)


def with_choices(c: Candidate, layout: Layout, pipeline: dict[str, Any] | None) -> Candidate:
    """`c` carrying its layout's remat and pipeline choices (for `Plan`)."""
    return dataclasses.replace(c, remat=dict(layout.remat), pipeline=pipeline)
