"""`filter_stream`'s jitted chunk step, compiled once per kind of input and kept."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

from .chunks import _Trace, _vmapped_body
from .stream_host import NAME


def _aval(x: Any) -> tuple[Any, ...]:
    """What `jax.jit` compiles for: shape, dtype, weak type and sharding."""
    return (
        x.shape,
        x.dtype,
        getattr(x, "weak_type", False),
        getattr(x, "sharding", None),
    )


def _hashable(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


Step = tuple[Callable[..., Any], list[_Trace]]


def compiled_step(
    cache: dict[Any, Step],
    fun: Callable[..., Any],
    args_def: Any,
    static: list[Any],
    idx: list[int],
    const_idx: list[int],
    out_axes: Any,
    chunk: list[Any],
    consts: list[Any],
) -> Step:
    """The jitted chunk step, cached as `eqx.filter_jit` does: keyed by the non-array
    leaves (hashed) and the shapes, dtypes and shardings of the arrays. Unhashable
    non-array leaves get a fresh step (compiled on each call)."""
    key = (
        args_def,
        tuple((type(x), x) for x in static),
        tuple(idx),
        tuple(const_idx),
        _hashable(out_axes),
        tuple(_aval(x) for x in chunk),
        tuple(_aval(x) for x in consts),
    )
    try:
        hit = cache.get(key)
    except Exception:  # unhashable, or `==` that does not return a bool
        key, hit = None, None
    if hit is not None:
        return hit
    traces: list[_Trace] = []

    @jax.jit
    def step(chunk: list[Any], consts: list[Any]) -> Any:
        full = list(static)
        for i, c in zip(const_idx, consts, strict=True):
            full[i] = c
        return _vmapped_body(fun, args_def, full, idx, out_axes, traces, NAME)(chunk)

    if key is not None:
        cache[key] = (step, traces)
    return step, traces
