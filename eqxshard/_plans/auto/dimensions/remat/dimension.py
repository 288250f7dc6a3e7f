"""The remat dimension: a remat policy for the model's `Stacked` layers, weighed on the
measured layouts over budget by their activations (`policies`), each stack's saving read
from the step's jaxpr (`residuals`), and some stacks only where that is enough
(`per_stack`)."""

from __future__ import annotations

from typing import Any

from ...candidate import Candidate
from ...layout import Layout
from ...measure import batch_proxies
from ..base import Dimension, Measured, Search
from ..offload import after_remat, supported
from . import per_stack, policies
from .policies import Variant
from .residuals import RematTrace


class Remat(Dimension):
    """Remat proposes nothing of its own: it refines the measured rows over budget (a
    variant per policy, `policies.FIRST` then `policies.THEN`), and offers the variants
    still over budget the optimiser state in host memory (`offload.after_remat`)."""

    name = "remat"

    def choices(self, layout: Layout) -> dict[str, Any]:
        return {"remat": dict(layout.remat)}

    def refine(self, search: Search) -> Measured:
        traced, measured = search.traced, search.measured
        if not traced.stacks:
            return measured
        paths = list(traced.stacks)
        pending = [(job.layout, c) for job, c in measured.measured_rows()]
        rows = list(measured.rows)
        stacks = RematTrace(traced.problem.step, traced.trace_args, traced.tracing)
        # Offload follows remat only where the search weighs offload at all.
        can_offload = supported(traced.available) and any(
            d.name == "offload" for d in search.dimensions
        )

        def compiled(todo: list[Variant]) -> list[tuple[Layout, Candidate]]:
            """Each variant in `todo` compiled, with its row saying what it chose."""
            jobs = [search.lay_out(v) for v, _, _ in todo]
            search.compile(jobs)
            made = []
            for job, (v, _, base) in zip(jobs, todo, strict=True):
                # A pipeline's compute is the model's flops, times what the remat adds.
                first = search.row(job, stacks.recomputed(v.remat, ()) if v.pipeline else 1.0)
                apart = getattr(batch_proxies.measured(job), "host_temp", 0)
                said = policies.described(
                    first,
                    v,
                    base,
                    stacks,
                    budget=traced.budget,
                    links=traced.axis_links(v.shape),
                    apart=apart,
                )
                made.append((v, said))
            return made

        tried: list[tuple[Layout, Layout, Candidate, Candidate]] = []
        for wanted in (policies.FIRST, policies.THEN):
            if not can_offload:
                wanted = tuple(p for p in wanted if p != "offload")
            best = min((c.time for c in rows if c.fits and c.time), default=None)
            todo, pruned = policies.worth(pending, paths, wanted, best)
            for v, c in pruned:
                rows.append(search.with_choices(policies.dominated(v, c, best or 0.0), v))
            todo, same = policies.saving(todo, stacks)  # no fewer bytes than the model's own
            rows += [search.with_choices(r, v) for v, _, _, r in same]
            # Where every stack rematerialised fits, the fewest stacks that would, alone.
            mixes, made = per_stack.mixes(todo, compiled(todo), stacks, traced.budget)
            made += compiled(mixes)
            rows += [c for _, c in made]
            tried += [(v, b, c, r) for (v, b, c), (_, r) in zip(todo + mixes, made, strict=True)]
            pending = [
                (b, c)
                for (v, b, c), (_, r) in zip(todo, made, strict=False)
                if not r.fits and policies.policy_of(v) in policies.FIRST
            ] + [(b, c) for v, b, c, _ in same if policies.policy_of(v) in policies.FIRST]
            pending = list({id(b): (b, c) for b, c in pending}.values())
        if traced.problem.trains and can_offload:
            # Rematerialised and still over, but not by more than the optimiser state: that
            # in host memory too (dominated when its trips alone make it slower).
            best = min((c.time for c in rows if c.fits and c.time), default=None)
            both, slow = after_remat(tried, best=best, traced=traced)
            rows += [search.with_choices(c, v) for v, c in slow]
            rows += [c for _, c in compiled(both)]
        return Measured(measured.jobs, tuple(rows))
