"""The pipeline of a step that calls `filter_pipeline` itself (not through a `Stacked` a
plan can configure), found while the step is traced (`_pipeline.watch`): its stage axis,
schedule and the model leaves it pipelines; and how the step is traced outside a
candidate (one stage on one device). The stage dimension proposes the meshes with that
axis (`dimensions/stage/in_step.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from ...._pipeline.stacked.building import with_mesh_set
from ...._pipeline.watch import PipelineCall
from ...rules import dotted_path


@dataclasses.dataclass(frozen=True)
class OwnPipeline:
    """What a step that pipelines by itself fixes: its stage axis, schedule, the dotted
    paths of the model leaves it pipelines, and each call's layer count."""

    axis: str
    microbatches: int
    repeats: int
    paths: tuple[str, ...]
    layers: tuple[int, ...]


def found(calls: list[PipelineCall], inputs: list[tuple[Any, Any]], stacked: bool) -> OwnPipeline:
    """The pipeline of a step whose trace made `calls`, given the model's leaves as traced
    (`(path, leaf)`); raises where it cannot be planned. `stacked`: the model holds
    `Stacked` layers."""
    mpmd = [c for c in calls if c.verb != "filter_pipeline"]
    if mpmd:
        raise ValueError(
            f"`auto_plan` found that `step` calls `{mpmd[0].verb}`, which drives each stage's "
            "program from Python, outside `jit`: such a step is not one compiled program, so "
            "no layout of it can be compiled and measured. Plan the step with "
            "`filter_pipeline` in it instead (the same layers, microbatches and axis; "
            "`jax.grad` through it), then train with `pipeline_value_and_grad` on the "
            "chosen mesh, or hold the layers in an `eqxshard.Stacked`."
        )
    fixed = [c for c in calls if c.mesh]
    if fixed:
        raise ValueError(
            f"`auto_plan` found that `step` calls `filter_pipeline(..., mesh=...)` over axis "
            f"{fixed[0].axis!r}: the step is fixed to that mesh, so no other layout can run "
            "it. Drop `mesh=` in the step (it then runs on the mesh set, which `auto_plan` "
            "chooses and `plan.jit(step)` sets), or hold the layers in an `eqxshard.Stacked`."
        )
    kinds = {(c.axis, c.microbatches, c.repeats) for c in calls}
    if len(kinds) > 1 or stacked:
        said = "; ".join(f"axis {a!r}, microbatches={m}, repeats={r}" for a, m, r in kinds)
        more = " and the model holds `eqxshard.Stacked` layers" if stacked else ""
        raise ValueError(
            f"`auto_plan` found that `step` pipelines in more than one way: it calls "
            f"`filter_pipeline` with {said}{more}. A plan has one stage axis and one "
            "schedule: use the same axis, microbatches and repeats in every call (or "
            "pipeline every stack through `eqxshard.Stacked`, which `auto_plan` configures)."
        )
    (axis, microbatches, repeats) = kinds.pop()
    by_id = {id(leaf): dotted_path(path) for path, leaf in inputs}
    missing = [where for c in calls for where, leaf in c.blocks if id(leaf) not in by_id]
    if missing or not any(c.blocks for c in calls):
        rows = "\n".join(f"  {w}" for w in missing) or "  (no array leaves)"
        raise ValueError(
            "`auto_plan` found that `step` calls `filter_pipeline`, but could not find these "
            f"leaves of its `blocks` among the model's leaves:\n{rows}\nThe step builds or "
            "computes them (or passes them through `jax.checkpoint`/`vmap`), so `auto_plan` "
            "cannot lay them out over the stages. Pass the model's stacked leaves to "
            "`filter_pipeline` as they are (e.g. `model.blocks`), inside `jax.grad` if need be."
        )
    paths = tuple(dict.fromkeys(by_id[id(leaf)] for c in calls for _, leaf in c.blocks))
    layers = tuple(int(c.blocks[0][1].shape[0]) for c in calls)
    return OwnPipeline(axis, microbatches, repeats, paths, layers)


def tracing(own: OwnPipeline | None) -> Any:
    """A context in which the step traces outside a candidate: one stage on one device."""
    if own is None:
        return contextlib.nullcontext()
    return with_mesh_set(Mesh(jax.devices()[:1], (own.axis,)))
