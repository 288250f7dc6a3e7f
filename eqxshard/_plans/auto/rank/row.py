"""A row of the table from a candidate's compile: its parts, collectives and times, by the
alpha-beta model over its axes' links (`links`); or the row of one not compiled."""

from __future__ import annotations

from ...._step import pinned
from ..candidate import Candidate, not_compiled
from ..layout import Layout
from ..links import Link, host_round_trip, seconds, traffic
from ..measure.compiled import Measurement, Placed
from ..scale import extrapolate
from ..view import mesh_str, seconds_str


def not_measured(layout: Layout, *, exact: dict[str, int], reason: str, host: int = 0) -> Candidate:
    """The row of a layout not compiled (rejected, or dominated): its `exact` parts, known
    without compiling, and `host` bytes per device of optimiser state in host memory."""
    return not_compiled(
        layout,
        reason,
        bytes=dict(exact),
        total_bytes=sum(exact.values()) if exact else None,
        offload=("optimizer state",) if layout.offload else (),
        host_bytes=host,
    )


def from_measurement(
    layout: Layout,
    *,
    exact: dict[str, int],
    rejected: str,
    measured: Measurement | None,
    small: tuple[dict[str, int], Placed] | None,
    where: str,
    budget: int,
    links: dict[str, Link],
    flops_per_second: float,
    host: int = 0,
) -> Candidate:
    """One row of the table, unranked (`rank` 0), from its compile (`measured`; on the
    smaller mesh `small` when it is scaled). `host` is the bytes per device of the
    optimiser state held in host memory when `layout.offload` (the temporaries a backend
    counts in host memory apart, remat's offloaded activations on GPU, are added to it)."""
    offloaded = ("optimizer state",) if layout.offload else ()
    if measured is None:
        return not_measured(layout, exact=exact, reason=rejected, host=host)
    if small is None:
        parts = dict(exact)
        short = sum(exact.values()) - measured.total
        if short > 0 and "gradients" in parts:
            # The compiled step never holds every gradient at once (XLA fused their
            # update into the backward pass): the arguments are there, the rest is not.
            parts["gradients"] = max(parts["gradients"] - short, 0)
        parts["activations"] = max(measured.total - sum(parts.values()), 0)
        total, flops, found = (
            max(measured.total, sum(parts.values())),
            measured.flops,
            measured.collectives,
        )
        estimated = False
    else:
        shape, placed = small
        known_small = {
            "parameters": placed.parameters,
            "gradients": placed.gradients,
            "optimizer state": 0 if placed.offload else placed.opt_state,
            "batch": placed.batch,
        }
        pairs = {k: (known_small[k], v) for k, v in exact.items()}
        parts, flops, found = extrapolate.scale(measured, shape, layout.shape, pairs)
        total, estimated = sum(parts.values()), True
        where = f"estimated from a compile on {mesh_str(shape)} ({where})"
    sent: dict[str, int] = {}
    comm = 0.0
    for c in found:
        moved, _ = traffic(c.kind, c.bytes, c.group_size)
        sent[c.kind] = sent.get(c.kind, 0) + int(moved * c.count)
        comm += c.count * seconds(c.kind, c.bytes, c.group_size, c.axes, links)
    compute = flops / flops_per_second
    host_time = host_round_trip(host, links) if layout.offload else 0.0
    note = layout.note
    if layout.offload:
        pcie = f"optimiser state in host memory: {seconds_str(host_time)} of PCIe per step"
        note = f"{pcie}; {note}" if note else pcie
    order = {
        k: sent[k]
        for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
        if k in sent
    }
    return Candidate(
        rank=0,
        name=layout.name,
        mesh_shape=dict(layout.shape),
        rules=layout.rules,
        bytes=parts,
        total_bytes=int(total),
        collectives=order,
        communication_time=comm,
        compute_time=compute,
        time=comm + compute + host_time,
        fits=total <= budget,
        estimated=estimated,
        measured_on=where,
        reason=_with_pinned(rejected or note, measured),
        offload=offloaded,
        host_bytes=host + measured.host_temp,
        host_time=host_time,
    )


def _with_pinned(reason: str, measured: Measurement) -> str:
    """`reason`, and what XLA replicates of the step (`pinned`), if anything."""
    if not measured.pinned:
        return reason
    note = pinned.verdict(list(measured.pinned))
    return f"{reason}; {note}" if reason else note
