"""`auto_plan`'s cache of compiled results, and the keys it is read by.

A key holds what it was made from: an unhashable leaf (a static of the model that does
not hash) is held by identity, its object kept alive by the key (`Identity`), so that no
other object can take its `id` while the entry lives and be mistaken for it. The cache
is emptied by `eqxshard.clear_caches` (registered with `_caches`)."""

from __future__ import annotations

from typing import Any

import jax

from ...._caches import register
from ...._tree import is_array_like
from .compiled import Measurement

# Compiled results, per (step, shapes, mesh shape, rules, batch on that mesh): a second
# call with the same inputs compiles nothing.
CACHE: dict[Any, Measurement] = {}
register(CACHE.clear)


class Identity:
    """An unhashable object as part of a key: equal only to a key of the same object,
    which it keeps alive (so its `id` cannot be reused while the key exists)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"Identity({type(self.obj).__name__} at {id(self.obj):#x})"


def hashable(x: Any) -> Any:
    """`x` if it hashes, else `Identity(x)`."""
    try:
        hash(x)
    except TypeError:
        return Identity(x)
    return x


def shapes_key(tree: Any) -> Any:
    """A tree's structure, its array leaves' shapes and dtypes, and its other leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_array_like)
    return treedef, tuple(
        (tuple(x.shape), str(x.dtype)) if is_array_like(x) else hashable(x) for x in leaves
    )
