"""Compiled programs cached across eager calls, keyed as `eqx.filter_jit` keys them: the
static (non-array) parts of the arguments hashed, the arrays by shape, dtype (weak types
included) and sharding (which `jax.jit` keys on itself)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu


def static_key(x: Any) -> Hashable:
    """`x` itself where it is hashable, else its identity (an unhashable static leaf is
    then the same only as itself)."""
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return x


class Programs:
    """One `eqx.filter_jit` program of `fn` per static part of its arguments.

    `fn(*args)` must depend only on the static leaves of `args` and the values of its
    array leaves (as for `eqx.filter_jit`). An eager call whose statics were seen before
    reuses that program: `jax.jit` then compiles once per array shapes, dtypes and
    shardings, as `eqx.filter_jit` does. At most `size` static parts are kept; each entry
    holds on to its static leaves, so an unhashable leaf's identity cannot be reused by
    another object while its entry lives.
    """

    def __init__(self, fn: Callable[..., Any], size: int = 32):
        self.fn = fn
        self.size = size
        self.cache: OrderedDict[Hashable, Callable[[Any], Any]] = OrderedDict()

    def __call__(self, *args: Any) -> Any:
        dynamic, static = eqx.partition(args, eqx.is_array)
        static_leaves, static_def = jtu.tree_flatten(static)
        key = (
            jtu.tree_structure(dynamic),
            static_def,
            tuple((type(s), static_key(s)) for s in static_leaves),
        )
        program = self.cache.get(key)
        if program is None:
            fn = self.fn

            def run(dynamic: Any) -> Any:
                return fn(*eqx.combine(dynamic, static))

            program = self.cache[key] = eqx.filter_jit(run)
            while len(self.cache) > self.size:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return program(dynamic)
