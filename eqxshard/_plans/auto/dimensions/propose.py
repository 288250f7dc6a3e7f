"""The propose phase: each dimension's layouts for the traced problem, in the registry's
order (the order they are compiled and, on ties, ranked)."""

from __future__ import annotations

from ..trace.phase import Traced
from .base import Dimension, Proposal


def propose(traced: Traced, dimensions: tuple[Dimension, ...]) -> Proposal:
    """What every dimension proposes, together."""
    proposal = Proposal()
    for dimension in dimensions:
        proposal += dimension.propose(traced)
    return proposal
