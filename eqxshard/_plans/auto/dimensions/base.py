"""What a parallelism dimension is to the search, and the records the phases pass.

A dimension (data/fsdp/tensor layouts, a pipeline's stage axis, remat, offload; sequence
or experts next) is one module with one `Dimension` subclass, registered once in
`registry.DIMENSIONS`. The search asks each, in the registry's order:

- `propose`: the layouts it adds for a traced problem (compiled in the measure phase),
  the rows of those it leaves out (each saying why), and those it leaves to the scale
  phase (over `compile_limit`);
- `cost`: a measured row with its cost read by the dimension's own model (a pipeline's
  compute over `1 - bubble`), before any ranking;
- `choices`: how a plan applies it: the `Candidate` (and so `Plan`) fields it sets from
  a layout (`pipeline`, `remat`);
- `scale`: rows for the layouts it left to the scale phase, once the others are measured;
- `explain`: what the chosen row says of this dimension, once the table is ranked;
- `refine`: rows for variants of measured layouts (offload, remat). Remat and offload
  propose nothing of their own: they only refine layouts already measured (remat those
  over budget by their activations, offload those over by their optimiser state), so
  their work is all here.

Each hook has a default that does nothing, so a dimension overrides what it needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..candidate import Candidate
from ..layout import Layout
from ..measure import batch_proxies, jobs
from ..measure.jobs import Job
from ..rank.row import from_measurement
from ..trace.phase import Traced


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What the dimensions propose: layouts to compile, rows of layouts left out, and
    layouts left to the scale phase (more devices than `compile_limit`)."""

    layouts: tuple[Layout, ...] = ()
    left_out: tuple[Candidate, ...] = ()
    above_limit: tuple[Layout, ...] = ()

    def __add__(self, other: Proposal) -> Proposal:
        return Proposal(
            self.layouts + other.layouts,
            self.left_out + other.left_out,
            self.above_limit + other.above_limit,
        )


@dataclasses.dataclass(frozen=True)
class Measured:
    """The search so far: each compiled layout's job, and every row; the first
    `len(jobs)` rows are the jobs' own, in order."""

    jobs: tuple[Job, ...]
    rows: tuple[Candidate, ...]

    def plus(self, jobs: Any = (), rows: Any = ()) -> Measured:
        """More rows (and the jobs of the first of them, while every row so far is a
        job's: compiled layouts come before the rows of layouts left out)."""
        assert not jobs or len(self.jobs) == len(self.rows), "jobs after rows of no job"
        return Measured(self.jobs + tuple(jobs), self.rows + tuple(rows))

    def measured_rows(self) -> list[tuple[Job, Candidate]]:
        """Each compiled job with its row."""
        return list(zip(self.jobs, self.rows, strict=False))


class Dimension:
    """One parallelism dimension of the search (see the module's docstring). `name` is
    what tests and messages call it."""

    name: str = ""

    def propose(self, traced: Traced) -> Proposal:
        return Proposal()

    def cost(self, c: Candidate, layout: Layout, traced: Traced, recompute: float) -> Candidate:
        """`c` (a compiled row of `layout`) with its cost read by this dimension's model;
        `recompute`: the step's matmul flops over those without remat."""
        return c

    def choices(self, layout: Layout) -> dict[str, Any]:
        """The `Candidate` fields this dimension sets from `layout`."""
        return {}

    def scale(self, search: Search, left: Proposal) -> tuple[Measured, Proposal]:
        """The rows of the layouts of `left.above_limit` this dimension proposed, and
        `left` with those it settles removed and its `left_out` rows updated."""
        return search.measured, left

    def refine(self, search: Search) -> Measured:
        """More rows: variants of the measured layouts."""
        return search.measured

    def explain(self, table: list[Candidate], traced: Traced) -> list[Candidate]:
        """The ranked table, the chosen row saying more where this dimension chose it."""
        return table


@dataclasses.dataclass(frozen=True)
class Search:
    """What a dimension's `scale` and `refine` may use: the problem traced, the
    dimensions (for a row's choices), the rows so far, and compiles of more layouts."""

    traced: Traced
    dimensions: tuple[Dimension, ...]
    measured: Measured

    def with_choices(self, c: Candidate, layout: Layout) -> Candidate:
        """`c` carrying every dimension's choices for `layout` (for `Plan`)."""
        fields: dict[str, Any] = {}
        for d in self.dimensions:
            fields |= d.choices(layout)
        return dataclasses.replace(c, **fields)

    def lay_out(self, layout: Layout) -> Job:
        """`layout` laid out on its mesh, and on the mesh it is compiled on."""
        t = self.traced
        return jobs.laid_out(
            t.problem,
            layout,
            size=t.batch_size,
            reach=t.reach,
            available=t.available,
            budget=t.budget,
        )

    def compile(self, todo: list[Job], *, grouped: bool = False) -> None:
        """Compiles the jobs not in the cache (`grouped`: each group of jobs that differ
        only in the batch through two compiles, `batch_proxies`)."""
        t = self.traced
        run = batch_proxies.measure if grouped else jobs.measure_all
        run(t.problem, t.problem_key, todo, local=t.local, progress=t.progress)

    def row(self, job: Job, recompute: float = 1.0) -> Candidate:
        """The row of a compiled job, costed by every dimension and carrying its choices."""
        t = self.traced
        c = from_measurement(
            job.layout,
            exact=job.exact,
            rejected=job.rejected,
            measured=batch_proxies.measured(job),
            small=None if job.small is None or job.placed is None else (job.small, job.placed),
            where=job.where,
            budget=t.budget,
            links=t.axis_links(job.layout.shape),
            flops_per_second=t.flops_per_second / t.loops,
            host=job.host,
        )
        for d in self.dimensions:
            c = d.cost(c, job.layout, t, recompute)
        return self.with_choices(c, job.layout)
