"""The refine phase: each dimension's variants of the measured layouts, in the
registry's order (offload, then remat; see `base.Dimension.refine`)."""

from __future__ import annotations

import dataclasses

from .base import Search


def refine(search: Search) -> Search:
    """`search` with every dimension's refining rows added."""
    for dimension in search.dimensions:
        search = dataclasses.replace(search, measured=dimension.refine(search))
    return search
