"""`auto_plan`'s candidates between choosing and ranking: each laid out on its mesh (the
exact bytes of the parts known without compiling, or why it is rejected before any
compile), then compiled here or in a subprocess, results cached."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import tqdm

from ...._tree import is_array_like
from ..layout import Layout, batch_axes, batch_spec
from ..meshes import mesh_for
from ..scale import extrapolate
from ..trace.arguments import over_budget
from ..trace.problem import Problem
from ..view import mesh_str
from . import compile_remote
from .cache import CACHE, ProblemKey, hashable, shapes_key
from .compiled import Measurement, Placed, compile_here, step_arguments


def _resize_batch(batch: Any, size: int) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype) if is_array_like(x) else x,
        batch,
        is_leaf=is_array_like,
    )


def _largest_inexact(tree: Any) -> int:
    """Bytes on one device of the largest floating-point leaf of a laid-out tree."""
    sizes = [
        math.prod(x.sharding.shard_shape(tuple(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return max(sizes, default=0)


@dataclasses.dataclass
class Job:
    """A candidate between placing and measuring: its exact parts, the mesh it is
    compiled on and its arguments there (`small` when that mesh is a smaller one)."""

    layout: Layout
    exact: dict[str, int]
    compile_shape: dict[str, int] | None = None
    placed: Placed | None = None
    small: dict[str, int] | None = None
    key: Any = None
    rejected: str = ""
    where: str = ""
    host: int = 0  # bytes per device of the optimiser state in host memory (offload)
    entry: Any = None  # its file in the disk cache (`cache.Disk`), if there is one


def laid_out(
    problem: Problem,
    layout: Layout,
    *,
    size: int,
    reach: int,
    available: list[Any],
    budget: int,
) -> Job:
    """Lays the candidate out on its mesh (exact bytes of the known parts), and on the
    mesh it will be compiled on: itself, or a smaller one when it has more than `reach`
    devices."""
    shape = layout.shape
    axes = batch_axes(shape)
    ways = math.prod(shape[a] for a in axes)
    if size % ways:
        why = f"the batch of {size} does not split over {ways} devices ({' x '.join(axes)})"
        return Job(layout, {}, rejected=why)
    try:
        mesh = mesh_for(shape, available)
        big = step_arguments(
            problem,
            mesh,
            layout.rules,
            problem.batch,
            batch_spec(shape),
            layout.offload,
            layout.remat,
            layout.pipeline,
            layout.in_step,
        )
    except (ValueError, TypeError) as e:
        return Job(layout, {}, rejected=" ".join(str(e).split())[:300])
    exact = {"parameters": big.parameters}
    host = big.opt_state if layout.offload else 0
    if problem.trains:
        exact |= {"gradients": big.gradients, "optimizer state": big.opt_state - host}
    exact["batch"] = big.batch
    kept = sum(exact.values())
    if problem.trains:
        # The step keeps its arguments (the new model and state reuse their buffers) but
        # not every gradient at once: XLA updates each leaf as soon as its gradient is
        # out. What it surely holds is one gradient, the largest, beside the arguments.
        kept += _largest_inexact(big.args[0]) - exact["gradients"]
    if kept > budget:
        why = (
            f"{over_budget(kept, budget)} before activations (parameters, optimiser "
            "state, batch and the largest gradient)"
        )
        return Job(layout, exact, rejected=why, host=host)
    if layout.devices <= reach:
        return Job(layout, exact, shape, big, host=host)
    small = extrapolate.reduced_shape(shape, reach)
    small_ways = math.prod(small[a] for a in batch_axes(small))
    batch = _resize_batch(problem.batch, size // ways * small_ways)
    placed = step_arguments(
        problem,
        mesh_for(small, available),
        layout.rules,
        batch,
        batch_spec(small),
        layout.offload,
        layout.remat,
        layout.pipeline,
        layout.in_step,
    )
    return Job(layout, exact, small, placed, small=small, host=host)


def _layout_text(args: Any) -> str:
    """Each argument leaf's shape, dtype, spec and memory kind: what a compile is given."""
    return repr(
        [
            (tuple(x.shape), str(x.dtype), repr(x.sharding.spec), x.sharding.memory_kind)
            for x in jax.tree.leaves(args)
        ]
    )


def assign_keys(problem_key: ProblemKey, jobs: list[Job], local: int) -> None:
    """Gives each job to compile its cache key (the batch's shapes last), its entry in the
    disk cache (what is there read into `CACHE`), and where it is compiled."""
    for job in jobs:
        if job.compile_shape is None or job.placed is None:
            continue
        user = hashable(job.layout.rules) if job.layout.name.startswith("rules") else None
        # A size-1 axis changes nothing in the compiled program: `data=1 x fsdp=2 x
        # model=4` (a DP x FSDP x TP mesh shrunk) is the FSDP x TP mesh `fsdp=2 x
        # model=4`, compiled once for both (a third of the 7B search's compiles).
        shape = tuple((a, s) for a, s in job.compile_shape.items() if s > 1)
        job.key = (
            problem_key,
            shape,
            repr(job.layout.rules),
            user,
            job.layout.offload,
            job.layout.remat,
            job.layout.pipeline,
            shapes_key(job.placed.args[2]),
        )
        disk = problem_key.disk
        if disk is not None:
            choices = (job.layout.offload, job.layout.remat, job.layout.pipeline)
            placed = (job.placed.remat, repr(job.placed.mesh_set))
            parts = (shape, repr(job.layout.rules), choices, placed, _layout_text(job.placed.args))
            job.entry = disk.path(parts)
            if job.key not in CACHE:
                found = disk.load(job.entry)
                if found is not None:
                    CACHE[job.key] = found
            elif not job.entry.exists():  # compiled before this folder was given
                disk.store(job.entry, CACHE[job.key])
        count = math.prod(job.compile_shape.values())
        job.where = (
            "compiled here"
            if count <= local
            else f"compiled on {count} CPU devices in a subprocess"
        )


# A second process compiles alongside this one when three or more compiles are left and
# they would take this many seconds or more at the first one's pace: it then pays for
# its start (importing JAX, a few seconds) several times over.
ALONGSIDE_AFTER = 30.0
# The share of the compiles left that it takes: this process also traces and lowers them
# (about a third of a compile's time) before it compiles its own.
ALONGSIDE_SHARE = 0.6


def share_alongside(rest: list[Job], seconds: float) -> list[Job]:
    """The jobs a second process compiles alongside this one (none on one core, for few
    or quick compiles)."""
    if len(rest) < 3 or seconds * len(rest) < ALONGSIDE_AFTER or (os.cpu_count() or 1) < 2:
        return []
    return rest[len(rest) - round(ALONGSIDE_SHARE * len(rest)) :]


def _keep(problem_key: ProblemKey, job: Job, measured: Measurement) -> None:
    """`measured` in the cache, and on disk where there is one."""
    CACHE[job.key] = measured
    if problem_key.disk is not None and job.entry is not None:
        problem_key.disk.store(job.entry, measured)


def measure_all(
    problem: Problem,
    problem_key: ProblemKey,
    jobs: list[Job],
    *,
    local: int,
    progress: bool | None,
) -> None:
    """Compiles every job not in the cache: here when this process has the devices, else
    in one subprocess per device count."""
    assign_keys(problem_key, jobs, local)
    pending: dict[Any, Job] = {}
    for job in jobs:
        if job.key is not None and job.key not in CACHE:
            pending.setdefault(job.key, job)
    here = [j for j in pending.values() if math.prod(j.compile_shape.values()) <= local]  # type: ignore[union-attr]
    remote = [j for j in pending.values() if j not in here]
    disable = None if progress is None else not progress
    with tqdm.tqdm(total=len(pending), desc="auto_plan", disable=disable, leave=False) as bar:
        alongside, running, seconds = [], None, 0.0
        for k, job in enumerate(here):
            assert job.compile_shape is not None and job.placed is not None
            if any(job is j for j in alongside):
                continue
            bar.set_postfix_str(f"{job.layout.name} {mesh_str(job.compile_shape)}")
            start = time.perf_counter()
            _keep(problem_key, job, compile_here(problem, job.placed, job.compile_shape))
            seconds = max(seconds, time.perf_counter() - start)
            bar.update()
            if k == 0 and running is None:
                alongside = share_alongside(here[1:], seconds)
                if alongside:
                    work = [(j.placed, j.compile_shape) for j in alongside]
                    running = compile_remote.start(problem, work)  # type: ignore[arg-type]
        if running is not None:
            for job, measured in zip(alongside, compile_remote.finish(running), strict=True):
                _keep(problem_key, job, measured)
                bar.update()
        if remote:
            work = [(j.placed, j.compile_shape) for j in remote if j.placed and j.compile_shape]
            for job, measured in zip(
                remote, compile_remote.compile_all(problem, work), strict=True
            ):  # type: ignore[arg-type]
                _keep(problem_key, job, measured)
                bar.update()
