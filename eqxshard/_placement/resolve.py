"""`resolve`: one sharding per array leaf (read by `targets.resolve_here`), agreed on by
every process when the target spans several (`multihost.check_same_leaves`).

Nothing here moves data: every check runs over all leaves first, so that a bad leaf
stops the whole call before any leaf is placed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._tree import Flat, pathstr
from . import multihost
from .targets import UNSET, is_target_leaf, resolve_here


def resolve(
    verb: str,
    flat: Flat,
    target: Any,
    spec: Any,
    *,
    resolve_str: Callable[[str], Sharding] | None = None,
    process_local: bool = False,
    check_consistent: bool = True,
    sync: bool = True,
) -> dict[int, Sharding]:
    """The sharding each array leaf must get (leaves to leave alone are absent).

    `target` and `spec` are read as described in `resolve_here`. With several processes
    and a `target` that spans them, every process then checks that all passed the same
    leaves and flags (`multihost.check_same_leaves`), also when this process failed to
    resolve the call: an error raised on some processes only would leave the others
    waiting in the next collective, so it is raised on every process instead. Whether to
    check is decided from `target` alone, never from `tree` or the flags, so that all
    processes take part. `sync=False` (verbs that only read a plan and move nothing)
    skips the check, so that one process may call them alone.
    """
    if not (sync and must_sync(target)):
        return resolve_here(verb, flat, target, spec, resolve_str, process_local)
    try:
        out = resolve_here(verb, flat, target, spec, resolve_str, process_local)
    except Exception as e:  # also a user's callable spec failing on this process only
        indices = [i for i in flat.array_indices if not _compat.is_tracer(flat.leaves[i])]
        failed = f"{type(e).__name__}: {e}"
        _check_same_leaves(
            verb,
            flat,
            indices,
            flags=(process_local, check_consistent),
            failed=failed,
            local=set(),
        )
        raise
    # Only leaves bound for devices of several processes: others take part in no collective.
    indices = [i for i, s in out.items() if _spans(s) and not _compat.is_tracer(flat.leaves[i])]
    _check_same_leaves(
        verb, flat, indices, flags=(process_local, check_consistent), failed=None, local=set(out)
    )
    return out


def _spans(sharding: Sharding) -> bool:
    if isinstance(sharding, NamedSharding):
        return isinstance(sharding.mesh, Mesh) and sharding.mesh.is_multi_process
    return not sharding.is_fully_addressable


def must_sync(target: Any) -> bool:
    """Whether a call with this `target` checks its leaves across processes.

    Yes where `target` (or the mesh set by `jax.set_mesh`, for a `PartitionSpec` or no
    target) spans several processes, outside any transformation (no collective can run
    while tracing). Read from `target` only: the same on every process that passes the
    same `target`, whatever its tree holds and whatever flags it passed (flags that
    differ between processes are reported by the check itself).
    """
    if jax.process_count() == 1 or _compat.tracing():
        return False
    leaves = jax.tree_util.tree_leaves(target, is_leaf=is_target_leaf)
    for t in leaves:
        if t is UNSET or isinstance(t, PartitionSpec):
            t = _compat.ambient_mesh()
        if isinstance(t, Mesh) and t.is_multi_process:
            return True
        if isinstance(t, Sharding) and not t.is_fully_addressable:
            return True
    return False


def _check_same_leaves(
    verb: str,
    flat: Flat,
    indices: list[int],
    *,
    flags: tuple[bool, bool],
    failed: str | None,
    local: set[int],
) -> None:
    """`multihost.check_same_leaves` for the leaves `indices`; `local` are the other
    leaves placed, on this process's devices only (described as such in a message)."""
    chosen = set(indices)
    entries = [multihost.leaf_entry(flat.paths[i], flat.leaves[i]) for i in indices]

    def other(i: int, x: Any) -> str:
        if not flat.is_array[i]:
            return f"{type(x).__name__} (not an array)"
        return "an array placed on this process only" if i in local else "an array left alone"

    others = {
        pathstr(flat.paths[i]): other(i, x) for i, x in enumerate(flat.leaves) if i not in chosen
    }
    process_local, check_consistent = flags
    multihost.check_same_leaves(
        verb,
        entries,
        others,
        process_local=process_local,
        check_consistent=check_consistent,
        failed=failed,
    )
