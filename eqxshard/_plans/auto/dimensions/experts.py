"""The experts dimension: an `expert` mesh axis for models holding `eqxshard.Experts`, each
layer's experts laid out over it (expert parallelism), the tokens dispatched to them by
`moe`.

The search traces the model with its `Experts` unsplit (`axis=None`, what every other
layout runs). This dimension refines: once those layouts are measured, each mesh with an
`expert` axis (`expert` alone, `data x expert`, `fsdp x expert`) is compiled with the
`Experts` set to that axis (found on the mesh set while the step traces), the `experts`
rule before the layout's own (`experts("expert") | P()`, or with `fsdp` also over each
expert's other dims: `experts("expert", inner=fsdp("fsdp")) | fsdp("fsdp")`), and the
batch split over every axis (outside the experts, the `expert` devices run the model
data-parallel). Each row says what the split saves against the smallest unsplit row and
what the dispatch's all-to-alls send. The chosen row's `experts` (`{"axis": "expert"}`)
is what `Plan.apply` sets the `Experts` to. Meshes above `compile_limit` are not weighed
(their rows say so).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

from ...._experts.module import configured
from ...._tree import format_bytes
from ...experts import expert_counts, experts
from ...fsdp import fsdp
from ..candidate import Candidate, not_compiled
from ..layout import Layout, batch_spec
from ..measure import jobs
from ..measure.cache import ProblemKey
from ..measure.compiled import step_arguments
from ..meshes import mesh_for
from ..trace.problem import Problem
from ..view import mesh_str
from .base import Dimension, Measured, Search

AXIS = "expert"


def options(shape: dict[str, int]) -> dict[str, str] | None:
    """A plan's `experts` for a mesh of `shape`: the axis `Plan.apply` sets the `Experts` to."""
    return {"axis": AXIS} if shape.get(AXIS, 1) > 1 else None


def layouts(devices: int, counts: set[int], batch: int) -> list[tuple[Layout, str]]:
    """The layouts with an `expert` axis of each size that divides the devices and every
    layer's number of experts, each with why it cannot run (`""` where it can)."""
    out = []
    for size in range(2, devices + 1):
        if devices % size or any(n % size for n in counts):
            continue
        rest = devices // size
        if rest == 1:
            out.append(Layout("EP", {AXIS: size}, experts(AXIS) | P()))
        else:
            out.append(Layout("DP x EP", {"data": rest, AXIS: size}, experts(AXIS) | P()))
            rule = experts(AXIS, inner=fsdp("fsdp")) | fsdp("fsdp")
            out.append(Layout("FSDP x EP", {"fsdp": rest, AXIS: size}, rule))
    why = f"the batch of {batch} does not split over {devices} devices"
    return [(layout, "" if batch % devices == 0 else why) for layout in out]


def converted(problem: Problem) -> Problem:
    """`problem` with the `Experts` of the model and the optimiser state laid out over
    `expert` (on the mesh set while the step traces)."""
    model = configured(problem.model, axis=AXIS, mesh=None)
    state = configured(problem.opt_state, axis=AXIS, mesh=None)
    return dataclasses.replace(problem, model=model, opt_state=state)


def _described(c: Candidate, unsplit: Candidate | None) -> Candidate:
    """`c` saying what the split saves and what the dispatch sends."""
    said = f"experts split {c.mesh_shape[AXIS]} ways over `{AXIS}`"
    if c.total_bytes is not None and unsplit is not None and unsplit.total_bytes is not None:
        saved = unsplit.total_bytes - c.total_bytes
        where = f"{unsplit.name} on {mesh_str(unsplit.mesh_shape)}"
        said += (
            f": {format_bytes(abs(saved))} per device {'less' if saved >= 0 else 'more'} "
            f"than the smallest unsplit layout ({where})"
        )
    if c.time is not None:
        sent = c.collectives.get("all-to-all", 0)
        said += f"; the dispatch's all-to-alls send {format_bytes(sent)} per device"
        total = sum(c.collectives.values())
        if total > sent:
            said += f" ({format_bytes(total)} with the other collectives)"
    return dataclasses.replace(c, reason=f"{c.reason}; {said}" if c.reason else said)


class ExpertParallel(Dimension):
    """An `expert` axis for models holding `Experts`: each layer's experts split over it,
    weighed once the other layouts are measured (see the module's docstring)."""

    name = "experts"

    def choices(self, layout: Layout) -> dict[str, Any]:
        return {"experts": options(layout.shape)}

    def refine(self, search: Search) -> Measured:
        traced, measured = search.traced, search.measured
        counts = expert_counts(traced.problem.model)
        if traced.own is not None or not counts:
            return measured
        problem = converted(traced.problem)
        # Its own key (the converted model's step), kept in memory only: the disk cache's
        # entries are named by the unconverted step's jaxpr.
        problem_key = ProblemKey((traced.problem_key.key, AXIS))
        todo, left_out = [], []
        for layout, why in layouts(traced.devices, counts, traced.batch_size):
            if any(axis in traced.exclude for axis in layout.shape):  # `exclude=("fsdp",)`
                continue
            if traced.devices > traced.reach:
                why = f"not weighed: more devices than `compile_limit` ({traced.reach})"
            if why:
                left_out.append(search.with_choices(not_compiled(layout, why), layout))
            else:
                todo.append(_laid_out(search, problem, layout))
        compile_ = [job for job in todo if job.placed is not None]
        jobs.measure_all(
            problem, problem_key, compile_, local=traced.local, progress=traced.progress
        )
        # The rows to compare with: layouts as compiled, not their offload or remat variants.
        unsplit = [
            c
            for c in measured.rows
            if c.total_bytes is not None and c.time is not None and not (c.offload or c.remat)
        ]
        smallest = min(unsplit, key=lambda c: c.total_bytes or 0, default=None)
        rows = [_described(search.row(job), smallest) for job in todo]
        return Measured(measured.jobs, measured.rows + tuple(rows + left_out))


def _laid_out(search: Search, problem: Problem, layout: Layout) -> jobs.Job:
    """`layout` laid out with the `Experts` over `expert`, the batch over every axis, and
    the mesh set while the step traces (the `Experts` find it there)."""
    traced = search.traced
    mesh = mesh_for(layout.shape, traced.available)
    try:
        spec = batch_spec(layout.shape)
        placed = step_arguments(problem, mesh, layout.rules, problem.batch, spec)
    except (ValueError, TypeError) as e:
        return jobs.Job(layout, {}, rejected=" ".join(str(e).split())[:300])
    placed = dataclasses.replace(placed, mesh_set=mesh)
    exact = {"parameters": placed.parameters}
    if problem.trains:
        exact |= {"gradients": placed.gradients, "optimizer state": placed.opt_state}
    exact["batch"] = placed.batch
    return jobs.Job(layout, exact, dict(layout.shape), placed)
