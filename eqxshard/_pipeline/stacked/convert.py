"""Turning a list of blocks into one stack (`Stacked.from_layers`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._tree import leaf_error, pathstr, shape_str


def _static_equal(a: Any, b: Any) -> bool:
    try:
        return bool(eqx.tree_equal(a, b))
    except Exception:  # a non-array leaf whose `==` raises: compared by identity instead
        return a is b


class _Array(str):
    """An array leaf as `_leaves` gives it: its dtype and shape."""


def _leaves(block: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of `block` by its dotted path, static fields of modules included (they
    are part of a block's structure), arrays as `_Array("dtype(shape)")`."""
    if isinstance(block, eqx.Module):
        children = [(f.name, getattr(block, f.name, None)) for f in dataclasses.fields(block)]
    elif isinstance(block, (list, tuple)):
        children = [(str(k), x) for k, x in enumerate(block)]
    elif isinstance(block, dict):
        children = [(str(k), x) for k, x in block.items()]
    elif eqx.is_array(block):
        return {path: _Array(f"{block.dtype}{shape_str(block.shape)}")}
    else:
        return {path: block}
    out: dict[str, Any] = {path: type(block)} if path or children else {}
    for name, x in children:
        out |= _leaves(x, f"{path}.{name}" if path else name)
    return out


def _unlike(first: Any, block: Any, i: int) -> list[tuple[str, ...]]:
    """The rows naming where block `i` differs in structure or non-array leaves from
    `layers[0]`: the fields one has and the other lacks, and non-array leaves unlike."""
    mine, theirs = _leaves(block), _leaves(first)
    rows: list[tuple[str, ...]] = []
    for path in mine.keys() | theirs.keys():
        where = f"layers.{i}.{path}" if path else f"layers.{i}"
        if path not in theirs:
            rows.append((where, "a leaf layers.0 lacks", ""))
        elif path not in mine:
            rows.append((where, "missing", f"layers.0 has {_short(theirs[path])}"))
        elif isinstance(mine[path], _Array) and isinstance(theirs[path], _Array):
            continue  # arrays: compared by shape once the structure matches
        elif not _static_equal(mine[path], theirs[path]):
            rows.append((where, _short(mine[path]), f"layers.0 has {_short(theirs[path])}"))
    if not rows:  # the same leaves, arranged differently (e.g. a list for a tuple)
        rows.append((f"layers.{i}", "a structure unlike layers.0's", ""))
    return sorted(rows)


def _short(x: Any) -> str:
    if isinstance(x, _Array):
        return str(x)
    text = getattr(x, "__qualname__", None) or repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def stack_layers(layers: Sequence[Any]) -> Any:
    """The blocks of `layers` as one block whose array leaves have a leading layer dim.

    Checks first that every block has the first one's structure, non-array leaves, and
    array shapes and dtypes; lists every leaf that differs.
    """
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(
            f"`Stacked.from_layers` got `layers` of type {type(layers).__name__}"
            f"{' (empty)' if isinstance(layers, Sequence) and not layers else ''}; expected "
            "a non-empty list (or tuple) of blocks of one structure, e.g. `model.layers`."
        )
    first_params, first_static = eqx.partition(layers[0], eqx.is_array)
    first_def = jax.tree.structure(first_params)
    first_leaves = jax.tree_util.tree_flatten_with_path(first_params)[0]
    rows: list[tuple[str, ...]] = []
    for i, layer in enumerate(layers[1:], start=1):
        params, static = eqx.partition(layer, eqx.is_array)
        if jax.tree.structure(params) != first_def or not _static_equal(static, first_static):
            rows += _unlike(layers[0], layer, i)
            continue
        for (path, a), b in zip(first_leaves, jax.tree.leaves(params), strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                rows.append(
                    (
                        pathstr(path, f"layers.{i}"),
                        f"{b.dtype}{shape_str(b.shape)}",
                        f"layers.0 has {a.dtype}{shape_str(a.shape)}",
                    )
                )
    if rows:
        width = max(len(r) for r in rows)
        rows = [r + ("",) * (width - len(r)) for r in rows]
        raise ValueError(
            leaf_error(
                "`Stacked.from_layers` needs blocks of one structure, with the same "
                "non-array leaves and array shapes and dtypes; these differ from layers.0:",
                rows,
                "Stack only the repeated blocks (keep a differing first or last layer "
                "outside the stack), or make the blocks alike.",
            )
        )
    stacked = jax.tree.map(
        lambda *xs: jnp.stack(xs), *[eqx.filter(x, eqx.is_array) for x in layers]
    )
    return eqx.combine(stacked, first_static)
