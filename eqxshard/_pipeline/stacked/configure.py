"""A model's `Stacked` layers found by path and configured: what `Plan.apply` does with a
plan's `remat` and `pipeline` choices, and how `auto_plan` finds the stacks to plan for."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from ..._tree import dotted_path
from ..spmd.stage_major import from_stage_major, to_stage_major
from .building import with_mesh_set
from .scan import layer_count
from .stacked import Stacked, is_stacked


def stacks(model: Any) -> dict[str, Stacked]:
    """Every `Stacked` of `model` by its dotted path (`""` for a model that is one), in
    tree order; stacks nested inside a stack's blocks are not looked into."""
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_stacked)[0]
    return {dotted_path(path): leaf for path, leaf in found if isinstance(leaf, Stacked)}


def layers(stack: Stacked) -> int:
    """The layer count of `stack`, also of an abstract one (`jax.ShapeDtypeStruct`s)."""
    return layer_count(stack.blocks, argname="blocks", verb="Stacked")


def configure(
    verb: str,
    model: Any,
    *,
    remat: dict[str, str] | str,
    pipeline: dict[str, Any] | None,
    mesh: Mesh | AbstractMesh,
) -> Any:
    """`model` with each `Stacked` rebuilt with the policy `remat` gives its path (others
    keep theirs; a str is every stack's policy) and, with `pipeline` (`{"axis",
    "microbatches", "repeats"}`), pipelined over `mesh` (each built with `mesh` set, so a
    circular one is stored stage-major for it); raises `ValueError` for paths of `remat`
    that are not stacks, and for a `pipeline` on a model without one."""
    found = stacks(model)
    unknown = [] if isinstance(remat, str) else sorted(set(remat) - set(found))
    if unknown or (pipeline is not None and not found):
        have = ", ".join(repr(p) for p in found) or "none"
        what = f"`remat` names {unknown}" if unknown else "a `pipeline` is chosen"
        raise ValueError(
            f"`{verb}` got a plan where {what}, but the model's `eqxshard.Stacked` layers "
            f"are at: {have}. Apply the plan to the model it was made for, or build the "
            "plan with `remat` keys among these paths (and `pipeline=None` without stacks)."
        )

    def rebuilt(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, Stacked):
            return leaf
        policy = remat if isinstance(remat, str) else remat.get(dotted_path(path), leaf.remat)
        options: dict[str, Any] = dict(remat=policy)
        if pipeline is not None:
            options |= dict(pipeline, mesh=mesh)
        elif leaf.axis is not None:
            options |= dict(
                axis=leaf.axis,
                microbatches=leaf.microbatches,
                repeats=leaf.repeats,
                mesh=leaf.mesh,
            )
        blocks = leaf.blocks  # to layer order: a circular stack may be stored stage-major
        if leaf.stages is not None:
            blocks = from_stage_major(blocks, leaf.stages, leaf.repeats)
        # Built with `mesh` set: a circular stack without a mesh of its own is stored
        # stage-major for `mesh`'s stage count, so its pipeline moves no weights per step.
        with with_mesh_set(mesh):
            return Stacked(blocks, **options)

    return jax.tree_util.tree_map_with_path(rebuilt, model, is_leaf=is_stacked)


def _node(stack: Stacked) -> Any:
    """The structure of `stack` itself: its settings, with its blocks as one leaf."""
    return jax.tree_util.tree_structure(stack, is_leaf=lambda x: x is not stack)


def configure_like(tree: Any, model: Any) -> Any:
    """`tree` (e.g. an optimiser state holding the model's parameters, `mu.blocks`) with
    each `Stacked` in it given the settings of the stack of `model` whose path ends its
    own, so that its structure matches the configured model's again. Its blocks are kept
    as they are (they may be `None`s or masks: nothing is checked)."""
    found = stacks(model)
    if not found:
        return tree

    def rebuilt(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, Stacked):
            return leaf
        where = dotted_path(path)
        for p, stack in found.items():
            if where == p or where.endswith("." + p) or not p:
                return jax.tree_util.tree_unflatten(_node(stack), [_reordered(leaf, stack)])
        return leaf

    return jax.tree_util.tree_map_with_path(rebuilt, tree, is_leaf=is_stacked)


def _reordered(leaf: Stacked, stack: Stacked) -> Any:
    """`leaf`'s blocks (stored in `leaf`'s order) in the order `stack` stores its layers:
    a circular stack may be stored stage-major (array leaves without a layer dim stay)."""
    blocks, stored = leaf.blocks, getattr(leaf, "stages", None)
    if stored is not None:
        blocks = from_stage_major(blocks, stored, leaf.repeats)
    if stack.stages is not None:
        blocks = to_stage_major(blocks, stack.stages, stack.repeats)
    return blocks
