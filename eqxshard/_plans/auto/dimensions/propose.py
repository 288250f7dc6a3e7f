"""The propose phase: each dimension's layouts for the traced problem, in the registry's
order (the order they are compiled and, on ties, ranked), less the layout families
`exclude=` leaves out."""

from __future__ import annotations

from ..trace.phase import Traced
from .base import Dimension, Proposal
from .registry import FAMILIES


def propose(traced: Traced, dimensions: tuple[Dimension, ...]) -> Proposal:
    """What every dimension proposes, together, less the layouts of the families
    `traced.exclude` names (and their rows)."""
    proposal = Proposal()
    for dimension in dimensions:
        proposal += dimension.propose(traced)
    axes = {FAMILIES[n] for n in traced.exclude if n in FAMILIES}

    def kept(shape: dict[str, int]) -> bool:
        return not any(shape.get(a, 1) > 1 for a in axes)

    proposal = Proposal(
        tuple(v for v in proposal.layouts if kept(v.shape)),
        tuple(c for c in proposal.left_out if kept(c.mesh_shape)),
        tuple(v for v in proposal.above_limit if kept(v.shape)),
    )
    if traced.exclude and not proposal.layouts and not proposal.above_limit:
        left = ", ".join(sorted(traced.exclude))
        raise ValueError(
            f"`auto_plan` has no layout of {traced.devices} devices left to weigh with "
            f"`exclude` = {left}: each layout it would try uses one of these. Exclude fewer."
        )
    return proposal
