"""A call's leaves split into the traced (array) part and the static part, in one pass
over the leaves, and the input signature of the array part.

This is `eqx.partition(leaves, eqx.is_array)` made cheap for a step called thousands of
times: whether a leaf is an array, a NumPy array or a tracer depends on its type only,
so each type is classified once and every later leaf of that type costs a dict lookup.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx

from .._compat import is_tracer

UNSET: Any = object()  # the place of an array leaf in the static part

STATIC, ARRAY, HOST, TRACED = 0, 1, 2, 3
_KINDS: dict[type, int] = {}


def _kind(x: Any) -> int:
    if is_tracer(x):
        kind = TRACED
    elif not eqx.is_array(x):
        kind = STATIC
    else:
        kind = ARRAY if hasattr(x, "aval") else HOST  # NumPy arrays and scalars: no aval
    _KINDS[type(x)] = kind
    return kind


class Split:
    """`static`: the leaves with `UNSET` for each array leaf (hashable when the static
    leaves are); `dynamic`: the array leaves in order; `traced`: some array leaf is a
    tracer; `host`: some array leaf is NumPy data."""

    __slots__ = ("dynamic", "host", "static", "traced")

    def __init__(self, leaves: list[Any]):
        kinds = _KINDS
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
            [(x.shape, x.dtype) if _KINDS[type(x)] == HOST else x.aval for x in self.dynamic]
        )
