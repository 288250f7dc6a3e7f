"""The measure phase: each proposed layout laid out on its mesh and compiled (here, in a
subprocess with more CPU devices, or drawn through two compiles of smaller batches),
and its row read from the compile."""

from __future__ import annotations

from ..dimensions.base import Dimension, Measured, Proposal, Search
from ..trace.phase import Traced
from . import batch_proxies


def measure(traced: Traced, dimensions: tuple[Dimension, ...], proposal: Proposal) -> Search:
    """The search with a row for every layout of `proposal` (those over `compile_limit`
    left to the scale phase)."""
    search = Search(traced, dimensions, Measured((), ()))
    work = [search.lay_out(layout) for layout in proposal.layouts]
    search.compile(work, grouped=True)
    t, row = traced, search.row
    batch_proxies.settle(
        t.problem, t.problem_key, work, local=t.local, progress=t.progress, row=row, budget=t.budget
    )
    return Search(traced, dimensions, Measured(tuple(work), tuple(search.row(j) for j in work)))
