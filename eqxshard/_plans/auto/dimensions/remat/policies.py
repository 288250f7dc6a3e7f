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

The layouts without remat keep each stack's own `remat` (`eqxshard.Stacked(...,
remat="full")`, say): that is the baseline. A policy that keeps no fewer bytes on the
device for the backward pass than the model's own setting, by the step's jaxpr
(`residuals`), saves nothing: it is dominated, and its rows say so, not compiled.

Each policy is first given to every stack of the model; where that fits and the model has
several stacks, only those whose activations are largest are then tried with it
(`per_stack`). The recomputed flops are read from the step's jaxpr (its matmul flops,
every layer counted, over those without remat: the compiled program's `cost_analysis()`
counts a scanned layer once). `"offload"` keeps the matmul outputs it saves in host
memory (the row's `host_bytes`), and they cross the `host` link out and back each step.
GPU and TPU compiles count them apart; a CPU compile (host and device memory are one)
counts them as device memory, so their bytes per device (the whole batch's over the
devices: exact on data and fsdp axes; at least that where a tensor-parallel axis keeps
some whole or a pipeline's ticks keep more) come off its total.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ....._tree import format_bytes
from ...candidate import Candidate, not_compiled
from ...layout import Layout
from ...links import Link, host_round_trip
from ...view import seconds_str
from .residuals import RematTrace

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


Variant = tuple[Layout, Layout, Candidate]  # a remat variant, its base layout and row


def saving(
    todo: list[Variant], traced: RematTrace
) -> tuple[list[Variant], list[tuple[Layout, Layout, Candidate, Candidate]]]:
    """`todo` (variants, each with its base layout and row) less those whose policy saves
    nothing on the device against the model's own setting, and those, each with its row,
    not compiled; a variant whose policy saves on some stacks only is given to those (the
    others keep their own setting)."""
    keep, same = [], []
    for v, base, c in todo:
        policy = policy_of(v)
        why = traced.saves_nothing(policy)
        if why:
            same.append((v, base, c, not_compiled(v, why, remat=dict(v.remat))))
            continue
        on = traced.saving_on(policy)
        if on is not None and len(on) < len(v.remat):  # the others keep their own setting
            named = f"{base.name} + remat {policy} on {', '.join(on)}"
            v = dataclasses.replace(v, name=named, remat=tuple((p, policy) for p in on))
        keep.append((v, base, c))
    return keep, same


def described(
    c: Candidate,
    v: Layout,
    base: Candidate,
    traced: RematTrace,
    *,
    budget: int,
    links: dict[str, Link],
    apart: int = 0,
) -> Candidate:
    """A compiled remat row saying what it chose and why: the matmul flops it adds (by
    the step's jaxpr, against no remat), and for `"offload"` the activations it keeps in
    host memory and their trips over the host link. Those activations are in `host_bytes`
    (with any optimiser state there): `apart`, where the compile counted them apart from
    device memory (GPU, TPU: `c` has them already); else (CPU) the compile's share of them
    per device (the whole batch's, from the step's jaxpr, over the devices), taken off its
    device total."""
    policy = policy_of(v)
    on = [p for p, q in v.remat if q == policy]
    kept = [p for p, q in v.remat if q == "none"]
    head = f"remat {policy} on {_paths_str(on)}"
    if kept:
        head += f" only ({_paths_str(kept)} kept whole: less to save there)"
    host_time, parts, away, held, bound = c.host_time, dict(c.bytes), 0, apart, ""
    if policy == "offload":
        if not apart:  # counted as device memory (CPU): its share per device comes off
            whole = traced.host_bytes(v.remat)
            held = away = min(whole // max(v.devices, 1), parts.get("activations", 0))
            parts["activations"] = parts.get("activations", 0) - away
            # Split over every device, unless a tensor-parallel axis keeps some whole or a
            # pipeline keeps some per tick (its idle ticks' too).
            bound = " (at least)" if set(v.shape) - {"data", "fsdp"} else ""
    total = (c.total_bytes or 0) - away
    fit = (
        f"fits with {format_bytes(budget - total)} to spare"
        if total <= budget
        else f"still {format_bytes(total - budget)} over"
    )
    without = f"without it {format_bytes((base.total_bytes or 0) - budget)} over"
    extra = max(traced.recomputed(v.remat), 1.0) - 1
    said = [without, f"recomputes {extra:.0%} more matmul flops than no remat"]
    if policy == "offload":
        trips = host_round_trip(held, links)
        host_time += trips
        said.append(
            f"{format_bytes(held)} of activations per device in host memory{bound}, "
            f"out and back over PCIe: {seconds_str(trips)}"
        )
    reason = "; ".join(said) + (f"; {c.reason}" if c.reason else "")
    time = None if c.time is None else c.time - c.host_time + host_time
    return dataclasses.replace(
        c,
        reason=reason,
        choice_note=head,
        budget_note=fit,
        host_time=host_time,
        time=time,
        bytes=parts,
        host_bytes=c.host_bytes + away,
        total_bytes=None if c.total_bytes is None else total,
        fits=c.total_bytes is not None and total <= budget,
    )


def with_choices(c: Candidate, layout: Layout, pipeline: dict[str, Any] | None) -> Candidate:
    """`c` carrying its layout's remat and pipeline choices (for `Plan`)."""
    return dataclasses.replace(c, remat=dict(layout.remat), pipeline=pipeline)
