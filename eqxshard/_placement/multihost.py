"""What placement needs when a sharding spans several processes (hosts).

Two cheap cross-process checks, in this order:
- every process must pass the same leaves (paths, dtypes and shapes, local shapes with
  `process_local=True`): one fixed-size digest per process, so that it cannot mismatch
  across processes however different their trees are (`check_same_leaves`);
- only then, host data passed as global must be identical on every process (a
  checksum per leaf, one collective whose size the first check made the same everywhere).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec, Sharding

from .. import _compat
from .._tree import Flat, Path, leaf_error, pathstr, shape_str
from . import exchange


def is_process_local(x: Any) -> bool:
    """Whether this process holds all of `x` (NumPy data, or a fully addressable array)."""
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def key_data_to_host(x: Any) -> np.ndarray:
    """A leaf as a host NumPy array (PRNG keys as their key data)."""
    if _compat.is_prng_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _checksum(x: np.ndarray) -> int:
    header = f"{x.dtype.str}{x.shape}".encode()
    data = np.ascontiguousarray(x).data  # a buffer view: no copy
    return (zlib.crc32(header) << 32) | zlib.crc32(data)


def check_identical(verb: str, paths: Sequence[Path], host: Sequence[np.ndarray]) -> None:
    """Raises unless every process passed the same data for each leaf."""
    local = np.array([_checksum(x) for x in host], dtype=np.uint64).reshape(len(host))
    everywhere = exchange.allgather_array(verb, local)
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


def leaf_entry(path: Path, x: Any) -> tuple[str, str, list[int]]:
    """A leaf as the cross-process checks compare it: its path, dtype and shape."""
    return pathstr(path), str(x.dtype), [int(d) for d in x.shape]


def check_same_leaves(
    verb: str,
    entries: Sequence[tuple[str, str, list[int]]],
    others: dict[str, str],
    *,
    process_local: bool,
    check_consistent: bool = True,
    failed: str | None = None,
) -> None:
    """Raises on every process unless every process passed the same leaves.

    `entries` are the leaves this process places across processes (path, dtype, local
    shape), `others` describes its other leaves by path (used only in the message), and
    `failed` is the error this process hit while resolving the call, if any. Every
    process must call this exactly when the others do (the caller decides from the
    call's target, never from the tree). It exchanges one 16-byte digest per process
    first (of `verb`, the flags, `entries` and whether this process failed), through
    `_exchange`, which bounds the wait. Only when the digests differ (every process sees
    that, so all take the same path) are the leaf lists themselves exchanged, to say
    what each process passed. So a tree or flags that differ between processes are an
    error, not a collective mismatch; and the flags decide which further collectives
    run (the checksums of `check_consistent`), so they must agree too.
    """
    flags = {"process_local": process_local, "check_consistent": check_consistent}
    text = json.dumps([verb, flags, list(entries), failed is not None])
    digest = hashlib.sha256(text.encode()).digest()[:16]
    everywhere = exchange.allgather(verb, digest)
    if all(d == everywhere[0] for d in everywhere):
        return
    payload = {"verb": verb, "flags": flags, "leaves": list(entries), "others": others}
    payload["failed"] = failed
    gathered = exchange.allgather(verb, json.dumps(payload).encode())
    seen = [json.loads(row.decode()) for row in gathered]
    raise ValueError(_mismatch_message(verb, seen, process_local=process_local))


def _mismatch_message(verb: str, seen: list[dict[str, Any]], *, process_local: bool) -> str:
    """What each process passed, for every leaf where they differ."""
    verbs = [s["verb"] for s in seen]
    if len(set(verbs)) > 1:
        calls = ", ".join(f"process {p}: `{v}`" for p, v in enumerate(verbs))
        return (
            f"The processes made different eqxshard calls at the same point ({calls}); each "
            "cross-process call must be made by every process, in the same order. Nothing "
            "was placed or gathered on any process."
        )
    for flag in ("process_local", "check_consistent"):
        values = [s["flags"][flag] for s in seen]
        if len(set(values)) > 1:
            cells = ", ".join(f"process {p}: {v}" for p, v in enumerate(values))
            return (
                f"`{verb}` was called with different `{flag}` on different processes "
                f"({cells}). Pass the same `{flag}` on every process (it decides which "
                "checks run across processes); nothing was placed on any process."
            )
    tables: list[dict[str, tuple[str, tuple[int, ...]]]] = [
        {path: (dtype, tuple(shape)) for path, dtype, shape in s["leaves"]} for s in seen
    ]
    order = list(dict.fromkeys(path for table in tables for path in table))
    differ = [p for p in order if any(t.get(p) != tables[0].get(p) for t in tables)]
    kinds: set[str] = set()
    for path in differ:
        values = [table.get(path) for table in tables]
        present = [v for v in values if v is not None]
        if len(present) < len(values):
            kinds.add("tree structures")
        if len({dtype for dtype, _ in present}) > 1:
            kinds.add("dtypes")
        if len({shape for _, shape in present}) > 1:
            kinds.add("shapes")
    rows = []
    for path in differ:
        cells = []
        for table, s in zip(tables, seen, strict=True):
            value = table.get(path)
            if value is None:
                cells.append(_absent(s, path))
            elif kinds == {"shapes"}:
                cells.append(shape_str(value[1]))
            else:
                cells.append(f"{value[0]} {shape_str(value[1])}")
        rows.append((path, ", ".join(f"process {p}: {c}" for p, c in enumerate(cells))))
    if kinds == {"shapes"}:  # every row so far had only its shape differ
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
                f"`{verb}` was given different shapes on different processes for leaves it "
                "must place as one global array:"
            )
            fix = (
                "Pass identical data on every process; if each process holds its own part "
                "(e.g. its slice of a batch), pass `process_local=True`. To skip this check, "
                "pass `check_consistent=False`."
            )
            if verb == "filter_get":
                fix = "Call `filter_get` on the same tree on every process."
        return leaf_error(header, rows, fix)
    done = "gathered" if verb == "filter_get" else "placed"
    fix = (
        "Pass the same tree (the same structure, shapes and dtypes of the array leaves) on "
        f"every process; nothing was {done} on any process."
    )
    if not rows:  # the same leaves, but some processes could not resolve the call
        failures = "\n".join(
            f"  process {p}: {s['failed']}" for p, s in enumerate(seen) if s["failed"]
        )
        return (
            f"`{verb}` failed on some processes only (were they given different `target`s or "
            f"`spec`s?):\n{failures}\nPass the same arguments on every process."
        )
    what = " and ".join(k for k in ("tree structures", "shapes", "dtypes") if k in kinds)
    header = (
        f"`{verb}` was given different {what} on different processes, for the array leaves "
        f"it {'gathers' if verb == 'filter_get' else 'places'} across processes:"
    )
    return leaf_error(header, rows, fix)


def _absent(seen: dict[str, Any], path: str) -> str:
    return seen["others"].get(path) or "no such leaf"


def global_shapes(
    flat: Flat, layouts: dict[int, tuple[Any, PartitionSpec]], *, process_local: bool
) -> dict[int, tuple[int, ...]]:
    """The shape each leaf's spec must divide.

    With `process_local=True`, host data bound for a mesh that spans several processes
    is each process's local part: its shape here is the global shape the parts make
    together (the local shapes were compared across processes by `check_same_leaves`).
    """
    shapes = {i: tuple(flat.leaves[i].shape) for i in layouts}
    if jax.process_count() == 1 or not process_local:
        return shapes
    for i, (mesh, spec) in layouts.items():
        x = flat.leaves[i]
        if (
            isinstance(mesh, Mesh)
            and mesh.is_multi_process
            and not _compat.is_tracer(x)
            and is_process_local(x)
        ):
            shapes[i] = _compat.global_shape(mesh, spec, shapes[i])
    return shapes


def from_process_local(x: Any, sharding: Sharding) -> jax.Array:
    """One global array from each process's local part (`process_local=True`)."""
    data = key_data_to_host(x)
    if _compat.is_prng_key(x):
        placed = jax.make_array_from_process_local_data(sharding, data)
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(sharding, data)
