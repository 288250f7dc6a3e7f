"""A `spec` read per array leaf, in every form the verbs take: a `PartitionSpec`, a rule,
a callable `(path, leaf) -> PartitionSpec | None`, or a prefix PyTree of these (and
`None`, "leave this subtree alone").

A rule or callable given inside a prefix tree sees each leaf's path from the subtree it
was given for, so `(fsdp("data"), like(params))` for `(model, opt_state)` reads as "the
model by `fsdp`, the optimiser state like the parameters". `targets.resolve_here` (every
placement and plan verb) and `filter_jit`'s layouts read specs through here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .._tree import Flat, Path, broadcast_prefix, leaf_error, pathstr

# What a `spec` may be, for the last line of an error about one.
FORMS = (
    "a `spec` is a PartitionSpec, a rule (`fsdp`, `path_rules`, `like`, `logical`, "
    "`first`), a callable `(path, leaf) -> PartitionSpec | None`, or a prefix PyTree of "
    "these with `None` to leave a subtree alone"
)


def is_rule(x: Any) -> bool:
    """A rule: an object with `spec_for(path, leaf, mesh)` (e.g. `fsdp`, `like`)."""
    return not isinstance(x, PartitionSpec) and getattr(x, "spec_for", None) is not None


def is_callable_spec(x: Any) -> bool:
    """A callable `(path, leaf) -> PartitionSpec | None` (a module is a tree, not one)."""
    return callable(x) and not isinstance(x, (PartitionSpec, eqx.Module)) and not is_rule(x)


def is_spec_form(x: Any) -> bool:
    """A leaf of a spec prefix tree: `None`, a `PartitionSpec`, a rule or a callable."""
    return x is None or isinstance(x, PartitionSpec) or is_rule(x) or is_callable_spec(x)


class Ruled(NamedTuple):
    """A leaf whose spec a rule gives once its mesh is known: `rule(path, leaf, mesh)`,
    with `path` relative to the subtree the rule was given for."""

    rule: Any
    path: Path


def spec_at(form: Any, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> Any:
    """The spec one form gives one leaf (`path` relative to where the form was given)."""
    if form is None or isinstance(form, PartitionSpec):
        return form
    if is_rule(form):
        return form.spec_for(path, leaf, mesh)
    return form(path, leaf)


def per_leaf_specs(flat: Flat, spec: Any, *, unset: Any, verb: str) -> list[Any]:
    """Each leaf's spec: `unset` (not given), `None`, a `PartitionSpec`, a `Ruled` (for
    the caller to call with the leaf's mesh), or any other value (a mistake, reported by
    the caller with the leaf's path). Callables are called here, on array leaves only.

    Raises `ValueError` if a prefix tree does not match `flat`'s tree, or puts a spec
    exactly on a non-array leaf.
    """
    n = len(flat.leaves)
    if spec is unset:
        return [unset] * n
    if is_spec_form(spec) or not _is_tree(spec):
        forms, prefixes = [spec] * n, None
    else:
        forms, prefixes = spread(flat, spec, argname="spec", verb=verb, is_leaf=is_spec_form)
    out: list[Any] = list(forms)
    for i in flat.array_indices:
        form = forms[i]
        if form is None or isinstance(form, PartitionSpec):
            continue
        path = tuple(flat.paths[i])
        relative = path if prefixes is None else path[len(prefixes[i]) :]
        if is_rule(form):
            out[i] = Ruled(form.spec_for, relative)
        elif is_callable_spec(form):
            out[i] = form(relative, flat.leaves[i])
    return out


def forms_per_leaf(flat: Flat, spec: Any, *, verb: str) -> list[tuple[Any, Path]]:
    """The form `spec` gives each leaf and the leaf's path relative to where that form
    was given (for a summary of what each rule did; no callable is called)."""
    if is_spec_form(spec) or not _is_tree(spec):
        return [(spec, tuple(p)) for p in flat.paths]
    forms, prefixes = spread(flat, spec, argname="spec", verb=verb, is_leaf=is_spec_form)
    return [
        (form, tuple(p)[len(prefix) :])
        for form, prefix, p in zip(forms, prefixes, flat.paths, strict=True)
    ]


def _is_tree(x: Any) -> bool:
    """Whether `x` is a PyTree node (a tuple, dict, module, ...) rather than one value."""
    leaves = jax.tree_util.tree_leaves(x, is_leaf=is_spec_form)
    return not (len(leaves) == 1 and leaves[0] is x)


def spread(
    flat: Flat,
    value: Any,
    *,
    argname: str,
    verb: str,
    is_leaf: Any,
    strict: bool = True,
) -> tuple[list[Any], list[Path]]:
    """The leaf of the prefix tree `value` above each leaf of `flat`, and the path in
    `value` it was given at, in `flat`'s leaf order.

    With `strict`, raises if `value` puts a non-`None` value exactly on a leaf that is not
    an array; otherwise such values are ignored.
    """
    tree = flat.rebuild({})
    values, on_leaf, prefixes = broadcast_prefix(
        value, tree, is_leaf=is_leaf, argname=argname, verb=verb
    )
    position = {path: i for i, path in enumerate(flat.paths)}
    bad = [
        (pathstr(p), type(flat.leaves[position[p]]).__name__)
        for p in (on_leaf if strict else ())
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
    return values, prefixes
