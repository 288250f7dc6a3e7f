"""The MPMD form's sub-meshes: stage `s`'s devices (index `s` of the stage axis, with the
mesh's other axes kept), and a layer stack laid out over the stage axis read as one piece
per stage on its sub-mesh, and back.

Both ways are views, not copies: with the layer dim split over the stage axis, the shards a
stage's devices hold of the whole stack are exactly the shards of that stage's piece (laid
out over the other axes as the stack is), so each direction rebuilds arrays from the same
per-device buffers (`jax.make_array_from_single_device_arrays`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ... import _compat
from ..._placement.put import filter_put
from ..._placement.shard import filter_shard


def stage_meshes(mesh: Mesh, axis: str) -> list[Mesh]:
    """One mesh per index of `axis`: its devices, over the mesh's other axes (same types)."""
    where = mesh.axis_names.index(axis)
    names = tuple(n for n in mesh.axis_names if n != axis)
    types = _compat.axis_type_map(mesh)
    devices = [np.take(mesh.devices, s, axis=where) for s in range(mesh.devices.shape[where])]
    if not names:  # a mesh of the stage axis alone: each stage is one device
        return [Mesh(np.asarray(d).reshape(1), ("_stage",)) for d in devices]
    return [Mesh(d, names, axis_types=tuple(types[n] for n in names)) for d in devices]


def _rest(leaf: Any, mesh: Mesh, axis: str) -> tuple[Any, ...]:
    """The spec entries of `leaf`'s dims after the first on `mesh`, without `axis`."""
    sharding = getattr(leaf, "sharding", None)
    entries: list[Any] = [None] * (leaf.ndim - 1)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        given = list(_compat.spec_entries(sharding.spec))[1:]
        entries = [*given, *entries][: leaf.ndim - 1]

    def drop(entry: Any) -> Any:
        if isinstance(entry, tuple):
            kept = tuple(n for n in entry if n != axis)
            return kept or None
        return None if entry == axis else entry

    return tuple(drop(e) for e in entries)


def split(weights: Any, mesh: Mesh, axis: str, meshes: list[Mesh]) -> tuple[Any, list[Any]]:
    """`weights` (array leaves with the layer dim first) laid out over `axis` (moved only
    where they are not), and stage `s`'s piece of each leaf on `meshes[s]`."""
    laid = filter_shard(weights, mesh, lambda path, a: PartitionSpec(axis, *_rest(a, mesh, axis)))
    leaves, tree = jax.tree.flatten(laid)
    pieces: list[list[Any]] = [[] for _ in meshes]
    for leaf in leaves:
        rest = _rest(leaf, mesh, axis)
        shape = (leaf.shape[0] // len(meshes), *leaf.shape[1:])
        for s, sub in enumerate(meshes):
            mine = set(sub.devices.flat)
            arrays = [sh.data for sh in leaf.addressable_shards if sh.device in mine]
            pieces[s].append(
                jax.make_array_from_single_device_arrays(
                    shape, NamedSharding(sub, PartitionSpec(None, *rest)), arrays
                )
            )
    return laid, [jax.tree.unflatten(tree, p) for p in pieces]


def join(pieces: list[Any], like: list[Any], laid: Any) -> Any:
    """The inverse of `split`: per-stage trees (laid out as `like`, the pieces `split` gave,
    after a move where they are not) as one tree laid out as `laid`."""
    layouts = [jax.tree.map(lambda a: a.sharding, ref) for ref in like]
    pieces = [filter_put(p, to) for p, to in zip(pieces, layouts, strict=True)]
    flat = [jax.tree.leaves(p) for p in pieces]
    leaves, tree = jax.tree.flatten(laid)
    out = []
    for i, leaf in enumerate(leaves):
        arrays = [sh.data for stage in flat for sh in stage[i].addressable_shards]
        out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays))
    return jax.tree.unflatten(tree, out)


def move(tree: Any, mesh: Mesh) -> Any:
    """`tree`'s arrays onto `mesh` (another stage's sub-mesh), each with the spec it has now
    (the sub-meshes share their axis names), by `filter_put`."""

    def target(a: Any) -> NamedSharding:
        sharding = getattr(a, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        return NamedSharding(mesh, spec)

    return filter_put(tree, jax.tree.map(target, tree))
