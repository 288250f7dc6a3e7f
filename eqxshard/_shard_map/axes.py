"""Which mesh `filter_shard_map` runs over, and which of its axes `fun` is mapped over."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from jax.sharding import AbstractMesh, AxisType, Mesh

from .. import _compat
from .._placement.targets import given_mesh

_VERB = "filter_shard_map"


def get_mesh(mesh: Any) -> Mesh | AbstractMesh:
    """`mesh`, or the ambient mesh; inside an outer `shard_map`, the mesh JAX has in context."""
    return _compat.nested_mesh(given_mesh(_VERB, mesh))


def manual_axes(
    mesh: Mesh | AbstractMesh, axis_names: Set[str] | None, free: frozenset[str]
) -> frozenset[str]:
    """The axes `fun` is mapped over: `axis_names`, or (as in `jax.shard_map`) every axis
    of `mesh` that no enclosing `vmap` has taken (`free`)."""
    if axis_names is None:
        return free
    if isinstance(axis_names, str) or not all(isinstance(a, str) for a in axis_names):
        raise TypeError(
            f"`{_VERB}(axis_names=...)` must be a set of mesh axis names, got {axis_names!r}."
        )
    unknown = sorted(set(axis_names) - set(mesh.axis_names))
    if unknown:
        raise ValueError(
            f"`{_VERB}(axis_names=...)` names axes {unknown} that the mesh "
            f"{list(mesh.axis_names)} does not have. Use only the mesh's axis names."
        )
    taken = sorted(set(axis_names) - free)
    if taken:
        raise ValueError(
            f"`{_VERB}(axis_names=...)` names axes {taken} that an enclosing `jax.vmap` "
            "already maps its batch dim over. Leave them out of `axis_names` (or pass "
            "`axis_names=None` to map over every axis `vmap` has not taken)."
        )
    return frozenset(axis_names)


def has_explicit(mesh: Mesh | AbstractMesh, manual: frozenset[str]) -> bool:
    types = _compat.axis_type_map(mesh)
    return any(types[a] == AxisType.Explicit for a in manual)
