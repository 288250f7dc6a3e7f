"""The rank phase: every row ranked into the table, the chosen one's reasons said by the
dimensions that chose it, and the `Plan` of the first row."""

from __future__ import annotations

from ...experts import expert_counts
from ...pipeline_choice import of_options
from ..dimensions.base import Search
from ..dimensions.context import sequence_spec
from ..meshes import mesh_for
from ..result import Plan
from .table import nothing_fits, ranked


def rank(search: Search) -> Plan:
    """The plan of the fastest row that fits; raises when none fits."""
    traced = search.traced
    table = ranked(list(search.measured.rows), traced.budget)
    if not table[0].fits:
        raise nothing_fits(table, traced.budget, traced.devices, traced.batch_size)
    for dimension in search.dimensions:
        table = dimension.explain(table, traced)
    chosen = table[0]
    experts: dict[str, str | None] | None = dict(chosen.experts) if chosen.experts else None
    if experts is None and expert_counts(traced.problem.model):
        experts = {"axis": None}  # as the trace phase set them: each layout measured so
    return Plan(
        mesh=mesh_for(chosen.mesh_shape, traced.available),
        rules=chosen.rules,
        batch_spec=sequence_spec(chosen.mesh_shape),
        table=table,
        budget=traced.budget,
        offload=chosen.offload,
        remat=chosen.remat,
        pipeline=of_options(chosen.pipeline),
        context=chosen.context,
        experts=experts,
    )
