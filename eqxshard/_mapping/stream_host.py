"""The host side of `filter_stream`: checking the streamed leaves, and cutting their rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .chunks import check_axes_in_range, check_same_size, path_table

NAME = "filter_stream"


def _rows(leaf: Any, axis: int) -> int:
    shape = getattr(leaf, "shape", None)
    return int(shape[axis]) if shape is not None else len(leaf)


def check_mapped(paths: list[str], leaves: list[Any], axes: dict[int, int]) -> int:
    """Checks the streamed leaves; returns their common number of rows."""
    bad = [
        i
        for i, a in axes.items()
        if not hasattr(leaves[i], "__getitem__")
        or not (hasattr(leaves[i], "shape") or hasattr(leaves[i], "__len__"))
        or (a != 0 and not isinstance(leaves[i], np.ndarray | jax.Array))
    ]
    if bad:
        raise TypeError(
            f"`{NAME}` streams rows of arrays or of host objects that support `len(x)` (or "
            "`x.shape`) and slicing `x[i:j]` along axis 0 (other axes: NumPy/JAX arrays "
            "only); these mapped leaves do not fit:\n"
            + path_table(
                [paths[i] for i in bad],
                [f"{type(leaves[i]).__name__}  in_axes {axes[i]}" for i in bad],
            )
            + "\nConvert them with `np.asarray`, or give them `in_axes=None` to broadcast them."
        )
    ndims = {i: len(leaves[i].shape) if hasattr(leaves[i], "shape") else 1 for i in axes}
    check_axes_in_range(NAME, paths, axes, ndims, lambda i: f"{ndims[i]} dims  in_axes {axes[i]}")
    sizes = {i: _rows(leaves[i], a) for i, a in axes.items()}
    return check_same_size(
        NAME,
        paths,
        sizes,
        "number of rows",
        lambda i: f"{sizes[i]} rows",
        "Slice them to one length, or broadcast some with `in_axes=None`.",
    )


def host_chunk(leaf: Any, start: int, stop: int, size: int) -> Any:
    """Rows `[start, stop)` of `leaf`, padded to `size` rows by repeating the last row."""
    chunk = leaf[start:stop]
    xnp = jnp if isinstance(chunk, jax.Array) else np
    if not isinstance(chunk, jax.Array):
        chunk = np.asarray(chunk)
    if stop - start < size:
        pad = xnp.repeat(chunk[-1:], size - (stop - start), axis=0)
        chunk = xnp.concatenate([chunk, pad])
    return chunk


def output_to_host(x: jax.Array) -> Any:
    """An output chunk as NumPy (PRNG keys, which NumPy cannot hold, as they are:
    `jax.device_get`)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_get(x)
    if not x.is_fully_addressable:  # a mesh over several processes: every one gets it all
        return np.asarray(_compat.process_allgather(x, tiled=True))
    return np.asarray(x)
