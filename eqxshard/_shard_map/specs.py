"""The specs of `filter_shard_map`: one spec per leaf, checked against leaves and mesh."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .. import _compat
from .._placement import spec_tree
from .._placement.specs import entry_axes
from .._tree import Flat, broadcast_prefix, leaf_error, pathstr, shape_str

_VERB = "filter_shard_map"


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding))


_SCALARS = (bool, int, float, complex, np.number, np.bool_)


def scalars_as_arrays(tree: Any, specs: Any, argname: str) -> Any:
    """`tree` with each Python or NumPy scalar leaf that `specs` gives a spec of its own
    made a JAX array, as `jax.shard_map` makes it (weakly typed for Python scalars). A
    spec over a whole subtree leaves its non-array leaves alone, as elsewhere."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not any(isinstance(x, _SCALARS) for x in leaves):
        return tree
    if (callable(specs) and not _is_spec_leaf(specs)) or hasattr(specs, "spec_for"):
        return tree  # a callable spec is only called on array leaves
    values, on_leaf, _ = broadcast_prefix(
        specs, tree, is_leaf=_is_entry, argname=argname, verb=_VERB
    )
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    given = set(on_leaf)
    leaves = [
        jnp.asarray(x)
        if isinstance(x, _SCALARS) and _is_spec_leaf(v) and v is not None and p in given
        else x
        for x, v, p in zip(leaves, values, paths, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _is_entry(x: Any) -> bool:
    """A leaf of an `in_specs`/`out_specs` prefix tree: a spec, a sharding, a rule or a
    callable (read per leaf by `spec_tree`, as every verb's `spec`)."""
    return _is_spec_leaf(x) or spec_tree.is_spec_form(x)


def specs_per_leaf(flat: Flat, specs: Any, mesh: Mesh | AbstractMesh, argname: str) -> list[Any]:
    """One entry of `specs` per leaf of `flat`: a `PartitionSpec`, `None`, or a bad value.
    A rule or callable, alone or in a prefix tree, is asked for each array leaf's spec
    (with the leaf's path from the subtree it was given for)."""
    if _is_entry(specs):
        values, prefixes = [specs] * len(flat.leaves), None
    else:
        values, prefixes = spec_tree.spread(
            flat, specs, argname=argname, verb=_VERB, is_leaf=_is_entry
        )
    out = []
    for i, (x, value) in enumerate(zip(flat.leaves, values, strict=True)):
        if _is_spec_leaf(value) or not _is_entry(value):
            out.append(value)
        elif not flat.is_array[i]:
            out.append(None)  # rules and callables only place arrays
        else:
            path = tuple(flat.paths[i])
            relative = path if prefixes is None else path[len(prefixes[i]) :]
            out.append(spec_tree.spec_at(value, relative, x, mesh))
    return out


def check_spec_values(
    flat: Flat,
    values: list[Any],
    mesh: Mesh | AbstractMesh,
    manual: frozenset[str],
    argname: str,
    *,
    none_ok: bool,
) -> dict[int, PartitionSpec]:
    """Each array leaf's `PartitionSpec` from `values` (`specs_per_leaf`'s); raises naming
    every leaf whose spec is unusable: not a spec, missing (`None` where `none_ok` is
    false), a sharding on another mesh, or naming axes outside `manual`."""
    out: dict[int, PartitionSpec] = {}
    wrong_type: list[tuple[str, str]] = []
    missing: list[tuple[str, str]] = []
    other_mesh: list[tuple[str, str]] = []
    not_manual: list[tuple[str, str, str]] = []
    for i in flat.array_indices:
        path, spec = pathstr(flat.paths[i]), values[i]
        if isinstance(spec, NamedSharding):
            if dict(spec.mesh.shape) != dict(mesh.shape):
                other_mesh.append((path, f"mesh {dict(spec.mesh.shape)}"))
                continue
            spec = spec.spec
        if spec is None:
            if none_ok:
                spec = PartitionSpec()
            else:
                shape = shape_str(getattr(flat.leaves[i], "shape", ()))
                missing.append((path, f"array of shape {shape}"))
                continue
        if not isinstance(spec, PartitionSpec):
            wrong_type.append((path, f"{spec!r} of type {type(spec).__name__}"))
            continue
        named = {a for e in _compat.spec_entries(spec) for a in entry_axes(e)}
        extra = sorted((named | _compat.spec_reductions(spec)) - manual, key=str)
        if extra and all(a in mesh.axis_names for a in extra):
            shown = f"spec {_compat.spec_str(spec)}"
            not_manual.append((path, shown, f"axes {extra} not in `axis_names`"))
            continue
        out[i] = spec
    if wrong_type:
        raise TypeError(
            leaf_error(
                f"`{_VERB}` got `{argname}` entries that are not PartitionSpecs, for these leaves:",
                wrong_type,
                f"Give each array leaf a `PartitionSpec` in `{argname}` (a prefix PyTree of "
                "them, or a callable `(path, leaf) -> PartitionSpec`).",
            )
        )
    if other_mesh:
        raise ValueError(
            leaf_error(
                f"`{_VERB}` got `{argname}` NamedShardings on another mesh than "
                f"{dict(mesh.shape)}, for these leaves:",
                other_mesh,
                "Use PartitionSpecs, or NamedShardings on the mesh given to `filter_shard_map`.",
            )
        )
    if missing:
        raise ValueError(
            leaf_error(
                f"`{_VERB}` got `None` in `{argname}` for these array outputs:",
                missing,
                "Every array output needs a PartitionSpec saying how the per-device results "
                "are joined: P() if they are equal on every device, P('name') to concatenate "
                "along dim 0, ...; `None` is for non-array outputs.",
            )
        )
    if not_manual:
        raise ValueError(
            leaf_error(
                f"`{_VERB}` got `{argname}` naming mesh axes outside `axis_names` "
                f"{sorted(manual)}:",
                not_manual,
                "Name only the axes the function is mapped over in `in_specs`/`out_specs`, "
                "or add these axes to `axis_names`.",
            )
        )
    return out


def check_out_specs(flat: Flat, specs: dict[int, PartitionSpec], mesh: Mesh | AbstractMesh) -> None:
    """Raises naming every output whose spec names axes the mesh lacks, uses an axis
    twice, or has more entries than the output has dims. (Outputs are joined, not
    split: nothing else about them can be wrong.)"""
    unknown, repeated, rank = [], [], []
    sizes = dict(mesh.shape)
    for i, spec in specs.items():
        path, shape = pathstr(flat.paths[i]), tuple(flat.leaves[i].shape)
        entries = _compat.spec_entries(spec)
        used = [a for e in entries for a in entry_axes(e)]
        missing = [a for a in (*used, *sorted(_compat.spec_reductions(spec))) if a not in sizes]
        if missing:
            shown = f"spec {_compat.spec_str(spec)}"
            unknown.append((path, shown, f"axes {missing} not in mesh {list(sizes)}"))
        elif len(set(used)) != len(used):
            twice = sorted({a for a in used if used.count(a) > 1})
            shown = f"spec {_compat.spec_str(spec)}"
            repeated.append((path, shown, f"axes {twice} used more than once"))
        elif len(entries) > len(shape):
            rank.append(
                (
                    path,
                    f"per-device shape {shape_str(shape)}",
                    f"spec {_compat.spec_str(spec)} has {len(entries)} entries",
                )
            )
    for rows, header, fix in (
        (unknown, "naming axes its mesh does not have", "Use only the mesh's axis names."),
        (repeated, "using a mesh axis more than once", "Use each axis name once per spec."),
        (
            rank,
            "with more entries than the per-device outputs have dims",
            "Give each output at most one entry per dim; to stack rank-0 results, return "
            "them with a leading dim of size 1 (e.g. `x[None]`).",
        ),
    ):
        if rows:
            raise ValueError(leaf_error(f"`{_VERB}` got `out_specs` {header}:", rows, fix))
