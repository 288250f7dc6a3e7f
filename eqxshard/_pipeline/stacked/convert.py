"""Turning a list of blocks into one stack (`Stacked.from_layers`)."""

from __future__ import annotations

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
            rows.append((f"layers.{i}", "a structure or non-array leaves unlike layers[0]'s"))
            continue
        for (path, a), b in zip(first_leaves, jax.tree.leaves(params), strict=True):
            if a.shape != b.shape or a.dtype != b.dtype:
                rows.append(
                    (
                        pathstr(path, f"layers.{i}"),
                        f"{b.dtype}{shape_str(b.shape)}",
                        f"layers[0] has {a.dtype}{shape_str(a.shape)}",
                    )
                )
    if rows:
        width = max(len(r) for r in rows)
        rows = [r + ("",) * (width - len(r)) for r in rows]
        raise ValueError(
            leaf_error(
                "`Stacked.from_layers` needs blocks of one structure, with the same "
                "non-array leaves and array shapes and dtypes; these differ from layers[0]:",
                rows,
                "Stack only the repeated blocks (keep a differing first or last layer "
                "outside the stack), or make the blocks alike.",
            )
        )
    stacked = jax.tree.map(
        lambda *xs: jnp.stack(xs), *[eqx.filter(x, eqx.is_array) for x in layers]
    )
    return eqx.combine(stacked, first_static)
