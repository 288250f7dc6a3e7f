"""The dimensions that split a mesh axis by converting the model's own layers (context:
its attention; experts: its `Experts`), as one `Converting` process.

Once the other layouts are measured, such a dimension names its `Split`s: each layout
with its axis, the problem with the model converted for it (and that problem's cache
key), how every batch leaf is laid out, or why it cannot run. `Converting.refine`
compiles those that can (the mesh set while the step traces: the converted layers find
it there; meshes above `compile_limit` are rows saying so), and each row says what the
split saves against the smallest unsplit row and what its collectives send.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec as P

from ...._tree import format_bytes
from ..candidate import Candidate, not_compiled
from ..layout import Layout
from ..measure import jobs
from ..measure.cache import ProblemKey
from ..measure.compiled import step_arguments
from ..meshes import mesh_for
from ..trace.problem import Problem
from ..view import mesh_str
from .base import Dimension, Measured, Search


def laid_out(search: Search, problem: Problem, layout: Layout, spec: P) -> jobs.Job:
    """`layout` laid out for `problem` (its model converted; its `Stacked` pipelined as
    the layout says), every batch leaf by `spec`, and the mesh set while the step traces;
    a rejected job where it cannot be."""
    mesh = mesh_for(layout.shape, search.traced.available)
    try:
        placed = step_arguments(
            problem, mesh, layout.rules, problem.batch, spec, pipeline=layout.pipeline
        )
    except (ValueError, TypeError) as e:
        return jobs.Job(layout, {}, rejected=" ".join(str(e).split())[:300])
    placed = dataclasses.replace(placed, mesh_set=mesh)
    exact = {"parameters": placed.parameters}
    if problem.trains:
        exact |= {"gradients": placed.gradients, "optimizer state": placed.opt_state}
    exact["batch"] = placed.batch
    return jobs.Job(layout, exact, dict(layout.shape), placed)


def smallest_unsplit(rows: Sequence[Candidate]) -> Candidate | None:
    """The measured row of fewest bytes per device among the layouts as compiled (not
    their offload or remat variants): what a split is compared with."""
    unsplit = [
        c
        for c in rows
        if c.total_bytes is not None and c.time is not None and not (c.offload or c.remat)
    ]
    return min(unsplit, key=lambda c: c.total_bytes or 0, default=None)


def described(
    c: Candidate, unsplit: Candidate | None, split: str, collective: str, sending: str
) -> Candidate:
    """`c` saying `split` (what is split, how many ways), what that saves against
    `unsplit`, and (`sending`) how many bytes per device its `collective` sends."""
    said = split
    if c.total_bytes is not None and unsplit is not None and unsplit.total_bytes is not None:
        saved = unsplit.total_bytes - c.total_bytes
        where = f"{unsplit.name} on {mesh_str(unsplit.mesh_shape)}"
        said += (
            f": {format_bytes(abs(saved))} per device {'less' if saved >= 0 else 'more'} "
            f"than the smallest unsplit layout ({where})"
        )
    if c.time is not None:
        sent = c.collectives.get(collective, 0)
        said += f"; {sending} {format_bytes(sent)} per device"
        total = sum(c.collectives.values())
        if total > sent:
            said += f" ({format_bytes(total)} with the other collectives)"
    return dataclasses.replace(c, reason=f"{c.reason}; {said}" if c.reason else said)


@dataclasses.dataclass(frozen=True)
class Split:
    """A layout a `Converting` dimension weighs: `why` it cannot run (`""` where it can),
    else the `problem` with the model converted for it, that problem's cache `key` (kept
    in memory only: the disk cache's entries are named by the unconverted step's jaxpr)
    and the `spec` of every batch leaf."""

    layout: Layout
    why: str = ""
    problem: Problem | None = None
    key: ProblemKey | None = None
    spec: P = P()


class Converting(Dimension):
    """A dimension whose axis splits the model's own layers, converted (see the module's
    docstring): it names its `splits`; the plan field `field` is set to its `options` of
    a layout's mesh; a row says `split` (formatted with the `size` of its `axis`), and how many
    bytes the `collective` (its HLO name) sends, in the words of `sending`."""

    field: str = ""
    axis: str = ""
    split: str = ""
    collective: str = ""
    sending: str = ""

    @staticmethod
    def options(shape: dict[str, int]) -> dict[str, Any] | None:
        """The plan's `field` for a mesh of `shape` (`None` without this axis)."""
        raise NotImplementedError

    def splits(self, search: Search) -> list[Split]:
        """The layouts to weigh, once the others are measured (none: not this model;
        not asked for a step that pipelines itself)."""
        raise NotImplementedError

    def choices(self, layout: Layout) -> dict[str, Any]:
        return {self.field: self.options(layout.shape)}

    def refine(self, search: Search) -> Measured:
        traced, measured = search.traced, search.measured
        if traced.own is not None:  # a step that pipelines itself: its own stage axis only
            return measured
        todo: dict[ProblemKey, list[jobs.Job]] = {}
        problems: dict[ProblemKey, Problem] = {}
        left_out = []
        for split in self.splits(search):
            why = split.why
            if split.problem is not None and traced.devices > traced.reach:
                why = f"not weighed: more devices than `compile_limit` ({traced.reach})"
            if why or split.problem is None or split.key is None:
                row = not_compiled(split.layout, why)
                left_out.append(search.with_choices(row, split.layout))
                continue
            problems[split.key] = split.problem
            job = laid_out(search, split.problem, split.layout, split.spec)
            todo.setdefault(split.key, []).append(job)
        for key, group in todo.items():
            compile_ = [job for job in group if job.placed is not None]
            jobs.measure_all(
                problems[key], key, compile_, local=traced.local, progress=traced.progress
            )
        smallest = smallest_unsplit(measured.rows)
        rows = [
            described(
                search.row(job),
                smallest,
                self.split.format(size=job.layout.shape[self.axis]),
                self.collective,
                self.sending,
            )
            for group in todo.values()
            for job in group
        ]
        return Measured(measured.jobs, measured.rows + tuple(rows + left_out))
