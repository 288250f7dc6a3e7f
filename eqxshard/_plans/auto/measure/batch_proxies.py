"""Fewer compiles for candidates that share a compiled mesh and differ only in the batch.

A mesh too large to compile here is estimated from a smaller one with the same batch per
device (`extrapolate`), so many candidates land on the same small mesh, each with its own
batch: on 512 devices every `data x model=m` mesh shrinks to `model=8` with `m`
sequences per device (7 compiles for the 7B decoder). A step's figures are affine in its
batch: flops and the activations' collectives grow with it, the parameters' and
gradients' do not, and so do the bytes of its buffers (the batch and activations grow,
the rest stays). So of each such group only the two smallest batches are compiled, and
the others' figures are drawn through them, marked as estimates. An estimate that lands
near the budget or near the fastest step found is compiled after all (`settle`), so that
the affine line decides only the clear cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ...._caches import register
from ...._tree import is_array_like
from ..result import Candidate
from ..trace.problem import Problem
from .cache import CACHE
from .compiled import Measurement
from .jobs import Job, assign_keys, measure_all

# Figures drawn through two compiles, per job key; never mistaken for a compile.
ESTIMATES: dict[Any, tuple[Measurement, str]] = {}
register(ESTIMATES.clear)

# An estimate within this fraction of the budget, or of the fastest step, is compiled.
MARGIN = 0.1


def _batch(job: Job) -> int:
    assert job.placed is not None
    leaves = [x for x in jax.tree.leaves(job.placed.args[2]) if is_array_like(x)]
    return int(leaves[0].shape[0]) if leaves and leaves[0].shape else 0


def _line(a: float, b: float, x0: int, x1: int, x: int) -> float:
    return a + (b - a) * (x - x0) / (x1 - x0)


def affine(m0: Measurement, b0: int, m1: Measurement, b1: int, b: int) -> Measurement | None:
    """The figures at batch `b` on the line through those at `b0` and `b1`; None when the
    two compiles differ in kind (other collectives, other ops pinned to one device)."""
    same = [(c.kind, c.axes, c.group_size, c.count) for c in m0.collectives] == [
        (c.kind, c.axes, c.group_size, c.count) for c in m1.collectives
    ]
    if not same or m0.pinned != m1.pinned or m0.memory.keys() != m1.memory.keys():
        return None
    memory = {
        k: max(int(round(_line(m0.memory[k], m1.memory[k], b0, b1, b))), 0) for k in m0.memory
    }
    found = tuple(
        dataclasses.replace(c, bytes=max(int(round(_line(c.bytes, d.bytes, b0, b1, b))), 0))
        for c, d in zip(m0.collectives, m1.collectives, strict=True)
    )
    flops = max(_line(m0.flops, m1.flops, b0, b1, b), 0.0)
    host = max(int(round(_line(m0.host, m1.host, b0, b1, b))), 0)
    temp = max(int(round(_line(m0.host_temp, m1.host_temp, b0, b1, b))), 0)
    return Measurement(memory, flops, found, m1.pinned, host, temp)


def measured(job: Job) -> Measurement | None:
    """A job's figures: its compile's, else those drawn through two compiles."""
    if job.key is None:
        return None
    if job.key in CACHE:
        return CACHE[job.key]
    drawn = ESTIMATES.get(job.key)
    return None if drawn is None else drawn[0]


def measure(
    problem: Problem,
    problem_key: Any,
    work: list[Job],
    *,
    local: int,
    progress: bool | None,
) -> None:
    """Compiles each group's two smallest batches (and every job without a group), and
    draws the rest of each group through them."""
    assign_keys(problem_key, work, local)
    groups: dict[Any, dict[int, list[Job]]] = {}
    for job in work:
        if job.key is not None and job.small is not None:
            groups.setdefault(job.key[:-1], {}).setdefault(_batch(job), []).append(job)
    drawn: list[Job] = []
    for by_batch in groups.values():
        if len(by_batch) < 3:
            continue
        sizes = sorted(by_batch)
        drawn += [j for b in sizes[2:] for j in by_batch[b] if j.key not in CACHE]
    first = [j for j in work if j not in drawn]
    measure_all(problem, problem_key, first, local=local, progress=progress)
    for by_batch in groups.values():
        sizes = sorted(by_batch)
        if len(sizes) < 3:
            continue
        b0, b1 = sizes[:2]
        m0, m1 = CACHE[by_batch[b0][0].key], CACHE[by_batch[b1][0].key]
        for b in sizes[2:]:
            for job in by_batch[b]:
                if job.key in CACHE:
                    continue
                line = affine(m0, b0, m1, b1, b)
                if line is None:  # the compiles differ in kind: compile this one too
                    measure_all(problem, problem_key, [job], local=local, progress=progress)
                    continue
                ESTIMATES[job.key] = (line, f"batch {b} drawn through compiles of {b0} and {b1}")
                job.where = ESTIMATES[job.key][1]


def settle(
    problem: Problem,
    problem_key: Any,
    work: list[Job],
    *,
    local: int,
    progress: bool | None,
    row: Callable[[Job], Candidate],
    budget: int,
) -> None:
    """Compiles every drawn estimate that lands within `MARGIN` of the budget, or of the
    fastest step of a layout that fits, until none does."""
    while True:
        rows = {id(job): row(job) for job in work}
        best = min((r.time or 0.0 for r in rows.values() if r.fits), default=None)
        close = []
        for job in work:
            if job.key is None or job.key in CACHE or job.key not in ESTIMATES:
                continue
            r = rows[id(job)]
            near_budget = abs((r.total_bytes or 0) - budget) <= MARGIN * budget
            near_best = best is not None and (r.time or 0.0) <= (1 + MARGIN) * best
            if near_budget or near_best or best is None:
                close.append(job)
        if not close:
            return
        for job in close:
            ESTIMATES.pop(job.key, None)
            job.where = ""
        measure_all(problem, problem_key, close, local=local, progress=progress)
