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

from jax.sharding import PartitionSpec as P

from ...._experts.module import configured
from ...experts import expert_counts, experts
from ...fsdp import fsdp
from ..layout import Layout, batch_spec
from ..measure.cache import ProblemKey
from ..trace.problem import Problem
from .base import Search
from .split_rows import Converting, Split

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


class ExpertParallel(Converting):
    """An `expert` axis for models holding `Experts`: each layer's experts split over it,
    weighed once the other layouts are measured (see the module's docstring)."""

    name = field = "experts"
    axis = AXIS
    options = staticmethod(options)
    split = f"experts split {{size}} ways over `{AXIS}`"
    collective, sending = "all-to-all", "the dispatch's all-to-alls send"

    def splits(self, search: Search) -> list[Split]:
        counts = expert_counts(search.traced.problem.model)
        if not counts:
            return []
        traced = search.traced
        problem = converted(traced.problem)
        key = ProblemKey((traced.problem_key.key, AXIS))
        # The batch over every axis: outside the experts, the `expert` devices run the
        # model data-parallel.
        return [
            Split(layout, why, problem, key, batch_spec(layout.shape))
            for layout, why in layouts(traced.devices, counts, traced.batch_size)
            if not any(axis in traced.exclude for axis in layout.shape)  # `exclude=("fsdp",)`
        ]
