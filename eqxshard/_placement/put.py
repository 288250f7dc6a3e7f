"""`filter_put`: move array leaves to a device, a backend, a sharding or a memory kind."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from .. import _compat
from .._tree import Flat, T, leaf_error, pathstr
from . import cache, place, resolve, targets


def _backend_sharding(name: str) -> Sharding:
    try:
        devices = jax.devices(name)
    except RuntimeError:
        devices = []
    if not devices:
        known = sorted({d.platform for d in jax.devices()} | {jax.default_backend()})
        raise ValueError(
            f"`filter_put` got `target`={name!r}, a backend this process does not have. "
            f"Backends here: {known}. Pass one of them, a `jax.Device` or a `Sharding`."
        )
    return SingleDeviceSharding(devices[0])


def _memory_kinds(sharding: Sharding | None) -> set[str]:
    """The memory kinds a leaf can move to: those of its devices, or (traced, devices not
    known) those JAX can name inside `jit`."""
    if sharding is None or (
        isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
    ):
        return set(_compat.TRACED_MEMORY_KINDS)
    device = next(iter(sharding.device_set))
    return {m.kind for m in device.addressable_memories()}


def filter_put(tree: T, target: Any = None, *, memory_kind: str | None = None) -> T:
    """Moves (and commits) every array leaf of `tree` to a device, a backend, a sharding
    and/or a memory kind.

    With only `memory_kind`, each leaf keeps its layout and changes memory: offload with
    `filter_put(state, memory_kind="pinned_host")`, bring back with
    `filter_put(state, memory_kind="device")`. Outside `jax.jit` this is one batched
    `jax.device_put` (big host NumPy leaves bound for an accelerator staged through
    pinned host memory in parts, as `filter_shard` does). Inside `jax.jit`, memory kinds
    and layouts on the computation's own devices work; moving a traced leaf to a device or
    backend does not (JAX cannot), and raises. Non-array leaves are returned unchanged.

    **Arguments:**

    - `tree`: any PyTree.
    - `target`: where the array leaves go. One of:
        - a `jax.Device`;
        - a backend name such as `"cpu"` or `"gpu"`: its first device;
        - a `jax.sharding.Sharding`;
        - a `jax.sharding.Mesh`: replicated over it;
        - `None` (default): where each leaf is now (only with `memory_kind`);
        - a PyTree whose structure is a prefix of `tree` with any of the above at its
            leaves, `None` leaving that subtree alone.
    - `memory_kind`: a memory kind of the target devices, such as `"device"`,
        `"pinned_host"` or `"unpinned_host"`; `None` keeps the target's default.

    **Returns:**

    A PyTree with the structure of `tree`.

    **Raises:**

    - `TypeError`: if neither `target` nor `memory_kind` is given, `target` is of the
        wrong type, or array leaves have a dtype JAX has no arrays of (NumPy strings,
        objects, ...), naming each.
    - `ValueError`: naming every failing leaf, for a backend this process lacks, a memory
        kind the target devices lack, a prefix tree that does not match `tree`, or a
        traced leaf asked to move to another device or backend inside `jit` (do the move
        outside `jit`), or a memory kind inside `jit` on a JAX that cannot move memory
        there (jax < 0.8 on CPU), or a sharding over an `AbstractMesh` outside `jit` (it
        has no devices), or if `EQXSHARD_STAGING` or `EQXSHARD_STAGING_BYTES` holds a
        value it cannot read.
    - `TimeoutError`: with several processes, if another process does not make the same
        call within `EQXSHARD_SYNC_TIMEOUT` seconds (default 600), naming it.

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import eqxshard

        state = {"w": jnp.ones((4, 4)), "step": 3}
        offloaded = eqxshard.filter_put(state, memory_kind="pinned_host")
        back = eqxshard.filter_put(offloaded, memory_kind="device")
        on_cpu = eqxshard.filter_put(state, "cpu")
        ```
    """
    if target is None and memory_kind is None:
        raise TypeError(
            "`filter_put` needs a `target` (a device, a backend, a sharding or a mesh) or a "
            "`memory_kind`; it was given neither."
        )
    if memory_kind is not None and not isinstance(memory_kind, str):
        raise TypeError(
            f"`filter_put` takes `memory_kind` as a string such as 'pinned_host' or 'device', "
            f"but got {memory_kind!r} of type {type(memory_kind).__name__}."
        )
    found = cache.NEVER
    if target is not None:  # without a target, each leaf's own layout: nothing to remember
        put, found = cache.recall(
            tree, ("filter_put", memory_kind), target=target, spec=resolve.UNSET
        )
        if put is not cache.MISSED:
            return put
    flat = Flat(tree)
    sync = resolve.must_sync(target)
    if not any(flat.is_array) and not sync:  # see `filter_shard`
        return tree
    if target is None:
        targets.check_dtypes("filter_put", flat, flat.array_indices)
        shardings = {i: _current_sharding(flat.leaves[i]) for i in flat.array_indices}
    else:
        shardings = resolve.resolve(
            "filter_put", flat, target, resolve.UNSET, resolve_str=_backend_sharding
        )
        _check_traced_targets(flat, shardings)
    if memory_kind is not None:
        _check_memory_kind(flat, shardings, memory_kind)
        _check_traced_memory_kind(flat, shardings, memory_kind)
        shardings = {
            i: s.with_memory_kind(memory_kind) if s is not None else s for i, s in shardings.items()
        }
    given = {i: s for i, s in shardings.items() if s is not None}
    placed = place.place("filter_put", flat, given)
    if len(given) == len(shardings):
        cache.remember(found, given)
    if memory_kind is not None:  # traced leaves with no known layout: JAX keeps it
        for i, s in shardings.items():
            if s is None:
                placed[i] = place.to_memory_kind(flat.leaves[i], memory_kind)
    return flat.rebuild(placed) if placed else tree


def _current_sharding(x: Any) -> Sharding | None:
    """The layout a leaf has now: `None` for a traced leaf (JAX keeps it in place)."""
    if _compat.is_tracer(x):
        return None
    if isinstance(x, jax.Array):
        return x.sharding
    return SingleDeviceSharding(jax.devices()[0])


def _check_traced_targets(flat: Flat, shardings: dict[int, Sharding]) -> None:
    rows = [
        (pathstr(flat.paths[i]), f"asked for {s}")
        for i, s in shardings.items()
        if _compat.is_tracer(flat.leaves[i]) and isinstance(s, SingleDeviceSharding)
    ]
    if rows:
        raise ValueError(
            leaf_error(
                "`filter_put` cannot move these traced leaves to a device inside `jit`:",
                rows,
                "Inside `jit` arrays stay on the computation's devices. Call `filter_put` "
                "outside `jit` (e.g. before calling the jitted function), or use "
                "`filter_shard` to lay leaves out over the computation's mesh.",
            )
        )


def _check_memory_kind(flat: Flat, shardings: dict[int, Any], memory_kind: str) -> None:
    kinds = {i: _memory_kinds(s) for i, s in shardings.items()}
    rows = [
        (pathstr(flat.paths[i]), f"target devices have {sorted(k)}")
        for i, k in kinds.items()
        if memory_kind not in k
    ]
    head = f"`filter_put` got memory_kind={memory_kind!r}, which these leaves' target devices "
    if rows:
        fix = "Pass one of the memory kinds listed."
        raise ValueError(leaf_error(head + "do not have:", rows, fix))


def _check_traced_memory_kind(flat: Flat, shardings: dict[int, Any], memory_kind: str) -> None:
    if _compat.memory_kinds_in_jit():
        return
    rows = [(pathstr(flat.paths[i]),) for i in shardings if _compat.is_tracer(flat.leaves[i])]
    if rows:
        raise ValueError(
            leaf_error(
                f"`filter_put` cannot change memory kinds inside `jit` with jax {jax.__version__} "
                f"on {jax.default_backend()} (JAX drops or rejects the move); got "
                f"memory_kind={memory_kind!r} for these traced leaves:",
                rows,
                "Call `filter_put` outside `jit` (e.g. on the inputs or outputs of the jitted "
                "function), or use a newer JAX, which supports memory kinds inside `jit`.",
            )
        )
