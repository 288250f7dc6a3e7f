"""What placement needs when a sharding spans several processes (hosts).

Two cheap cross-process checks, each one small collective for the whole tree:
- host data passed as global must be identical on every process (a per-leaf checksum);
- process-local data must have the same local shape on every process.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from . import _compat
from ._tree import Path, leaf_error, pathstr, shape_str


def to_host(x: Any) -> np.ndarray:
    """A leaf as a host NumPy array (PRNG keys as their key data)."""
    if _compat.is_prng_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def from_host(data: np.ndarray, like: Any, sharding: Sharding) -> jax.Array:
    """Puts host data on `sharding`, as a PRNG key array again if `like` was one."""
    if _compat.is_prng_key(like):
        placed = jax.device_put(data, sharding)
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(like))
    return jax.device_put(data, sharding)


def _checksum(x: np.ndarray) -> int:
    header = f"{x.dtype.str}{x.shape}".encode()
    data = np.ascontiguousarray(x).data  # a buffer view: no copy
    return (zlib.crc32(header) << 32) | zlib.crc32(data)


def check_identical(verb: str, paths: Sequence[Path], host: Sequence[np.ndarray]) -> None:
    """Raises unless every process passed the same data for each leaf."""
    local = np.array([_checksum(x) for x in host], dtype=np.uint64).reshape(len(host))
    everywhere = _compat.allgather_host(local)
    rows = []
    for j, (path, x) in enumerate(zip(paths, host, strict=True)):
        column = everywhere[:, j]
        if (column != column[0]).any():
            differ = [p for p in range(len(column)) if column[p] != column[0]]
            rows.append((pathstr(path), f"shape {shape_str(x.shape)}", f"differs on {differ}"))
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` was given different data on different processes for leaves it must "
                "place as one global array (processes listed are those that differ from "
                "process 0):",
                rows,
                "Pass identical data on every process; if each process holds its own part "
                "(e.g. its slice of a batch), pass `process_local=True`. To skip this check "
                "(one checksum per leaf), pass `check_consistent=False`.",
            )
        )


def check_local_shapes(verb: str, paths: Sequence[Path], host: Sequence[Any]) -> None:
    """Raises unless every process passed the same local shape for each leaf."""
    ranks = _compat.allgather_host(np.array([np.ndim(x) for x in host], dtype=np.int64))
    width = int(ranks.max(initial=0))
    shapes = np.full((len(host), width + 1), -1, dtype=np.int64)
    for j, x in enumerate(host):
        shapes[j, 0] = np.ndim(x)
        shapes[j, 1 : 1 + np.ndim(x)] = np.shape(x)
    everywhere = _compat.allgather_host(shapes)
    rows = []
    for j, path in enumerate(paths):
        per_process = everywhere[:, j]
        if (per_process != per_process[0]).any():
            seen = ", ".join(
                f"process {p}: {shape_str(tuple(int(d) for d in row[1 : 1 + row[0]]))}"
                for p, row in enumerate(per_process)
            )
            rows.append((pathstr(path), seen))
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` with `process_local=True` needs the same local shape on every "
                "process, but got:",
                rows,
                "Give every process a local part of the same shape (e.g. the same per-process "
                "batch size), padding the last batch if needed.",
            )
        )


def from_process_local(x: Any, sharding: Sharding) -> jax.Array:
    """One global array from each process's local part (`process_local=True`)."""
    data = to_host(x)
    if _compat.is_prng_key(x):
        placed = jax.make_array_from_process_local_data(sharding, data)
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, data)
