"""What placement needs when a sharding spans several processes (hosts).

Two cheap cross-process checks, each one small collective for the whole tree:
- host data must have the same shape on every process (its local part's shape, with
  `process_local=True`): a hash per leaf, checked before anything else looks at shapes;
- host data passed as global must be identical on every process (a per-leaf checksum).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec, Sharding

from . import _compat
from ._tree import Flat, Path, leaf_error, pathstr, shape_str


def is_process_local(x: Any) -> bool:
    """Whether this process holds all of `x` (NumPy data, or a fully addressable array)."""
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def to_host(x: Any) -> np.ndarray:
    """A leaf as a host NumPy array (PRNG keys as their key data)."""
    if _compat.is_prng_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def from_host(data: np.ndarray, like: Any, sharding: Sharding) -> jax.Array:
    """Puts host data on a `sharding` that spans several processes, as a PRNG key array
    again if `like` was one.

    Each process fills its own devices from its own copy. This is not `device_put`: on
    host data bound for other processes, `device_put` all-gathers the whole value to
    compare it across processes (which `check_identical` does with one checksum per leaf,
    and `check_consistent=False` turns off). While tracing, the data is staged instead: a
    global array cannot be a constant of a traced program.
    """
    if _compat.tracing():  # staged: the host data becomes a constant of the traced program
        placed = jax.device_put(data, sharding)
    else:
        placed = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    if _compat.is_prng_key(like):
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(like))
    return placed


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


def _shape_hash(shape: tuple[int, ...]) -> int:
    return zlib.crc32(repr(tuple(int(d) for d in shape)).encode())


def check_same_shapes(
    verb: str, paths: Sequence[Path], shapes: Sequence[tuple[int, ...]], *, process_local: bool
) -> None:
    """Raises unless every process passed the same shape for each leaf.

    One small collective (a hash per leaf); only when shapes differ, a second one
    gathers them for the message (every process sees the difference, so all take it).
    """
    hashes = np.array([_shape_hash(shape) for shape in shapes], dtype=np.int64)
    everywhere = _compat.allgather_host(hashes)
    if (everywhere == everywhere[:1]).all():
        return
    ranks = _compat.allgather_host(np.array([len(shape) for shape in shapes], dtype=np.int64))
    width = int(ranks.max(initial=0))
    table = np.full((len(shapes), width + 1), -1, dtype=np.int64)
    for j, shape in enumerate(shapes):
        table[j, 0] = len(shape)
        table[j, 1 : 1 + len(shape)] = shape
    gathered = _compat.allgather_host(table)
    rows = []
    for j, path in enumerate(paths):
        per_process = gathered[:, j]
        if (per_process != per_process[0]).any():
            seen = ", ".join(
                f"process {p}: {shape_str(tuple(int(d) for d in row[1 : 1 + row[0]]))}"
                for p, row in enumerate(per_process)
            )
            rows.append((pathstr(path), seen))
    if process_local:
        header = (
            f"`{verb}` with `process_local=True` needs the same local shape on every "
            "process, but got:"
        )
        fix = (
            "Give every process a local part of the same shape (e.g. the same per-process "
            "batch size), padding the last batch if needed."
        )
    else:
        header = (
            f"`{verb}` was given different shapes on different processes for leaves it must "
            "place as one global array:"
        )
        fix = (
            "Pass identical data on every process; if each process holds its own part "
            "(e.g. its slice of a batch), pass `process_local=True`. To skip this check, "
            "pass `check_consistent=False`."
        )
    raise ValueError(leaf_error(header, rows, fix))


def shapes_to_check(
    verb: str,
    flat: Flat,
    layouts: dict[int, tuple[Any, PartitionSpec]],
    *,
    process_local: bool,
    check_consistent: bool,
) -> dict[int, tuple[int, ...]]:
    """The shape each leaf's spec must divide, the same on every process.

    Host data bound for a mesh that spans several processes must have the same shape
    on every process (its local part, with `process_local=True`). That is checked here,
    before any check that looks at shapes: an error raised on one process only would
    leave the others waiting in a collective. With `process_local=True` the shapes
    returned are the global ones that the local parts make together.
    """
    shapes = {i: tuple(flat.leaves[i].shape) for i in layouts}
    if jax.process_count() == 1:
        return shapes
    spanning = [
        i
        for i, (mesh, _) in layouts.items()
        if isinstance(mesh, Mesh)
        and mesh.is_multi_process
        and not _compat.is_tracer(flat.leaves[i])
        and is_process_local(flat.leaves[i])
    ]
    # While a transformation traces, host data is a constant of the traced program and no
    # collective can run: the shapes are not compared.
    if spanning and (process_local or check_consistent) and not _compat.tracing():
        paths = [flat.paths[i] for i in spanning]
        check_same_shapes(verb, paths, [shapes[i] for i in spanning], process_local=process_local)
    if process_local:
        for i in spanning:
            shapes[i] = _compat.global_shape(*layouts[i], shapes[i])
    return shapes


def from_process_local(x: Any, sharding: Sharding) -> jax.Array:
    """One global array from each process's local part (`process_local=True`)."""
    data = to_host(x)
    if _compat.is_prng_key(x):
        placed = jax.make_array_from_process_local_data(sharding, data)
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, data)
