"""The host side of `filter_stream`: checking the streamed leaves, and cutting their rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._tree import leaf_table

NAME = "filter_stream"


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


def rows_from_host(leaf: Any, start: int, stop: int, size: int, sharding: Any) -> jax.Array:
    """`host_chunk(leaf, start, stop, size)` laid out as `sharding`, reading from `leaf`
    only the rows this process's devices hold (with a mesh over several processes, no
    process reads the others' rows of an h5py/zarr dataset or `np.memmap`)."""
    shape = getattr(leaf, "shape", None)
    if shape is None:  # an indexable without a shape: its first row tells the rest
        shape = np.shape(np.asarray(leaf[start : start + 1]))
    rows_shape = (size, *tuple(shape)[1:])

    def piece(index: Any) -> np.ndarray:  # a tuple of slices (`None`: the whole chunk)
        index = tuple(index or ())
        lo, hi, _ = (index[0] if index else slice(None)).indices(size)
        first, end = start + lo, min(start + hi, stop)
        part = np.asarray(leaf[first:end] if first < end else leaf[stop - 1 : stop])
        have = max(end - first, 0)
        if have < hi - lo:  # rows past the data repeat the chunk's last, as `host_chunk`'s
            part = np.concatenate([part[:have], np.repeat(part[-1:], hi - lo - have, axis=0)])
        return part[(slice(None), *index[1:])]

    return jax.make_array_from_callback(rows_shape, sharding, piece)


def output_to_host(x: jax.Array) -> Any:
    """An output chunk as NumPy (PRNG keys, which NumPy cannot hold, as they are:
    `jax.device_get`)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_get(x)
    if not x.is_fully_addressable:  # a mesh over several processes: every one gets it all
        return np.asarray(_compat.process_allgather(x, tiled=True))
    return np.asarray(x)


def streamable(leaf: Any, axis: int) -> bool:
    """A host object `filter_stream` can cut rows of along `axis`."""
    if not hasattr(leaf, "__getitem__"):
        return False
    if not (hasattr(leaf, "shape") or hasattr(leaf, "__len__")):
        return False
    return axis == 0 or isinstance(leaf, np.ndarray | jax.Array)


def shape_of(leaf: Any) -> tuple[int, ...]:
    """The shape of an array, or `(len(leaf),)` for a host sequence of rows."""
    return tuple(leaf.shape) if hasattr(leaf, "shape") else (len(leaf),)


def check_dtypes(name: str, paths: list[str], leaves: list[Any]) -> None:
    """Raises naming every array leaf of a dtype JAX has no arrays of (NumPy strings,
    objects, ...), before JAX refuses it without a path."""
    bad = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, np.ndarray | np.generic | jax.Array) and not _compat.is_jax_dtype(x.dtype)
    ]
    if bad:
        raise TypeError(
            f"`{name}` got array arguments whose dtype JAX has no arrays of:\n"
            + leaf_table([(paths[i], f"dtype {leaves[i].dtype}") for i in bad])
            + "\nConvert them to a numeric dtype, or pass them in a static field "
            "(`eqx.field(static=True)`) or by closure."
        )
