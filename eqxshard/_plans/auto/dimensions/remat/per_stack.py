"""Rematerialising some of a model's stacks, not all: those whose saved activations are
largest first, as few as make a layout fit.

A model with several `eqxshard.Stacked` layers (a wide encoder's and a narrow decoder's,
say) need not rematerialise all of them: each stack left alone recomputes nothing. What
each stack keeps on the device for the backward pass is read from the step's jaxpr
(`residuals`), with the model's own setting and with the policy; their difference is
what the policy saves on that stack (for `"offload"`, what it keeps in host memory is not
counted as saved twice: it is not on the device). When the layout compiled with the policy
on every stack fits, the bytes that compile saved (against the layout with the model's
own setting) are shared out in those proportions, and the fewest stacks, largest saving
first, whose share covers the layout's excess over the budget with a tenth to spare are
rematerialised alone, the others keeping their own setting: one more compile, which the
table shows as its own row. Where a stack's forward scan cannot be found in the jaxpr, no
mix is tried, and the row of the policy on every stack says so.
"""

from __future__ import annotations

import dataclasses

from ...candidate import Candidate
from ...layout import Layout
from .residuals import RematTrace

# The share of the excess over budget a mix must save by arithmetic before it is compiled.
HEADROOM = 1.1


def mix(
    base: Layout,
    without: Candidate,
    every: Candidate,
    policy: str,
    saving: dict[str, int] | None,
    budget: int,
    own: dict[str, str] | None = None,
) -> Layout | None:
    """The variant of `base` rematerialising only the stacks with the largest `saving`
    that together cover its excess over `budget` (`without`: its row without remat;
    `every`: its compiled row with `policy` on every stack; the other stacks keep their
    `own` policy, default `"none"`), or `None` where every stack is needed, `every` does
    not fit, or the shares are not known."""
    if saving is None or not every.fits:
        return None
    useful = [p for p in saving if saving[p] > 0]
    if len(useful) < 2:
        return None
    total = sum(saving.values())
    compiled = (without.total_bytes or 0) - (every.total_bytes or 0)
    excess = (without.total_bytes or 0) - budget
    if total <= 0 or compiled <= 0 or excess <= 0:
        return None
    chosen: list[str] = []
    covered = 0.0
    for path in sorted(saving, key=lambda p: -saving[p]):
        chosen.append(path)
        covered += compiled * saving[path] / total
        if covered >= HEADROOM * excess:
            break
    if len(chosen) >= len(useful):  # every stack that saves: the variant compiled already
        return None
    own = own or {}
    # A stack left out keeps its own setting (`configure` leaves it alone).
    remat = tuple(
        (p, policy if p in chosen else "none")
        for p in saving
        if p in chosen or own.get(p, "none") == "none"
    )
    on = ", ".join(chosen)
    return dataclasses.replace(base, name=f"{base.name} + remat {policy} on {on}", remat=remat)


def mixes(
    todo: list[tuple[Layout, Layout, Candidate]],
    made: list[tuple[Layout, Candidate]],
    traced: RematTrace,
    budget: int,
) -> tuple[list[tuple[Layout, Layout, Candidate]], list[tuple[Layout, Candidate]]]:
    """For the variants with a policy on every stack (`todo`: each with its base layout and
    row; `made`: each with its compiled row), the mixes worth compiling once more (each
    with its base layout and row), and `made` again, each row saying so where a mix could
    not be tried because a stack's scan was not found in the step."""
    out, rows = [], []
    missing = traced.missing()
    for (v, base, c), (layout, every) in zip(todo, made, strict=True):
        policy = next((p for _, p in v.remat if p != "none"), "none")
        if missing and len(traced.own) > 1:
            where = ", ".join(f"`{p}`" for p in missing)
            note = f"remat per stack not tried: the scan of {where} was not found in the step"
            every = dataclasses.replace(every, reason=f"{every.reason}; {note}")
        else:
            some = mix(base, c, every, policy, traced(policy), budget, traced.own)
            if some is not None:
                out.append((some, base, c))
        rows.append((layout, every))
    return out, rows
