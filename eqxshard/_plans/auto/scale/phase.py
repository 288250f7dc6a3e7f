"""The scale phase: the layouts left over `compile_limit` by the dimensions that proposed
them (a stage mesh, today), weighed once the others are measured, and compiled on a
smaller mesh where they could win (`extrapolate`); then the rows of every layout left
out join the table."""

from __future__ import annotations

import dataclasses

from ..dimensions.base import Proposal, Search


def scale(search: Search, proposal: Proposal) -> Search:
    """`search` with the rows of the layouts above `compile_limit`, and of those left out."""
    left = proposal
    for dimension in search.dimensions:
        measured, left = dimension.scale(search, left)
        search = dataclasses.replace(search, measured=measured)
    return dataclasses.replace(search, measured=search.measured.plus(rows=left.left_out))
