"""`axis_name` in `filter_map`: checking it, and refusing collectives over it in chunks."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .chunks import is_int


def check_axis_name_size(axis_name: Any, axis_size: Any, name: str) -> None:
    """Raises if `axis_name` is not hashable or `axis_size` is not `None` or an int >= 0."""
    if not isinstance(axis_name, Hashable):
        raise TypeError(
            f"`{name}(axis_name=...)` must be hashable (a string, usually), got "
            f"{type(axis_name).__name__}."
        )
    if axis_size is None:
        return
    if not is_int(axis_size):
        raise TypeError(
            f"`{name}(axis_size=...)` must be `None` or an int, got {axis_size!r} of type "
            f"{type(axis_size).__name__}."
        )
    if axis_size < 0:
        raise ValueError(f"`{name}(axis_size=...)` must be >= 0, got {axis_size}.")


def _is_axis(value: Any, axis_name: Hashable) -> bool:
    try:
        if isinstance(value, tuple | list):
            return any(_is_axis(v, axis_name) for v in value)
        return type(value) is type(axis_name) and bool(value == axis_name)
    except Exception:
        return False


def _subjaxprs(value: Any) -> list[Any]:
    if isinstance(value, tuple | list):
        return [j for v in value for j in _subjaxprs(v)]
    if hasattr(value, "eqns"):
        return [value]
    if hasattr(getattr(value, "jaxpr", None), "eqns"):
        return [value.jaxpr]
    return []


def _uses_axis(jaxpr: Any, axis_name: Hashable) -> list[str]:
    found = []
    for eqn in jaxpr.eqns:
        for key, value in eqn.params.items():
            if "ax" in key and _is_axis(value, axis_name):
                found.append(str(eqn.primitive))
            for sub in _subjaxprs(value):
                found.extend(_uses_axis(sub, axis_name))
    return found


def check_no_collectives(
    fun: Callable,
    args_def: Any,
    leaves: list[Any],
    idx: list[int],
    rows: list[Any],
    n: int,
    axis_name: Hashable,
    batch_size: int | None,
    name: str,
) -> None:
    """Raises if `fun` uses a collective over `axis_name` (e.g. `psum`, `axis_index`): in
    chunks it would only see the rows of one chunk, not all `n` rows as under `vmap`.

    `rows` are the mapped leaves with the mapped axis first."""

    def row_fun(row: list[Any], rest: list[Any]) -> list[Any]:
        full = list(leaves)
        for i, x in zip(idx, row, strict=True):
            full[i] = x
        for i, x in zip(rest_idx, rest, strict=True):
            full[i] = x
        return [
            x for x in jtu.tree_leaves(fun(*jtu.tree_unflatten(args_def, full))) if eqx.is_array(x)
        ]

    rest_idx = [i for i, x in enumerate(leaves) if i not in idx and eqx.is_array(x)]
    row = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in rows]
    rest = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in rest_idx]
    jaxpr = jax.make_jaxpr(row_fun, axis_env=[(axis_name, n)])(row, rest)
    found = sorted(set(_uses_axis(jaxpr.jaxpr, axis_name)))
    if found:
        raise ValueError(
            f"`{name}(axis_name={axis_name!r})`: `fun` uses collectives over the mapped axis "
            f"({', '.join(found)}), but `batch_size={batch_size}` maps the {n} rows in chunks, "
            "and a collective in a chunk would see only that chunk's rows, giving other values "
            f"than `eqx.filter_vmap`. Pass `batch_size` >= {n} (one chunk), use "
            "`eqx.filter_vmap`, or return per-row values and reduce them after the map."
        )
