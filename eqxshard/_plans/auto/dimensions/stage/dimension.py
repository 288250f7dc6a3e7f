"""The pipeline dimension: a stage axis over the model's `Stacked` layers (`schedule`,
tensor parallel inside a stage: `tensor_parallel`), or the step's own stage axis where
it calls `filter_pipeline` itself (`in_step`); stage meshes above `compile_limit` weighed
once the others are measured (`scaled`)."""

from __future__ import annotations

from typing import Any

from ...candidate import Candidate
from ...layout import Layout
from ...trace.phase import Traced
from ..base import Dimension, Measured, Proposal, Search
from . import in_step, scaled, schedule


class Stage(Dimension):
    """A `stage` axis, its schedule chosen by arithmetic (the bubble and the permutes)."""

    name = "stage"

    def propose(self, traced: Traced) -> Proposal:
        n, model, own = traced.devices, traced.problem.model, traced.own
        if own is not None:  # only meshes with the step's own stage axis can run it
            piped, left_out = in_step.layouts(model, own, n, traced.batch_size, traced.reach)
            return Proposal(layouts=tuple(piped), left_out=tuple(left_out))
        link = traced.axis_links({schedule.AXIS: n})[schedule.AXIS]
        piped, left_out = schedule.layouts(
            model,
            n,
            size=traced.batch_size,
            flops=traced.flops,
            flops_per_second=traced.flops_per_second,
            link=link,
        )
        if n <= traced.reach:
            return Proposal(layouts=tuple(piped), left_out=tuple(left_out))
        # Compiled once the others are ranked, on a smaller stage mesh (the scale phase).
        later, too_large = scaled.compilable(piped, traced.reach)
        return Proposal(
            left_out=tuple(scaled.instead(left_out, too_large)), above_limit=tuple(later)
        )

    def cost(self, c: Candidate, layout: Layout, traced: Traced, recompute: float) -> Candidate:
        return schedule.timed(
            c,
            layout,
            flops=traced.flops,
            n=traced.devices,
            fps=traced.flops_per_second,
            recompute=recompute,
        )

    def choices(self, layout: Layout) -> dict[str, Any]:
        return {"pipeline": schedule.options(layout)}

    def scale(self, search: Search, left: Proposal) -> tuple[Measured, Proposal]:
        mine = [v for v in left.above_limit if v.pipeline is not None]
        if not mine:
            return search.measured, left
        traced, measured = search.traced, search.measured
        fitting = (c for c in measured.rows if c.fits)
        fastest = min(fitting, key=lambda c: c.time or 0, default=None)
        best = None if fastest is None else fastest.time or 0
        like = None if fastest is None else fastest.mesh_shape
        todo, unlike = scaled.like_fastest(mine, like)
        placed = [search.lay_out(v) for v in todo]
        by_mesh = {repr(v.shape): traced.axis_links(v.shape) for v in todo}
        more, dominated = scaled.worth(
            placed,
            best=best,
            flops=traced.flops,
            n=traced.devices,
            flops_per_second=traced.flops_per_second,
            links=by_mesh,
        )
        search.compile(more, grouped=True)
        measured = measured.plus(more, [search.row(job) for job in more])
        left_out = scaled.instead(list(left.left_out), dominated + unlike)
        rest = tuple(v for v in left.above_limit if v.pipeline is None)
        return measured, Proposal(left.layouts, tuple(left_out), rest)

    def explain(self, table: list[Candidate], traced: Traced) -> list[Candidate]:
        by_mesh = {repr(c.mesh_shape): traced.axis_links(c.mesh_shape) for c in table}
        return in_step.why_chosen(table, by_mesh, traced.own)
