"""`auto_plan`'s cache of compiled results, and the keys it is read by."""

from __future__ import annotations

from typing import Any

import jax

from ...._tree import is_array_like
from .compiled import Measurement

# Compiled results, per (step, shapes, mesh shape, rules, batch on that mesh): a second
# call with the same inputs compiles nothing.
CACHE: dict[Any, Measurement] = {}


def hashable(x: Any) -> Any:
    """`x` if it hashes, else its identity."""
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return x


def shapes_key(tree: Any) -> Any:
    """A tree's structure, its array leaves' shapes and dtypes, and its other leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_array_like)
    return treedef, tuple(
        (tuple(x.shape), str(x.dtype)) if is_array_like(x) else hashable(x) for x in leaves
    )
