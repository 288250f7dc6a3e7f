"""Arrays committed to other devices than a computation's.

`jit` moves uncommitted arrays (NumPy, `jnp.ones(...)`) wherever its computation runs, but
refuses a committed one (`jax.device_put(x, device)`, the output of an earlier computation)
whose devices, in order, differ from the computation's: "Received incompatible devices for
jitted computation". Verbs that run over a mesh move such leaves onto it first, outside
`jit`, through `place.place` (`onto_mesh`); verbs that have no mesh of their own report
every such leaf by path before JAX does (`check_one_device_set`). Traced leaves are left
alone: inside `jit` nothing can move, and JAX raises at the outer `jit`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._tree import Flat, leaf_error, pathstr
from . import place


def _committed(x: Any) -> bool:
    """A concrete array pinned to its devices (`jit` will not move it)."""
    return isinstance(x, jax.Array) and not _compat.is_tracer(x) and x.committed


def elsewhere(flat: Flat, mesh: Any) -> list[int]:
    """The array leaves of `flat` committed to other devices than `mesh`'s, or to the same
    devices in another order (`jit` over `mesh` refuses both). An abstract mesh has no
    devices to compare: none."""
    if not isinstance(mesh, Mesh):
        return []
    devices = tuple(mesh.devices.flat)
    return [
        i
        for i in flat.array_indices
        if _committed(x := flat.leaves[i]) and _compat.device_assignment(x.sharding) != devices
    ]


def onto_mesh(verb: str, tree: Any, mesh: Mesh) -> Any:
    """`tree` with each array leaf committed to other devices than `mesh`'s moved onto the
    mesh whole (`P()`, a copy on every device), where `jit` over the mesh would put an
    uncommitted input; every other leaf as it is (the very same object)."""
    flat = Flat(tree)
    indices = elsewhere(flat, mesh)
    if not indices:
        return tree
    sharding: Sharding = NamedSharding(mesh, PartitionSpec())
    return flat.rebuild(place.place(verb, flat, dict.fromkeys(indices, sharding)))


def _devices(sharding: Sharding) -> str:
    """`committed to cpu device 3`, `committed to 8 cpu devices [0, 1, ..., 7]` (in order)."""
    devices = _compat.device_assignment(sharding)
    ids = [str(d.id) for d in devices]
    if len(ids) == 1:
        return f"committed to {devices[0].platform} device {ids[0]}"
    shown = ids if len(ids) <= 8 else [*ids[:4], "...", *ids[-2:]]
    return f"committed to {len(ids)} {devices[0].platform} devices [{', '.join(shown)}]"


def check_one_device_set(verb: str, flat: Flat, prefix: str = "") -> None:
    """Raises, naming every committed leaf and its devices, when the committed array leaves
    of `flat` (the arguments of one computation) are not all on the same devices in the same
    order. `prefix` goes before each leaf path (`"args"` gives `args.1`)."""
    committed = [i for i in flat.array_indices if _committed(flat.leaves[i])]
    orders = {_compat.device_assignment(flat.leaves[i].sharding) for i in committed}
    if len(orders) <= 1:
        return
    rows = [(pathstr(flat.paths[i], prefix), _devices(flat.leaves[i].sharding)) for i in committed]
    raise ValueError(
        leaf_error(
            f"`{verb}` got arrays committed to different devices; one computation takes "
            "committed arrays from one set of devices only (JAX: 'incompatible devices'):",
            rows,
            "Put them on the same devices first: `eqxshard.filter_shard(tree, mesh, spec)` "
            "onto one mesh, or `jax.device_put(x, device)` onto one device. Arrays that are "
            "not committed (NumPy data, `jax.device_put(x)` with no device) are moved by JAX.",
        )
    )


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """`tree` with each concrete array laid out over a copy of `mesh` (the same devices and
    axis names, other axis types) given `mesh` itself: the same buffers, no copy. JAX
    refuses to combine arrays of meshes that differ in axis types ("Mesh for all inputs
    should be equal"). The very same `tree` if no array needs it."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = [_on_mesh(x, mesh) for x in leaves]
    if all(a is b for a, b in zip(out, leaves, strict=True)):
        return tree
    return jax.tree_util.tree_unflatten(treedef, out)


def _on_mesh(x: Any, mesh: Mesh) -> Any:
    if not isinstance(x, jax.Array) or _compat.is_tracer(x):
        return x
    s = x.sharding
    if not isinstance(s, NamedSharding) or not isinstance(s.mesh, Mesh) or s.mesh == mesh:
        return x
    here = s.mesh.devices
    if s.mesh.axis_names != mesh.axis_names or here.shape != mesh.devices.shape:
        return x
    if (here != mesh.devices).any():
        return x
    return _compat.with_sharding(x, NamedSharding(mesh, s.spec, memory_kind=s.memory_kind))
