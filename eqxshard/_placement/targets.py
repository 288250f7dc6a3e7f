"""Reading `target` and `spec` into one sharding per array leaf, on this process alone:
every accepted form (a mesh, a sharding, a device, a `PartitionSpec`, prefix trees of
them, a callable, a rule) and the checks made before anything moves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._tree import Flat, leaf_error, pathstr
from . import multihost, spec_tree
from .specs import check_abstract_meshes, check_specs

# Sentinels for "the argument was not given" (as opposed to `None` inside a prefix
# tree, which means "leave this subtree alone").
UNSET: Any = object()


TARGET_TYPES = (Mesh, AbstractMesh, Sharding, jax.Device, PartitionSpec)


class RuleError(ValueError):
    """Raised by a rule's `spec_for` for one leaf it cannot give a spec.

    `resolve` gathers these over all leaves and raises one `ValueError` per kind of
    failure (same `header` and `fix`), listing every failing leaf: `header` follows the
    verb's name, `detail` is the leaf's row after its path, `fix` says what to do.
    """

    def __init__(self, header: str, detail: tuple[str, ...], fix: str):
        super().__init__(f"{header}\n  {'  '.join(detail)}\n{fix}")
        self.header, self.detail, self.fix = header, detail, fix


def is_target_leaf(x: Any) -> bool:
    return x is None or isinstance(x, TARGET_TYPES) or isinstance(x, str)


def is_spec_leaf(x: Any) -> bool:
    return spec_tree.is_spec_form(x)


def per_leaf(
    flat: Flat,
    value: Any,
    *,
    argname: str,
    verb: str,
    is_leaf: Callable[[Any], bool],
    strict: bool = True,
) -> list[Any]:
    """`value` for every leaf of `flat`: one value for all, or a prefix tree broadcast.

    With `strict`, raises if a prefix tree gives a non-`None` value for a leaf that is
    not an array; otherwise such values are ignored.
    """
    if is_leaf(value) or value is UNSET:
        return [value] * len(flat.leaves)
    return spec_tree.spread(
        flat, value, argname=argname, verb=verb, is_leaf=is_leaf, strict=strict
    )[0]


def check_dtypes(verb: str, flat: Flat, indices: list[int], fix: str | None = None) -> None:
    """Raises for array leaves whose dtype JAX has no arrays of (strings, objects, ...),
    naming each, before JAX sees them; `fix` replaces the placement verbs' advice."""
    rows = [
        (pathstr(flat.paths[i]), f"dtype {flat.leaves[i].dtype}", _dtype_word(flat.leaves[i]))
        for i in indices
        if hasattr(flat.leaves[i], "dtype") and not _compat.is_jax_dtype(flat.leaves[i].dtype)
    ]
    if rows:
        raise TypeError(
            leaf_error(
                f"`{verb}` got array leaves whose dtype JAX has no arrays of:",
                rows,
                fix
                or "Convert them to a numeric dtype (e.g. strings to integer codes), keep them "
                "out of the arrays (a static field: `eqx.field(static=True)`), or put `None` "
                "at their paths in `target` to leave them alone.",
            )
        )


def _dtype_word(x: Any) -> str:
    kind = x.dtype.kind
    words = {"U": "strings", "S": "bytes", "O": "Python objects", "M": "datetimes"}
    words |= {"m": "timedeltas", "V": "raw or structured records"}
    return f"({words.get(kind, 'not a JAX dtype')})"


def resolve_here(
    verb: str,
    flat: Flat,
    target: Any,
    spec: Any,
    resolve_str: Callable[[str], Sharding] | None,
    process_local: bool,
) -> dict[int, Sharding]:
    """The sharding each array leaf must get, from this process's arguments alone.

    `target` is `UNSET` (the ambient mesh), a target form, or a prefix tree of them;
    `spec` is `UNSET`, a `PartitionSpec`, a callable `(path, leaf) -> PartitionSpec |
    None`, a rule: an object with a method `spec_for(path, leaf, mesh) -> PartitionSpec |
    None`, called with each array leaf's mesh (sharding rules are built on this), or a
    prefix tree of these (read by `spec_tree.per_leaf_specs`).

    With `process_local=True`, specs are checked against the global shapes the local
    parts make. No collective runs here.
    """
    # A target tree may hold a sharding at a non-array leaf, as `eqx.filter_shard` allows
    # (`jax.tree.map(lambda _: sharding, model)`): it is ignored there. A spec may not.
    targets = per_leaf(
        flat, target, argname="target", verb=verb, is_leaf=is_target_leaf, strict=False
    )
    specs = spec_tree.per_leaf_specs(flat, spec, unset=UNSET, verb=verb)

    out: dict[int, Sharding] = {}
    # (mesh, spec) per leaf, checked before any `NamedSharding` is built: its constructor
    # raises on unknown or repeated axis names without saying which leaf.
    layouts: dict[int, tuple[Mesh | AbstractMesh, PartitionSpec]] = {}
    type_errors: list[tuple[str, str]] = []
    no_mesh: list[tuple[str, str]] = []
    no_target: list[tuple[str]] = []
    # float0 leaves (the cotangents of integers) have no devices: left as they are, as
    # `eqx.filter_shard` leaves them.
    for i in flat.array_indices:
        if getattr(flat.leaves[i], "dtype", None) == jax.dtypes.float0:
            targets[i] = None
    placed_here = [
        i
        for i in flat.array_indices
        if targets[i] is not None and specs[i] is not None and not _compat.is_tracer(flat.leaves[i])
    ]
    check_dtypes(verb, flat, placed_here)
    ambient: list[Any] = []  # looked up once, on first use
    replicated = PartitionSpec()  # one object for every leaf given no spec
    rule_errors: dict[tuple[str, str], list[tuple[str, ...]]] = {}
    asked: dict[int, tuple[Any, list[tuple[Any, Any, Any]]]] = {}  # each rule's leaves

    def where(i: int) -> str:  # paths only for error rows: most calls never need them
        return pathstr(flat.paths[i])

    for i in flat.array_indices:
        t, s = targets[i], specs[i]
        if t is None or s is None:
            continue
        if isinstance(t, PartitionSpec) and s is not UNSET:
            type_errors.append((where(i), "a PartitionSpec target and a `spec` were both given"))
            continue
        mesh = None
        if t is UNSET or isinstance(t, PartitionSpec):
            if not ambient:
                ambient.append(_compat.ambient_mesh())
            mesh = ambient[0]
            if mesh is None:
                given = t if t is not UNSET else s
                if isinstance(given, PartitionSpec):
                    no_mesh.append((where(i), f"spec {_compat.spec_str(given)}"))
                else:
                    no_target.append((where(i),))
                continue
        elif isinstance(t, (Mesh, AbstractMesh)):
            mesh = t
        if isinstance(s, spec_tree.Ruled):
            if mesh is None:
                type_errors.append((where(i), f"a rule `spec` was given with target {_short(t)}"))
                continue
            owner = getattr(s.rule, "__self__", None)  # the rule, asked for `unused` below
            if getattr(owner, "unused", None) is not None:
                asked.setdefault(id(owner), (owner, []))[1].append((s.path, flat.leaves[i], mesh))
            try:
                s = s.rule(s.path, flat.leaves[i], mesh)
            except RuleError as e:  # gathered, so that one error lists every such leaf
                rule_errors.setdefault((e.header, e.fix), []).append((where(i), *e.detail))
                continue
            if s is None:
                continue
        if s is not UNSET and not isinstance(s, PartitionSpec):
            type_errors.append((where(i), f"spec {s!r} is not a PartitionSpec"))
        elif mesh is not None:
            spec_i = t if isinstance(t, PartitionSpec) else s
            layouts[i] = (mesh, replicated if spec_i is UNSET else spec_i)
        elif s is not UNSET:
            type_errors.append(
                (where(i), f"a `spec` was given with target {_short(t)}, which fixes the layout")
            )
        elif isinstance(t, Sharding):
            out[i] = t
        elif isinstance(t, jax.Device):
            out[i] = jax.sharding.SingleDeviceSharding(t)
        elif isinstance(t, str) and resolve_str is not None:
            out[i] = resolve_str(t)
        else:
            type_errors.append((where(i), f"target {t!r} of type {type(t).__name__}"))
    if type_errors:
        raise TypeError(
            leaf_error(
                f"`{verb}` cannot read the `target`/`spec` given for these leaves:",
                type_errors,
                "A target is a Mesh, a Sharding, a Device or a PartitionSpec (or a prefix tree of "
                f"them); {spec_tree.FORMS}, and goes only with a Mesh target or the ambient mesh.",
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
    if no_target:
        if verb == "filter_replicate":
            argname, forms = "mesh", "a `Mesh`"
        else:
            argname, forms = "target", "a mesh, a sharding or a device"
        raise ValueError(
            leaf_error(
                f"`{verb}` was given no `{argname}` and no mesh is set, so it has nowhere to "
                "place these leaves:",
                no_target,
                f"Pass `{argname}` ({forms}), or set a mesh with `jax.set_mesh(mesh)` (also "
                "for calls inside `jit`, which read it from there).",
            )
        )
    if rule_errors:  # the first kind of rule failure, with every leaf that has it
        (header, fix), rows = next(iter(rule_errors.items()))
        raise ValueError(leaf_error(f"`{verb}` {header}", rows, fix))
    _warn_unused(verb, asked)
    layouts.update((i, (s.mesh, s.spec)) for i, s in out.items() if isinstance(s, NamedSharding))
    shapes = multihost.global_shapes(flat, layouts, process_local=process_local)
    check_specs(verb, flat, layouts, shapes)
    check_abstract_meshes(verb, flat, layouts)
    # One `NamedSharding` per distinct layout, shared by its leaves: building one costs more
    # than the dict lookup, and `device_put` and `place.already_placed` compare them faster.
    # (Keyed by identity: `P(("a",)) == P("a")`, and each leaf keeps the very spec it got.)
    built: dict[tuple[int, int], NamedSharding] = {}
    for i, (mesh, spec) in layouts.items():
        if i not in out:
            key = (id(mesh), id(spec))
            if key not in built:
                built[key] = NamedSharding(mesh, spec)
            out[i] = built[key]
    return out


def _warn_unused(verb: str, asked: dict[int, tuple[Any, list[tuple[Any, Any, Any]]]]) -> None:
    """Warns for the parts of each rule that gave no leaf its spec (a `path_rules`
    pattern that matches no path, alone or inside `first`): a typo does nothing else."""
    # Not for `auto_plan`, which lays the model and the optimiser state out apart by the
    # same rules (patterns for the model's paths match none of the state's), nor for
    # `describe`, which is asked about parts of a model (one block) with the whole's rule.
    if verb in ("auto_plan", "describe"):
        return
    parts = [part for rule, seen in asked.values() for part in rule.unused(seen)]
    if parts:
        warnings.warn(
            f"`{verb}`: these parts of the `spec` rules gave no leaf its spec: "
            f"{', '.join(parts)}. A pattern must match a whole dotted path (`re.fullmatch`, "
            "as `describe` prints paths) that no earlier pattern or rule has taken; fix or "
            "remove these.",
            UserWarning,
            stacklevel=3,
        )


def _short(t: Any) -> str:
    return type(t).__name__ if isinstance(t, (Sharding, Mesh)) else repr(t)


def given_mesh(verb: str, mesh: Any) -> Mesh | AbstractMesh:
    """`mesh`, or the ambient mesh when it is `None`, checked to be a mesh (for `verb`'s
    errors)."""
    if mesh is None:
        mesh = _compat.ambient_mesh()
        if mesh is None:
            raise ValueError(
                f"`{verb}` was called without a `mesh` and no mesh is set. Pass "
                f"`{verb}(..., mesh=mesh)`, or call it inside `with jax.set_mesh(mesh):`."
            )
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"`{verb}(mesh=...)` must be a `jax.sharding.Mesh` or `AbstractMesh`, got "
            f"{type(mesh).__name__}. Build one with `jax.make_mesh(shape, names)`."
        )
    return mesh
