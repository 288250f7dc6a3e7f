"""The first phase of the search: `auto_plan`'s arguments checked, the model, optimiser
state and batch made abstract, and the step traced: whether it pipelines by itself, its
matmul flops and how many of them `cost_analysis()` sees. Everything later phases read
about the problem is in the `Traced` record this returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from ...._experts.module import configured
from ...._pipeline.stacked.configure import stacks
from ...._tree import is_array_like
from ..links import Link
from ..measure.cache import Disk, ProblemKey, folder, shapes_key
from ..rank import topology
from . import arguments, flops
from .own_pipeline import OwnPipeline, tracing
from .problem import Problem, abstract

# The stage axis of the pipelines a plan configures (a step that pipelines by itself
# names its own).
STAGE_AXIS = "stage"


@dataclasses.dataclass(frozen=True)
class Traced:
    """What the search knows before any candidate is proposed: the problem as shapes, the
    devices and budget, the step's traced figures, and how the cost model reads links."""

    problem: Problem
    problem_key: ProblemKey  # the problem's part of each compile's cache key
    trace_args: tuple[Any, ...]  # the step's arguments, abstract: (model, [opt_state,] batch)
    devices: int  # how many devices the plan is for
    available: list[Any]  # the devices of this process a mesh may use
    budget: int  # bytes per device
    batch_size: int
    rules: tuple[Any, ...]  # the user's rules, tried on every mesh
    reach: int  # the most devices a candidate is compiled on (`compile_limit`)
    own: OwnPipeline | None  # the pipeline of a step that calls `filter_pipeline` itself
    stacks: tuple[str, ...]  # the dotted paths of the model's `Stacked` layers
    flops: float  # the step's matmul flops, every scan's length counted (0 without stacks)
    loops: float  # those over the matmul flops `cost_analysis()` sees
    flops_per_second: float
    links: dict[str, Link]  # the user's links by axis
    devices_per_node: int
    progress: bool | None
    exclude: frozenset[str] = frozenset()  # the dimensions and layout families left out

    @property
    def local(self) -> int:
        """How many devices this process compiles on."""
        return len(self.available)

    def axis_links(self, shape: dict[str, int]) -> dict[str, Link]:
        """The link of each axis of a mesh of `shape` (and of `host`)."""
        return topology.axis_links(shape, self.links, self.devices_per_node)

    def tracing(self) -> Any:
        """A context in which the step traces outside a candidate (`own_pipeline.tracing`)."""
        return tracing(self.own)


def trace(
    step: Any,
    model: Any,
    batch: Any,
    *,
    devices: Any,
    budget: Any,
    optimizer: Any,
    rules: Sequence[Any],
    links: Any,
    devices_per_node: int | None,
    flops_per_second: float,
    compile_limit: int,
    progress: bool | None,
    exclude: frozenset[str] = frozenset(),
    cache_dir: Any = None,
) -> Traced:
    """`auto_plan`'s arguments checked (raising as it documents) and the step traced."""
    n, available = arguments.resolve_devices(devices)
    budget_bytes = arguments.resolve_budget(budget, available)
    arguments.check_options(optimizer, flops_per_second, rules, compile_limit)
    node = topology.check_devices_per_node(devices_per_node, n)
    where = folder(cache_dir)
    # Its `Experts` unsplit (no mesh needed): the expert dimension lays them out over an
    # `expert` axis on its own meshes, and every other layout runs them so.
    model_abs = configured(abstract(model), axis=None, mesh=None)
    batch_abs = abstract(batch)
    size = arguments.batch_size(batch_abs)
    opt_abs = None
    if optimizer is not None:
        opt_abs = jax.eval_shape(optimizer.init, eqx.filter(model_abs, is_array_like))
    own = arguments.trace_step(step, model_abs, opt_abs, batch_abs, optimizer is not None)
    given = topology.resolve(links, ("data", "fsdp", "model", own.axis if own else STAGE_AXIS))
    trace_args = (
        (model_abs, opt_abs, batch_abs) if optimizer is not None else (model_abs, batch_abs)
    )
    paths = tuple(stacks(model_abs))
    with tracing(own):
        jaxpr = flops.step_jaxpr(step, *trace_args)
    loops = flops.loop_ratio(jaxpr.jaxpr)
    matmul = flops.matmul_flops(jaxpr.jaxpr) if paths or own else 0.0
    # On disk, the step is known by its jaxpr (its code, the model's statics and shapes).
    disk = None if where is None else Disk.of(where, str(jaxpr), trace_args)
    in_memory = (step, shapes_key(model_abs), shapes_key(opt_abs), shapes_key(batch_abs))
    return Traced(
        problem=Problem(step, model_abs, opt_abs, batch_abs),
        problem_key=ProblemKey(in_memory, disk),
        trace_args=trace_args,
        devices=n,
        available=available,
        budget=budget_bytes,
        batch_size=size,
        rules=tuple(rules),
        reach=max(compile_limit, 1),
        own=own,
        stacks=paths,
        flops=matmul,
        loops=loops,
        flops_per_second=flops_per_second,
        links=given,
        devices_per_node=node,
        progress=progress,
        exclude=exclude,
    )
