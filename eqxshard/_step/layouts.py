"""`in_shardings` and `out_shardings` of `filter_jit`: one sharding per array leaf.

A layout tree is a prefix PyTree (of the call's positional arguments, or of the output)
whose leaves are any form `filter_shard` takes as a `target` (a `Sharding`, a `Device`,
a `Mesh`) or as a `spec` (a `PartitionSpec`, a rule such as `fsdp`/`path_rules`/
`like(params)`, a callable `(path, leaf) -> PartitionSpec | None`), or `None` to leave a
subtree alone. Specs and rules are laid out over `filter_jit`'s `mesh` (or the mesh set
by `jax.set_mesh`); a rule sees each leaf's path from the subtree it was given for, so
`(fsdp("data"), P("data"))` reads as "the model by `fsdp`, the batch by rows".
Everything resolves through `_placement.resolve`, so the checks and errors are
`filter_shard`'s.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from .._compat import ambient_mesh, is_tracer, spec_str
from .._placement import (
    place as _place,
    resolve as _resolve,
    spec_tree as _spec_tree,
    targets as _targets,
)
from .._tree import Flat, Path, is_array_like, leaf_error, pathstr
from .leaves import call_path

_FIXED = (Mesh, AbstractMesh, Sharding, jax.Device)


def is_layout_leaf(x: Any) -> bool:
    """A leaf of an `in_shardings`/`out_shardings` prefix tree."""
    return isinstance(x, _FIXED) or _spec_tree.is_spec_form(x)


def check_layouts(value: Any, argname: str) -> None:
    """Raises, naming each leaf of `value` (`in_shardings` or `out_shardings`, as
    `argname` says) that is not a layout, when `filter_jit` is made."""
    entries = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_layout_leaf)[0]
    bad = [(pathstr(p), f"{type(x).__name__} {x!r}") for p, x in entries if not is_layout_leaf(x)]
    if bad:
        raise TypeError(
            leaf_error(
                f"`filter_jit` takes `{argname}` as a layout or a prefix tree of them, but "
                "this tree has other leaves:",
                bad,
                "A layout is a Sharding, a Device, a Mesh (replicated), a PartitionSpec, a rule "
                "(`fsdp`, `path_rules`, `like`, ...), a callable `(path, leaf) -> PartitionSpec "
                "| None`, or `None` (leave alone).",
            )
        )


def _spread(tree: Any, layouts: Any, argname: str) -> list[tuple[Path, Any]]:
    """(the path of the layout leaf above it, that layout) for every leaf of `tree`."""
    count = len(jax.tree_util.tree_leaves(tree))
    if is_layout_leaf(layouts):
        return [((), layouts)] * count
    pieces: list[tuple[Path, Any, int]] = []

    def visit(path: Path, layout: Any, subtree: Any) -> None:
        pieces.append((tuple(path), layout, len(jax.tree_util.tree_leaves(subtree))))

    try:
        jax.tree_util.tree_map_with_path(visit, layouts, tree, is_leaf=is_layout_leaf)
    except ValueError as e:
        raise ValueError(
            f"`filter_jit` got an `{argname}` whose structure is not a prefix of "
            f"{'the positional arguments' if argname == 'in_shardings' else 'the output'}.\n"
            f"{str(e).replace('tree_map_with_path tree', f'`{argname}`')}\n"
            f"Give `{argname}` {_SHAPE[argname]}, with `None` for subtrees to leave alone, "
            "or one layout for everything."
        ) from None
    return [(path, layout) for path, layout, n in pieces for _ in range(n)]


_SHAPE = {
    "in_shardings": "one entry per positional argument (a tuple), each a prefix of its argument",
    "out_shardings": "the structure of the output (or of a prefix of it)",
}


class _Dispatch:
    """The spec-like layouts of a tree, as one rule (read by its `spec_for`, as
    `filter_shard` reads rules, so that this layer needs no import of `_plans`): each
    leaf asks the layout above it, with its path relative to where it was given."""

    def __init__(self, layouts: dict[Path, tuple[Path, Any]]):
        self.layouts = layouts

    def spec_for(self, path: Path, leaf: Any, mesh: Any) -> Any:
        prefix, layout = self.layouts[tuple(path)]
        return _spec_tree.spec_at(layout, tuple(path)[len(prefix) :], leaf, mesh)


def resolve_layouts(
    tree: Any, layouts: Any, *, mesh: Mesh | AbstractMesh | None, argname: str
) -> dict[int, Sharding]:
    """The sharding of each array leaf of `tree` (by index in its flattening) that
    `layouts` places; leaves it leaves alone are absent."""
    flat = Flat(tree, is_array=is_array_like)
    spread = _spread(tree, layouts, argname)
    fixed: dict[int, Any] = {}
    ruled: dict[int, tuple[Path, Any]] = {}
    # (Every leaf of `layouts` is a layout: `filter_jit` checked that when it was made.)
    for i in flat.array_indices:
        prefix, layout = spread[i]
        if layout is None:
            continue
        if isinstance(layout, _FIXED):
            fixed[i] = layout
        else:
            ruled[i] = (prefix, layout)
    n = len(flat.leaves)
    out: dict[int, Sharding] = {}
    if fixed:
        targets = flat.rebuild({i: fixed.get(i) for i in range(n)})
        out |= _resolved(flat, targets, _targets.UNSET, argname)
    if ruled:
        mesh = mesh if mesh is not None else ambient_mesh()
        if mesh is None:
            rows = [(pathstr(flat.paths[i]), _kind(ruled[i][1])) for i in ruled]
            raise ValueError(
                leaf_error(
                    f"`filter_jit` was given specs or rules in `{argname}` but no mesh to "
                    "lay them out over, for these leaves:",
                    rows,
                    "Pass `mesh=` to `filter_jit`, set one with `jax.set_mesh(mesh)`, or "
                    "give `NamedSharding`s instead.",
                )
            )
        targets = flat.rebuild({i: mesh if i in ruled else None for i in range(n)})
        rule = _Dispatch({tuple(flat.paths[i]): v for i, v in ruled.items()})
        out |= _resolved(flat, targets, rule, argname)
    return out


def _resolved(flat: Flat, targets: Any, spec: Any, argname: str) -> dict[int, Sharding]:
    """`_resolve.resolve`, its errors said to be about `argname` (their leaf paths start
    at the argument: `[0]` is the first positional argument)."""
    try:
        return _resolve.resolve("filter_jit", flat, targets, spec, sync=False)
    except TypeError as e:
        raise TypeError(f"In `{argname}`: {e}") from None
    except ValueError as e:
        raise ValueError(f"In `{argname}`: {e}") from None


def _kind(layout: Any) -> str:
    if isinstance(layout, PartitionSpec):
        return f"spec {layout}"
    return f"rule {layout!r}" if _spec_tree.is_rule(layout) else "a callable spec"


def check_inputs(flat: Flat, shardings: dict[int, Sharding]) -> None:
    """Raises, naming every committed input not laid out as `in_shardings` asks
    (`move_inputs=False`). NumPy data and uncommitted arrays are placed by `jit` itself."""
    rows = []
    for i, sharding in shardings.items():
        x = flat.leaves[i]
        if is_tracer(x) or not isinstance(x, jax.Array) or not x.committed:
            continue
        if not _place.already_placed(x, sharding):
            rows.append(
                (
                    call_path(flat.paths[i]),
                    f"is {_layout(x.sharding)}",
                    f"asked {_layout(sharding)}",
                )
            )
    if rows:
        raise ValueError(
            leaf_error(
                "`filter_jit` (with `move_inputs=False`) got inputs not laid out as "
                "`in_shardings` asks:",
                rows,
                "Lay them out before the call (`eqxshard.filter_shard(x, sharding)`), or "
                "let `filter_jit` move them: `move_inputs=True` (the default).",
            )
        )


def _layout(sharding: Sharding) -> str:
    if isinstance(sharding, NamedSharding):
        return f"{spec_str(sharding.spec)} over mesh {dict(sharding.mesh.shape)}"
    return repr(sharding)


def move_inputs(flat: Flat, shardings: dict[int, Sharding]) -> dict[int, Any]:
    """Lays out every leaf not yet laid out as asked, through the path `filter_shard`
    takes (one batched `device_put` outside `jit`, a constraint inside)."""
    return _place.place("filter_jit", flat, shardings)
