"""The one place that decides between `device_put`, `with_sharding_constraint` and `reshard`.

Outside `jit` (a concrete leaf) placement is a real transfer: one batched
`jax.device_put` over every leaf that is not already laid out as asked. Inside `jit`
(a traced leaf) it is a layout constraint chosen by the mesh's axis types:

- Auto axes: `jax.lax.with_sharding_constraint`. (`device_put` inside `jit` would
  silently give a replicated array on Auto axes, so it is never used for them.)
- Explicit axes: a reshard (`_compat.reshard_explicit`: `jax.device_put` with a
  `NamedSharding`, which works with or without the mesh in context, where JAX allows).
- A mixed mesh: the spec is split into its Explicit part and its Auto part; both hold.
- Manual axes (inside `shard_map`): dropped; each shard is already where it lives.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._tree import Flat, leaf_error, pathstr
from . import multihost, staging


def already_placed(x: Any, sharding: Sharding) -> bool:
    """Whether a concrete leaf already has exactly this layout (so no copy is needed)."""
    if not isinstance(x, jax.Array) or not x.committed:
        return False
    current = x.sharding
    if current is sharding or current == sharding:
        return True
    if isinstance(sharding, NamedSharding):
        if not isinstance(current, NamedSharding):
            return False
        if tuple(current.mesh.axis_types) != tuple(sharding.mesh.axis_types):
            return False
    if (sharding.memory_kind or "device") != (current.memory_kind or "device"):
        return False
    return current.is_equivalent_to(sharding, x.ndim)


def _keep_axes(spec: PartitionSpec, keep: set[str], *, unconstrained: bool) -> PartitionSpec:
    entries = []
    for entry in spec:
        if entry is PartitionSpec.UNCONSTRAINED:
            entries.append(entry if unconstrained else None)
            continue
        names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        kept = tuple(n for n in names if n in keep)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def constrain_many(xs: list[Any], sharding: Sharding) -> list[Any]:
    """Constrains traced leaves that share one `sharding`, by the mesh's axis types.

    The mesh's axis types are read once for all of them, and the Auto part is one
    `with_sharding_constraint` call over the list (tracing cost grows with calls).
    """
    if not isinstance(sharding, NamedSharding):
        return jax.lax.with_sharding_constraint(xs, sharding)
    mesh, types = sharding.mesh, _compat.axis_type_map(sharding.mesh)
    context = _compat.context_abstract_mesh()
    manual = {n for n, t in types.items() if t == AxisType.Manual}
    if context is not None:
        context_types = _compat.axis_type_map(context)
        manual |= {n for n, t in context_types.items() if t == AxisType.Manual}
        if manual:  # inside shard_map: constrain on the mesh JAX has in context
            mesh, types = context, context_types
    explicit = {n for n, t in types.items() if t == AxisType.Explicit and n not in manual}
    auto = {n for n, t in types.items() if t == AxisType.Auto and n not in manual}
    if explicit:
        spec = _keep_axes(sharding.spec, explicit, unconstrained=False)
        target = NamedSharding(mesh, spec)
        xs = [_compat.reshard_explicit(x, target) for x in xs]
    if auto:
        spec = _keep_axes(sharding.spec, auto, unconstrained=True)
        xs = jax.lax.with_sharding_constraint(xs, NamedSharding(mesh, spec))
    if sharding.memory_kind is None:
        return list(xs)
    # Only an actual change of memory: `device_put` to a memory space is not allowed
    # inside `shard_map` without `jit`, and a concrete mesh's sharding says "device".
    space = _compat.memory_space(sharding.memory_kind)
    return [x if space == _compat.traced_memory_space(x) else jax.device_put(x, space) for x in xs]


def _device_count(sharding: Sharding) -> int:
    if isinstance(sharding, NamedSharding):
        return sharding.mesh.size
    return len(sharding.device_set)


def _platform(sharding: Sharding) -> str | None:
    if isinstance(sharding, NamedSharding):
        return _compat.mesh_platform(sharding.mesh)
    return next(iter(sharding.device_set)).platform


def check_traced_moves(verb: str, flat: Flat, shardings: dict[int, Sharding]) -> None:
    """Raises for traced leaves asked to move to another device set or backend.

    Inside `jit` every array lives on one device set; JAX cannot move one elsewhere.
    The device set of a traced leaf is known when its abstract value carries a mesh
    (or a mesh is set); where it is not known, JAX raises at compile time instead.
    """
    rows = []
    for i, sharding in shardings.items():
        x = flat.leaves[i]
        if not _compat.is_tracer(x):
            continue
        traced = _compat.traced_sharding(x)
        source = traced.mesh if traced is not None and not traced.mesh.empty else None
        source = source or _compat.context_abstract_mesh()
        if source is None:
            continue
        count, platform = _device_count(sharding), _platform(sharding)
        source_platform = _compat.mesh_platform(source)
        if count != source.size or (platform and source_platform and platform != source_platform):
            where = f"{source.size} {source_platform or ''} device(s)".replace("  ", " ")
            to = f"{count} {platform or ''} device(s)".replace("  ", " ")
            rows.append((pathstr(flat.paths[i]), f"lives on {where}", f"asked for {to}"))
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` cannot move these traced leaves to another device set inside `jit`:",
                rows,
                "Inside `jit` every array stays on the computation's devices. Move the data "
                "outside `jit` first, with `eqxshard.filter_put` or `eqxshard.filter_shard`, "
                "and pass the moved arrays in.",
            )
        )


def _check_devices_known(verb: str, flat: Flat, shardings: dict[int, Sharding]) -> None:
    """Raises for leaves to be placed, outside any trace, on an `AbstractMesh`: it names
    axes but no devices, so there is nowhere to put them (JAX says only that the input's
    sharding "must be a `NamedSharding`")."""
    rows = [
        (pathstr(flat.paths[i]), f"mesh {s.mesh}")
        for i, s in shardings.items()
        if isinstance(s, NamedSharding)
        and isinstance(s.mesh, AbstractMesh)
        and not _compat.is_tracer(flat.leaves[i])
    ]
    if rows and not _compat.tracing():
        raise ValueError(
            leaf_error(
                f"`{verb}` cannot place these leaves on an AbstractMesh outside `jit`: it has "
                "no devices.",
                rows,
                "Pass a concrete `jax.sharding.Mesh` (e.g. from `jax.make_mesh`), or call "
                "this inside `jax.jit`, where an AbstractMesh stands for the mesh set by "
                "`jax.set_mesh`.",
            )
        )


def place(
    verb: str,
    flat: Flat,
    shardings: dict[int, Sharding],
    *,
    process_local: bool = False,
    check_consistent: bool = True,
) -> dict[int, Any]:
    """Places every array leaf of `flat` that has a sharding; returns the new leaves."""
    check_traced_moves(verb, flat, shardings)
    _check_devices_known(verb, flat, shardings)
    traced = {i: s for i, s in shardings.items() if needs_constraint(flat.leaves[i], s)}
    concrete = {i: settled(s) for i, s in shardings.items() if i not in traced}
    concrete = {i: s for i, s in concrete.items() if not already_placed(flat.leaves[i], s)}
    if process_local:
        _check_process_local(verb, flat, shardings, traced)
    out: dict[int, Any] = {}
    if process_local:  # local shapes were checked to agree by `resolve.resolve`
        for i, sharding in concrete.items():
            out[i] = multihost.from_process_local(flat.leaves[i], sharding)
    else:
        out.update(_put_concrete(verb, flat, concrete, check_consistent=check_consistent))
    # A concrete leaf placed while a `jit` is being traced comes back traced: constrain it
    # too, as `device_put` alone is an identity on Auto axes inside `jit`.
    again = {i: s for i, s in concrete.items() if _compat.is_tracer(out[i])}
    groups: dict[int, tuple[Sharding, list[int]]] = {}  # leaves sharing one sharding object
    for i, sharding in (*traced.items(), *again.items()):
        groups.setdefault(id(sharding), (sharding, []))[1].append(i)
    for sharding, indices in groups.values():
        xs = [out.get(i, flat.leaves[i]) for i in indices]
        out.update(zip(indices, constrain_many(xs, sharding), strict=True))
    return out


def relayout(x: Any, sharding: Sharding) -> Any:
    """One leaf given `sharding`: a layout constraint while traced, a transfer outside."""
    if _compat.is_tracer(x):
        return constrain_many([x], sharding)[0]
    return jax.device_put(x, sharding)


def to_memory_kind(x: Any, memory_kind: str) -> Any:
    """Moves a traced leaf to another memory kind, keeping its layout."""
    return jax.device_put(x, _compat.memory_space(memory_kind))


def settled(sharding: Sharding) -> Sharding:
    """A concrete array has a layout on every dim: `P.UNCONSTRAINED` dims are not split
    (as `eqx.filter_shard` gives outside `jit`; `device_put` raises on them)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    entries = _compat.spec_entries(sharding.spec)
    if not any(e is PartitionSpec.UNCONSTRAINED for e in entries):
        return sharding
    spec = PartitionSpec(*(None if e is PartitionSpec.UNCONSTRAINED else e for e in entries))
    return sharding.update(spec=spec)


def needs_constraint(x: Any, sharding: Sharding) -> bool:
    if _compat.is_tracer(x):
        return True
    return isinstance(sharding, NamedSharding) and isinstance(
        sharding.mesh, jax.sharding.AbstractMesh
    )


def _put_concrete(
    verb: str, flat: Flat, shardings: dict[int, Sharding], *, check_consistent: bool
) -> dict[int, Any]:
    """One batched `device_put`; host data bound for other processes goes through NumPy.

    Data this process holds whole (NumPy, or an array on this process's devices) and
    bound for a sharding that spans other processes is checked and placed from the host.
    An array that already spans other processes is one global value: `device_put`
    reshards it directly (it has no whole copy on this host to go through).
    """
    to_global = [
        i
        for i, s in shardings.items()
        if not s.is_fully_addressable and multihost.is_process_local(flat.leaves[i])
    ]
    global_ = set(to_global)
    local = [i for i in shardings if i not in global_]
    out: dict[int, Any] = {}
    if to_global:
        host = [multihost.key_data_to_host(flat.leaves[i]) for i in to_global]
        # While tracing no collective can run; the data is a constant of the traced program.
        if check_consistent and jax.process_count() > 1 and not _compat.tracing():
            multihost.check_identical(verb, [flat.paths[i] for i in to_global], host)
        for i, data in zip(to_global, host, strict=True):
            out[i] = _from_host(data, flat.leaves[i], shardings[i])
    if local:
        moved = staging.device_put([flat.leaves[i] for i in local], [shardings[i] for i in local])
        out.update(zip(local, moved, strict=True))
    return out


def _check_process_local(
    verb: str, flat: Flat, shardings: dict[int, Sharding], traced: dict[int, Sharding]
) -> None:
    rows = []
    for i, sharding in shardings.items():
        if i in traced:
            rows.append((pathstr(flat.paths[i]), "is traced (inside `jit`)"))
        elif _compat.tracing():
            rows.append((pathstr(flat.paths[i]), "is host data placed while `jit` traces"))
        elif not isinstance(sharding, NamedSharding):
            rows.append((pathstr(flat.paths[i]), f"target is a {type(sharding).__name__}"))
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` with `process_local=True` needs a mesh target (a `Mesh` with a spec, "
                "or a `NamedSharding`) and concrete data, outside `jit`; got:",
                rows,
                "Call it outside `jit` with `target=mesh` and a spec such as P('data'), so that "
                "each process's local part becomes one slice of a global array.",
            )
        )


def _from_host(data: np.ndarray, like: Any, sharding: Sharding) -> jax.Array:
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
