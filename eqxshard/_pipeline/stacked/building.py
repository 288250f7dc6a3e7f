"""Reaching a circular `Stacked`'s stage-major order once, where its stage count was not
known when it was built: `Plan.apply` and `filter_init` build the model's stacks with the
mesh set, and a stack still in layer order warns when its pipeline regroups its weights
every step (`spmd.stage_major.warn_regrouped`)."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from ... import _compat
from .stacked import Stacked, is_stacked


def with_mesh_set(mesh: Mesh | AbstractMesh) -> Any:
    """A context in which `mesh` is the mesh set (`jax.set_mesh`; for an `AbstractMesh`,
    its abstract form), so that a circular `Stacked` built in it stores its stack
    stage-major for the mesh's stage count, as one built under `jax.set_mesh` does."""
    if isinstance(mesh, AbstractMesh):
        return jax.sharding.use_abstract_mesh(mesh)
    try:
        return jax.set_mesh(mesh)
    except ValueError:  # under a trace (`Plan.init`'s `filter_init` builds in eval_shape),
        # where JAX refuses `set_mesh`: the abstract mesh is what a stack built there sees
        return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def _in_layer_order(stack: Stacked, mesh: Mesh | AbstractMesh) -> bool:
    """Whether `stack` is circular, pipelines on `mesh` and is stored in layer order only
    because its stage count was unknown when it was built (no `mesh`, none set)."""
    return (
        stack.axis is not None
        and stack.repeats > 1
        and stack.stages is None
        and stack.mesh is None
        and stack.axis in mesh.axis_names
        and dict(mesh.shape)[stack.axis] > 1
    )


def mesh_to_build_on(abstract: Any, target: Any) -> Mesh | None:
    """For `filter_init`: `target` where it is a mesh and the tree `fn` builds without one
    (`abstract`) holds a circular stack in layer order for lack of it, and no mesh is
    set already (then that one decides, as for a `Stacked` built under it); else `None`."""
    if not isinstance(target, Mesh) or _compat.ambient_mesh() is not None:
        return None
    found = [s for s in jax.tree.leaves(abstract, is_leaf=is_stacked) if is_stacked(s)]
    return target if any(_in_layer_order(s, target) for s in found) else None


def building_on(mesh: Mesh | None) -> Any:
    """`with_mesh_set(mesh)`, or a context that does nothing for `None`."""
    return contextlib.nullcontext() if mesh is None else with_mesh_set(mesh)
