"""Checking that each leaf's `PartitionSpec` fits its mesh and its shape.

The checks `resolve` runs over every leaf's (mesh, spec) before anything moves: axis
names the mesh has, no axis twice, no more entries than dims, dims that divide evenly.
Each failing kind is one error listing every leaf that fails it.
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from .. import _compat
from .._tree import Flat, leaf_error, pathstr, shape_str


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a `PartitionSpec` splits its dim over."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def check_specs(
    verb: str,
    flat: Flat,
    layouts: dict[int, tuple[Mesh | AbstractMesh, PartitionSpec]],
    shapes: dict[int, tuple[int, ...]] | None = None,
) -> None:
    """Checks each leaf's (mesh, spec): axis names, repeats, rank, divisibility.

    `shapes` overrides a leaf's own shape (the global shape of a process-local part).
    """
    unknown: list[tuple[str, ...]] = []
    repeated: list[tuple[str, ...]] = []
    rank: list[tuple[str, ...]] = []
    uneven: list[tuple[str, ...]] = []
    unconstrained: list[tuple[str, ...]] = []
    # Inside `shard_map` a leaf is one shard and its Manual axes are dropped at placement,
    # so only the other axes must divide its (local) shape.
    context = _compat.context_abstract_mesh()
    types = {} if context is None else _compat.axis_type_map(context)
    manual = {name for name, t in types.items() if t == AxisType.Manual}
    rows = {"unknown": unknown, "repeated": repeated, "rank": rank, "uneven": uneven}
    rows["unconstrained"] = unconstrained
    # Leaves of a model share a few layouts and shapes: each distinct one is checked once
    # (keyed by identity: `layouts` holds the meshes and specs alive for the whole loop).
    checked: dict[tuple[Any, ...], list[tuple[str, tuple[str, ...]]]] = {}
    for i, (mesh, spec) in layouts.items():
        shape, shape_label = tuple(flat.leaves[i].shape), "shape"
        if shapes is not None and shapes.get(i, shape) != shape:
            shape, shape_label = shapes[i], "global shape"
        key = (id(mesh), id(spec), shape, shape_label)
        if key not in checked:
            checked[key] = _spec_problems(mesh, spec, shape, shape_label, manual)
        for kind, detail in checked[key]:
            rows[kind].append((pathstr(flat.paths[i]), *detail))
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
    if unconstrained:
        raise ValueError(
            leaf_error(
                f"`{verb}` got `P.UNCONSTRAINED` in specs over meshes with no Auto axis:",
                unconstrained,
                "JAX lets the compiler choose a dim's layout only along Auto mesh axes. Use "
                "`None` (not split) for these dims, or make the mesh axes Auto "
                "(`jax.make_mesh(..., axis_types=(AxisType.Auto, ...))`).",
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


def _spec_problems(
    mesh: Mesh | AbstractMesh,
    spec: PartitionSpec,
    shape: tuple[int, ...],
    shape_label: str,
    manual: set[str],
) -> list[tuple[str, tuple[str, ...]]]:
    """What is wrong with laying out `shape` as `spec` over `mesh`: (kind, row) pairs."""
    sizes = dict(mesh.shape)
    used = [a for entry in spec for a in entry_axes(entry)]
    missing = [a for a in used if a not in sizes]
    if missing:
        shown = f"spec {_compat.spec_str(spec)}"
        return [("unknown", (shown, f"axes {missing} not in mesh {list(sizes)}"))]
    twice = sorted({a for a in used if used.count(a) > 1})
    if twice:
        shown = f"spec {_compat.spec_str(spec)}"
        return [("repeated", (shown, f"axes {twice} used more than once"))]
    if len(spec) > len(shape):
        shown = f"spec {_compat.spec_str(spec)} has {len(spec)} entries"
        return [("rank", (f"shape {shape_str(shape)}", shown))]
    if any(e is PartitionSpec.UNCONSTRAINED for e in spec) and AxisType.Auto not in set(
        _compat.axis_type_map(mesh).values()
    ):
        types = ", ".join(f"{a}: {t.name}" for a, t in _compat.axis_type_map(mesh).items())
        return [("unconstrained", (f"spec {_compat.spec_str(spec)}", f"mesh axes {types}"))]
    problems = []
    for dim, entry in enumerate(spec):
        split = [a for a in entry_axes(entry) if a not in manual]
        parts = math.prod(sizes[a] for a in split)
        if shape[dim] % parts:
            names = " x ".join(repr(a) for a in split)
            problems.append(
                (
                    "uneven",
                    (
                        f"{shape_label} {shape_str(shape)}",
                        f"dim {dim} = {shape[dim]} is not divisible by {parts} (mesh axes {names})",
                    ),
                )
            )
    return problems


def check_abstract_meshes(
    verb: str, flat: Flat, layouts: dict[int, tuple[Mesh | AbstractMesh, PartitionSpec]]
) -> None:
    """Inside `jit`, an `AbstractMesh` target stands for the mesh set by `jax.set_mesh`:
    one with that mesh's axes but other axis types cannot be laid out against it (JAX
    fails with a bare `AssertionError`); named here, with every such leaf."""
    context = _compat.context_abstract_mesh()
    if context is None:
        return
    rows = [
        (pathstr(flat.paths[i]), f"axis types {_types(mesh)}")
        for i, (mesh, _) in layouts.items()
        if isinstance(mesh, AbstractMesh)
        and mesh != context
        and dict(mesh.shape) == dict(context.shape)
        and mesh.axis_types != context.axis_types
    ]
    if rows:
        raise ValueError(
            leaf_error(
                f"`{verb}` got an AbstractMesh whose axes are those of the mesh set by "
                f"`jax.set_mesh` but whose axis types differ from its {_types(context)}, "
                "for these leaves:",
                rows,
                "Pass the set mesh's own abstract mesh (`jax.sharding.get_abstract_mesh()`), "
                "or set a mesh of these axis types.",
            )
        )


def _types(mesh: Mesh | AbstractMesh) -> str:
    return "(" + ", ".join(f"{n}: {t.name}" for n, t in _compat.axis_type_map(mesh).items()) + ")"
