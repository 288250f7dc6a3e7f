"""Turning `target`/`spec` arguments into one sharding per array leaf, and checking it.

Nothing here moves data: every check runs over all leaves first, so that a bad leaf
stops the whole call before any leaf is placed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from . import _compat
from ._tree import Flat, broadcast_prefix, leaf_error, pathstr, shape_str

# Sentinels for "the argument was not given" (as opposed to `None` inside a prefix
# tree, which means "leave this subtree alone").
UNSET: Any = object()
_RULE: Any = object()

TARGET_TYPES = (Mesh, AbstractMesh, Sharding, jax.Device, PartitionSpec)


def _is_target_leaf(x: Any) -> bool:
    return x is None or isinstance(x, TARGET_TYPES) or isinstance(x, str)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def per_leaf(
    flat: Flat, value: Any, *, argname: str, verb: str, is_leaf: Callable[[Any], bool]
) -> list[Any]:
    """`value` for every leaf of `flat`: one value for all, or a prefix tree broadcast.

    Raises if a prefix tree gives a non-`None` value for a leaf that is not an array.
    """
    if is_leaf(value) or value is UNSET:
        return [value] * len(flat.leaves)
    tree = flat.rebuild({})
    values, on_leaf = broadcast_prefix(value, tree, is_leaf=is_leaf, argname=argname, verb=verb)
    position = {path: i for i, path in enumerate(flat.paths)}
    bad = [
        (pathstr(p), type(flat.leaves[position[p]]).__name__)
        for p in on_leaf
        if not flat.is_array[position[p]] and values[position[p]] is not None
    ]
    if bad:
        raise ValueError(
            leaf_error(
                f"`{verb}` got a `{argname}` for leaves that are not arrays:",
                bad,
                f"Only array leaves can be placed; put `None` at these paths in `{argname}`.",
            )
        )
    return values


def resolve(
    verb: str,
    flat: Flat,
    target: Any,
    spec: Any,
    *,
    resolve_str: Callable[[str], Sharding] | None = None,
) -> dict[int, Sharding]:
    """The sharding each array leaf must get (leaves to leave alone are absent).

    `target` is `UNSET` (the ambient mesh), a target form, or a prefix tree of them;
    `spec` is `UNSET`, a `PartitionSpec`, a prefix tree of them, a callable
    `(path, leaf) -> PartitionSpec | None`, or a rule: an object with a method
    `spec_for(path, leaf, mesh) -> PartitionSpec | None`, called with each array leaf's
    mesh (sharding rules are built on this).
    """
    targets = per_leaf(flat, target, argname="target", verb=verb, is_leaf=_is_target_leaf)
    rule = None if isinstance(spec, PartitionSpec) else getattr(spec, "spec_for", None)
    if rule is not None:  # a rule: needs each leaf's mesh, so it is called in the loop below
        specs: list[Any] = [_RULE] * len(flat.leaves)
    elif callable(spec) and not isinstance(spec, (PartitionSpec, eqx.Module)):
        specs = [UNSET] * len(flat.leaves)
        for i in flat.array_indices:
            specs[i] = spec(flat.paths[i], flat.leaves[i])
    else:
        specs = per_leaf(flat, spec, argname="spec", verb=verb, is_leaf=_is_spec_leaf)

    out: dict[int, Sharding] = {}
    type_errors: list[tuple[str, str]] = []
    no_mesh: list[tuple[str, str]] = []
    ambient: list[Any] = []  # looked up once, on first use
    for i in flat.array_indices:
        t, s = targets[i], specs[i]
        path = pathstr(flat.paths[i])
        if t is None or s is None:
            continue
        if isinstance(t, PartitionSpec) and s is not UNSET:
            type_errors.append((path, "a PartitionSpec target and a `spec` were both given"))
            continue
        mesh = None
        if t is UNSET or isinstance(t, PartitionSpec):
            if not ambient:
                ambient.append(_compat.ambient_mesh())
            mesh = ambient[0]
            if mesh is None:
                no_mesh.append((path, f"spec {t if t is not UNSET else s}"))
                continue
        elif isinstance(t, (Mesh, AbstractMesh)):
            mesh = t
        if s is _RULE and rule is not None:
            if mesh is None:
                type_errors.append((path, f"a rule `spec` was given with target {_short(t)}"))
                continue
            s = rule(flat.paths[i], flat.leaves[i], mesh)
            if s is None:
                continue
        if s is not UNSET and not isinstance(s, PartitionSpec):
            type_errors.append((path, f"spec {s!r} is not a PartitionSpec"))
        elif mesh is not None:
            spec_i = t if isinstance(t, PartitionSpec) else s
            out[i] = NamedSharding(mesh, PartitionSpec() if spec_i is UNSET else spec_i)
        elif s is not UNSET:
            type_errors.append(
                (path, f"a `spec` was given with target {_short(t)}, which fixes the layout")
            )
        elif isinstance(t, Sharding):
            out[i] = t
        elif isinstance(t, jax.Device):
            out[i] = jax.sharding.SingleDeviceSharding(t)
        elif isinstance(t, str) and resolve_str is not None:
            out[i] = resolve_str(t)
        else:
            type_errors.append((path, f"target {t!r} of type {type(t).__name__}"))
    if type_errors:
        raise TypeError(
            leaf_error(
                f"`{verb}` cannot read the `target`/`spec` given for these leaves:",
                type_errors,
                "A target is a Mesh, a Sharding, a Device or a PartitionSpec (or a prefix tree of "
                "them); a `spec` is a PartitionSpec and goes only with a Mesh target or the "
                "ambient mesh.",
            )
        )
    if no_mesh:
        raise ValueError(
            leaf_error(
                f"`{verb}` was given a PartitionSpec but no mesh is set, for these leaves:",
                no_mesh,
                "Pass a mesh (`target=mesh`), or set one with `jax.set_mesh(mesh)`.",
            )
        )
    check_specs(verb, flat, out)
    return out


def _short(t: Any) -> str:
    return type(t).__name__ if isinstance(t, (Sharding, Mesh)) else repr(t)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def check_specs(verb: str, flat: Flat, shardings: dict[int, Sharding]) -> None:
    """Checks every `NamedSharding` against its leaf: axis names, repeats, rank, divisibility."""
    unknown: list[tuple[str, ...]] = []
    repeated: list[tuple[str, ...]] = []
    rank: list[tuple[str, ...]] = []
    uneven: list[tuple[str, ...]] = []
    for i, sharding in shardings.items():
        if not isinstance(sharding, NamedSharding):
            continue
        path, shape = pathstr(flat.paths[i]), tuple(flat.leaves[i].shape)
        mesh, spec = sharding.mesh, sharding.spec
        sizes = dict(mesh.shape)
        used = [a for entry in spec for a in _axes(entry)]
        missing = [a for a in used if a not in sizes]
        if missing:
            unknown.append((path, f"spec {spec}", f"axes {missing} not in mesh {list(sizes)}"))
            continue
        twice = sorted({a for a in used if used.count(a) > 1})
        if twice:
            repeated.append((path, f"spec {spec}", f"axes {twice} used more than once"))
            continue
        if len(spec) > len(shape):
            rank.append((path, f"shape {shape_str(shape)}", f"spec {spec} has {len(spec)} entries"))
            continue
        for dim, entry in enumerate(spec):
            parts = math.prod(sizes[a] for a in _axes(entry))
            if shape[dim] % parts:
                names = " x ".join(repr(a) for a in _axes(entry))
                uneven.append(
                    (
                        path,
                        f"shape {shape_str(shape)}",
                        f"dim {dim} = {shape[dim]} is not divisible by {parts} (mesh axes {names})",
                    )
                )
    if unknown:
        raise ValueError(
            leaf_error(
                f"`{verb}` got specs naming axes its mesh does not have:",
                unknown,
                "Use only the mesh's axis names in each PartitionSpec (or pass the mesh that "
                "has these axes).",
            )
        )
    if repeated:
        raise ValueError(
            leaf_error(
                f"`{verb}` got specs that use a mesh axis more than once:",
                repeated,
                "A mesh axis can split at most one dim of an array; use each name once per spec.",
            )
        )
    if rank:
        raise ValueError(
            leaf_error(
                f"`{verb}` got specs with more entries than their leaves have dims:",
                rank,
                "Give each leaf a spec with at most one entry per dim (`None` for unsplit dims).",
            )
        )
    if uneven:
        raise ValueError(
            leaf_error(
                f"`{verb}` cannot split these leaves evenly over their mesh axes:",
                uneven,
                "Pad these dims to a multiple of the number of parts, or give these leaves a spec "
                "that does not split them.",
            )
        )
