"""Pipeline candidates for a step that calls `filter_pipeline` itself (not through a
`Stacked` a plan can configure): found while the step is traced (`_pipeline.watch`).

The step fixes its stage axis' name and its schedule (microbatches, repeats) in its code,
and runs on whatever mesh is set (`filter_pipeline(mesh=None)`). So its candidates are
the meshes with that axis: every stage count `S > 1` dividing the devices and each call's
layer count over its `repeats` (with microbatches >= `S`), times the data x fsdp x model
factorisations of the rest; the leaves the step passes as `blocks` (found by identity
with the model's leaves as traced) split over the axis on their layer dim (the `stages`
rule), every other leaf as on the mesh without the axis. One row per mesh, its bubble
noted. A mesh without the axis cannot run the step: none is a candidate (the chosen row
says so). Each candidate is traced and compiled with its mesh set (`Placed.mesh_set`),
as `Plan.jit` runs the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from ..._pipeline.stage_major import with_mesh_set
from ..._pipeline.watch import PipelineCall
from ..fsdp import fsdp
from ..rules import as_rule, dotted_path, first
from ..stages import stages as stages_rule
from . import stages as stages_, stages_tp
from .candidate import Candidate, not_compiled
from .candidates import Layout, factorisations, family, mesh_shape, tensor_parallel_roles


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


def _pattern(paths: tuple[str, ...], every: list[str]) -> str:
    """Matches the leaves at `paths`, also behind a prefix (the optimiser state's copies:
    `0.mu.blocks.w`), and none of the model's other leaves (`every`: all their paths)."""
    literal = r"(?:.*\.)?(?:" + "|".join(re.escape(p) for p in paths) + ")"
    clash = [t for t in every if t not in paths and re.fullmatch(literal, t)]
    if clash:
        literal = rf"(?!(?:.*\.)?(?:{'|'.join(re.escape(t) for t in clash)})\Z)" + literal
    return literal


def layouts(model: Any, own: OwnPipeline, n: int, size: int, reach: int):
    """The meshes with the step's stage axis for `n` devices and a batch of `size`, and a
    row for each one left out, saying why."""
    every = [dotted_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    pattern = _pattern(own.paths, every)
    roles = tensor_parallel_roles(model)
    out: list[Layout] = []
    rows: list[Candidate] = []
    m, r = own.microbatches, own.repeats
    for s in range(2, n + 1):
        if n % s:
            continue
        if any(c % (s * r) for c in own.layers) or m < s:
            counts = " and ".join(str(c) for c in own.layers)
            why = f"not compiled: {counts} layers do not split into {s} stages x {r} repeats"
            if m < s:
                why = f"not compiled: the step's {m} microbatches are fewer than {s} stages"
            shape = {own.axis: s} | ({"data": n // s} if n > s else {})
            layout = Layout("PP", shape, None, pipeline=(m, r), stage_axis=own.axis, in_step=True)
            rows.append(not_compiled(layout, why, pipeline=stages_.options(layout)))
            continue
        for sizes in factorisations(n // s):
            rest = {k: v for k, v in mesh_shape(sizes).items() if v > 1}
            split = None
            if sizes[2] != 1:
                split = stages_tp.rule(model, roles, list(own.paths), pattern, own.axis, rest)
                if split is None:
                    continue
            inner = fsdp("fsdp") if "fsdp" in rest else None
            rest_rule = fsdp("fsdp") if "fsdp" in rest else as_rule(P(), "auto_plan")
            rule = first(stages_rule(own.axis, path=pattern, inner=inner), rest_rule)
            rule = rule if split is None else split[0]
            name = "PP" + (f" x {family(rest)}" if rest else "")
            layout = Layout(
                name,
                {own.axis: s} | rest,
                rule,
                stages_.note(s, (m, r)),
                pipeline=(m, r),
                stage_axis=own.axis,
                in_step=True,
            )
            ways = sizes[0] * sizes[1]
            if size % ways == 0 and (size // ways) % m:
                why = (
                    f"not compiled: the {size // ways} rows of a data shard do not split into "
                    f"the step's {m} microbatches"
                )
                rows.append(not_compiled(layout, why, pipeline=stages_.options(layout)))
            elif layout.devices > reach:
                why = (
                    f"not compiled: {layout.devices} devices, over `compile_limit` = {reach} "
                    "(a step that pipelines by itself is not scaled from a smaller mesh)"
                )
                rows.append(not_compiled(layout, why, pipeline=stages_.options(layout)))
            else:
                out.append(layout)
    return out, rows


def why_chosen(table: list[Candidate], links: Any, own: OwnPipeline | None) -> list[Candidate]:
    """`stages.why_chosen` (`links`: by mesh); for a step that pipelines by itself, the
    chosen row says instead why no mesh without its stage axis was weighed."""
    if own is None:
        return stages_.why_chosen(table, links)
    if not table or not table[0].fits:
        return table
    reason = (
        f"{table[0].reason}; the step calls `filter_pipeline` over axis {own.axis!r} itself, "
        f"so only meshes with that axis can run it"
    )
    return [dataclasses.replace(table[0], reason=reason), *table[1:]]
