"""The static part of a `filter_jit` call as a cache key, and the error for static
leaves that cannot be one."""

from __future__ import annotations

from typing import Any

from .._tree import Flat, leaf_error, pathstr


def hashable_key(key: Any, flat: Flat) -> Any:
    """`key` (the static part of a call), or a `TypeError` naming every unhashable
    static leaf: as in `eqx.filter_jit`, static leaves are the cache key."""
    try:
        hash(key)
    except TypeError:
        rows = []
        for i, x in enumerate(flat.leaves):
            if flat.is_array[i]:
                continue
            try:
                hash(x)
            except TypeError:
                rows.append((call_path(flat.paths[i]), type(x).__name__))
        raise TypeError(
            leaf_error(
                "`filter_jit` holds non-array leaves static (as `eqx.filter_jit` does), so "
                "they must be hashable, but these are not:",
                rows or [("<call>", "the call's structure")],
                "Make them hashable (e.g. a tuple, not a list, inside a static field), or "
                "pass them as arrays.",
            )
        ) from None
    return key


def call_path(path: Any) -> str:
    """A path into a call's `(fun, args, kwargs)` as users name it: `args.0.weight`."""
    part, rest = path[0].idx, path[1:]
    return pathstr(rest, ("fun", "args", "kwargs")[part])
