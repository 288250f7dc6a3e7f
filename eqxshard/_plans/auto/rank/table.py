"""From measurements to the ranked table: each candidate's parts, times and verdict, and
the error when nothing fits."""

from __future__ import annotations

import dataclasses
import math

from ...._tree import format_bytes
from ..candidate import NothingFits
from ..result import Candidate
from ..view import mesh_str, seconds_str, text

# How many of the closest rows the error of a search where nothing fits shows.
CLOSEST_SHOWN = 5


def _dominant(c: Candidate) -> tuple[str, int]:
    return max(c.bytes.items(), key=lambda kv: kv[1])


def _slower(c: Candidate, best: Candidate) -> str:
    """Why a fitting candidate lost to `best`: its time, and which part of it is longer."""
    ratio = (c.time or 0) / (best.time or 1)
    if ratio < 1.005:
        return "fits, as fast as the chosen one (a tie: it goes to less memory, fewer axes)"
    why = []
    extra = sum(c.collectives.values()) - sum(best.collectives.values())
    if extra > 0:
        why.append(f"{format_bytes(extra)} more sent per device")
    if (c.communication_time or 0) > (best.communication_time or 0):
        why.append(
            f"communication {seconds_str(c.communication_time)} vs "
            f"{seconds_str(best.communication_time)}"
        )
    if (c.compute_time or 0) > (best.compute_time or 0) * 1.005:
        why.append(f"compute {seconds_str(c.compute_time)} vs {seconds_str(best.compute_time)}")
    if c.host_time > best.host_time * 1.005:  # offloaded state or activations over PCIe
        host = f"{seconds_str(c.host_time)} vs {seconds_str(best.host_time)}"
        why.append(f"host memory traffic {host}")
    return f"fits, but {ratio:.2f}x the chosen step time: {', '.join(why)}"


def ranked(candidates: list[Candidate], budget: int) -> list[Candidate]:
    """Fitting candidates fastest first, then the others smallest first; with reasons."""
    # Ties (within 0.5%) go to the smaller footprint, then to the mesh with fewer axes.
    fits = sorted(
        (c for c in candidates if c.fits),
        key=lambda c: (
            round(math.log(max(c.time or 0, 1e-12)) / 0.005),
            c.total_bytes,
            len(c.mesh_shape),
        ),
    )
    measured = sorted(
        (c for c in candidates if not c.fits and c.time is not None),
        key=lambda c: c.total_bytes or 0,
    )
    rest = [c for c in candidates if not c.fits and c.time is None]
    rest.sort(key=lambda c: math.inf if c.total_bytes is None else c.total_bytes)
    table = []
    best = fits[0] if fits else None
    for c in fits + measured + rest:
        reason = c.note()
        if c is best:
            spare = format_bytes(budget - (c.total_bytes or 0))
            why = (
                "the only one that fits"
                if len(fits) == 1
                else f"the fastest of {len(fits)} that fit"
            )
            reason = f"chosen: fits with {spare} to spare; {why}"
        elif c.fits and best is not None and best.time:
            reason = _slower(c, best)
        elif c.time is not None:
            part, size = _dominant(c)
            over = format_bytes((c.total_bytes or 0) - budget)
            reason = f"over budget by {over} (most is {part}: {format_bytes(size)})"
        # A remat row's own "fits with X to spare" (or "still X over") is said once: by
        # the verdict above where it says so.
        note = c.note(with_budget=not (c is best or (c.time is not None and not c.fits)))
        if c.time is not None and note and note not in reason:
            reason = f"{reason}; {note}"  # the layout's note
        ranked_row = dataclasses.replace(
            c, rank=len(table) + 1, reason=reason, choice_note="", budget_note=""
        )
        table.append(ranked_row)
    return table


def budget_str(n: int) -> str:
    """`n` bytes as a `budget=` string that is no less than `n` (`format_bytes` rounded
    up): `"2.4MiB"`."""
    return format_bytes(n, round_up=True, sep="")


def nothing_fits(table: list[Candidate], budget: int, n: int, size: int) -> NothingFits:
    """The error of a search where no row of `table` (ranked) fits `budget`."""
    measured = [c for c in table if c.total_bytes is not None]
    if not measured:
        reasons = "\n".join(f"  {c.name} on {mesh_str(c.mesh_shape)}: {c.reason}" for c in table)
        return NothingFits(
            f"`auto_plan` could not build any layout of {n} devices:\n{reasons}\n"
            "Make the batch divisible by the device count, or pass `rules=` that suit the model.",
            table,
            None,
        )
    smallest = min(measured, key=lambda c: c.total_bytes or 0)
    part, part_bytes = _dominant(smallest)
    helps = [f"more devices (now {n})"]
    ways = math.prod(smallest.mesh_shape.get(a, 1) for a in ("data", "fsdp"))
    smaller_batch = f"a smaller batch (now {size}, {size // ways} per device)"
    remats = [c for c in measured if c.remat and c.time is not None]
    tried = ""
    own = any(c.remat and "it saves nothing" in c.reason for c in table)
    if remats or own:
        tried = (
            " The stacked layers' own `remat` keeps the least on the device already: no "
            "other policy saves anything (their rows say so)."
        )
    if remats:
        policies = sorted({p for c in remats for p in c.remat.values() if p != "none"})
        best = min(remats, key=lambda c: c.total_bytes or 0)
        over = format_bytes((best.total_bytes or 0) - budget)
        tried = (
            f" Rematerialising the stacked layers was tried ({', '.join(policies)}): the "
            f"smallest with it ({best.name} on {mesh_str(best.mesh_shape)}) is still "
            f"{over} over."
        )
    if remats or own:
        if part in ("activations", "batch"):
            helps.append(smaller_batch)
        helps += ["a smaller optimiser state (e.g. bfloat16 moments)"]
    elif part in ("activations", "batch"):
        helps += [
            "activation checkpointing in `step` (`eqx.filter_checkpoint` or `jax.checkpoint` "
            "around each block)",
            smaller_batch,
        ]
    else:
        helps += ["a smaller optimiser state (e.g. bfloat16 moments)", "lower-precision parameters"]
    message = (
        f"`auto_plan`: no layout of {n} devices fits `budget` = {format_bytes(budget)} per "
        f"device. The smallest footprint is {format_bytes(smallest.total_bytes or 0)} per device "
        f"({smallest.name} on {mesh_str(smallest.mesh_shape)}), most of it {part} "
        f"({format_bytes(part_bytes)}).{tried} What would help: {'; '.join(helps)}."
    )
    # The least budget that fits is a compiled row's (a row rejected before its compile
    # shows a part of its footprint only).
    compiled = [c for c in table if c.time is not None and c.total_bytes is not None]
    if not compiled:  # every layout ruled out before its compile: a floor is known
        floor = smallest.total_bytes or 0
        return NothingFits(
            f"{message}\n\nEvery layout was over budget before its activations, so none "
            f"was compiled: the least of them needs {format_bytes(floor)} per device before "
            "its activations (a budget above that compiles the closest, and names the least "
            "budget that fits).",
            table,
            None,
        )
    least = min(c.total_bytes or 0 for c in compiled)
    closest = sorted(compiled, key=lambda c: c.total_bytes or 0)[:CLOSEST_SHOWN]
    shown = (
        f"The closest compiled layouts ({len(closest)} of the {len(table)} rows, all in the "
        "error's `table`):"
    )
    return NothingFits(
        f"{message}\n\nThe least budget that fits: {budget_str(least)} "
        f"(`budget={least}`, the error's `smallest_budget`; the compiles are "
        f"cached, so the same search with it is quick).\n\n{text(closest, shown)}",
        table,
        least,
    )
