"""A `filter_jit` call's leaves split into the traced (array) part and the static part,
in one pass over the leaves; the input signature of the array part; and the static part
as the cache key, with the error for static leaves that cannot be one.

This is `eqx.partition(leaves, eqx.is_array)` made cheap for a step called thousands of
times: whether a leaf is an array, a NumPy array or a tracer depends on its type only,
so each type is classified once and every later leaf of that type costs a dict lookup.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx

from .._caches import register
from .._compat import is_tracer
from .._tree import Flat, leaf_error, pathstr

UNSET: Any = object()  # the place of an array leaf in the static part

STATIC, ARRAY, HOST, TRACED = 0, 1, 2, 3
# What each leaf type is (one of the four above), found once per type.
KINDS: dict[type, int] = {}
register(KINDS.clear)


def _kind(x: Any) -> int:
    if is_tracer(x):
        kind = TRACED
    elif not eqx.is_array(x):
        kind = STATIC
    else:
        kind = ARRAY if hasattr(x, "aval") else HOST  # NumPy arrays and scalars: no aval
    KINDS[type(x)] = kind
    return kind


class Split:
    """`static`: the leaves with `UNSET` for each array leaf (hashable when the static
    leaves are); `dynamic`: the array leaves in order; `traced`: some array leaf is a
    tracer; `host`: some array leaf is NumPy data."""

    __slots__ = ("dynamic", "host", "static", "traced")

    def __init__(self, leaves: list[Any]):
        kinds = KINDS
        static: list[Any] = []
        dynamic: list[Any] = []
        seen = 0
        for x in leaves:
            kind = kinds.get(type(x))
            if kind is None:
                kind = _kind(x)
            if kind:
                dynamic.append(x)
                static.append(UNSET)
                seen |= 1 << kind
            else:
                static.append(x)
        self.static, self.dynamic = tuple(static), dynamic
        self.traced, self.host = bool(seen & (1 << TRACED)), bool(seen & (1 << HOST))

    @property
    def is_array(self) -> list[bool]:
        return [x is UNSET for x in self.static]

    def signature(self) -> tuple:
        """Each array leaf's abstract value (shape, dtype, weak type, and what JAX adds):
        a JAX array's own `aval`, NumPy's shape and dtype."""
        if not self.host:
            return tuple([x.aval for x in self.dynamic])
        return tuple(
            [(x.shape, x.dtype) if KINDS[type(x)] == HOST else x.aval for x in self.dynamic]
        )


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
