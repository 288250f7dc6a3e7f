"""One candidate measured from its compiled step: bytes per device, flops, collectives.

The step is compiled exactly as the user will run it under the plan: the model and the
optimiser state laid out by the candidate's rule (and donated, so that the new ones reuse
their buffers), the batch split over the data axes, and the new model and state kept in
the same layout. Nothing is allocated: every argument is a `jax.ShapeDtypeStruct`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ...._pipeline.stacked.building import with_mesh_set
from ...._pipeline.stacked.configure import configure, configure_like, stacks
from ...._placement import place
from ...._placement.put import filter_put
from ...._step.pinned import PinnedOp, pinned_ops
from ...._tree import is_array_like
from ...plan import plan_shardings
from ..choices import HOST_MEMORY_KIND
from ..trace.problem import Problem
from .collectives import Collective, collectives
from .host_memory import host_bytes

# Compile without LLVM's optimisations: the code is never run, and the figures read here
# (buffer sizes, flops, collectives) come from the HLO passes before it. A third faster.
# Constant folding stays on, as `plan.jit` compiles: the constants it makes are buffers
# of the step (rotary embeddings' tables from `iota`: without folding an ESM2-like
# step read 1% under its `plan.jit` compile; a full remat's step 10% under), though it
# costs seconds on a large cross-entropy's gradient (a scatter over the batch).
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What a compile tells: `memory_analysis()` per device, flops per device from
    `cost_analysis()`, and the collectives of the HLO."""

    memory: dict[str, int]
    flops: float
    collectives: tuple[Collective, ...]
    pinned: tuple[PinnedOp, ...] = ()  # ops run on one device and replicated
    host: int = 0  # bytes per device of the arguments and outputs held in host memory
    host_temp: int = 0  # temporaries in host memory, where the backend counts them apart

    @property
    def total(self) -> int:
        """Bytes per device in device memory."""
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"] - self.host


def placed(tree: Any, mesh: Mesh | AbstractMesh, spec: Any) -> tuple[Any, Any, int, int]:
    """`tree`'s array leaves as `ShapeDtypeStruct`s laid out by `spec`, their shardings
    (a tree), the bytes of them on one device, and of the floating-point ones."""
    flat, shardings = plan_shardings("auto_plan", tree, mesh, spec, sync=False)
    leaves: dict[int, Any] = {}
    total = inexact = 0
    for i in flat.array_indices:
        x, s = flat.leaves[i], shardings.get(i)
        if s is None:
            s = NamedSharding(mesh, jax.sharding.PartitionSpec())
        leaves[i] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        size = math.prod(s.shard_shape(tuple(x.shape))) * x.dtype.itemsize
        total += size
        inexact += size if jnp.issubdtype(x.dtype, jnp.inexact) else 0
    tree_out = flat.rebuild(leaves)
    sharding_tree = flat.rebuild({i: leaves[i].sharding for i in leaves})
    return tree_out, sharding_tree, total, inexact


def _constrain(tree: Any, shardings: Any) -> Any:
    arrays, rest = eqx.partition(tree, eqx.is_array)
    wanted, _ = eqx.partition(shardings, lambda s: isinstance(s, jax.sharding.Sharding))
    try:
        arrays = jax.tree.map(
            lambda x, s: x if s is None else place.relayout(x, s),
            arrays,
            wanted,
            is_leaf=lambda x: x is None,
        )
    except ValueError:  # the step changed the tree's structure: leave XLA to choose
        return tree
    return eqx.combine(arrays, rest)


def program(
    problem: Problem, model_shardings: Any, opt_shardings: Any, static: Any, offload: bool
) -> Callable[..., Any]:
    """The step as one function of array trees, the new model and state constrained; with
    `offload`, the state moved from host memory for the update and back."""

    def run(model_arrays: Any, opt_state: Any, batch: Any) -> Any:
        model = eqx.combine(model_arrays, static)
        if not problem.trains:
            return eqx.filter(problem.step(model, batch), eqx.is_array)
        if offload:
            opt_state = filter_put(opt_state, memory_kind="device")
        new_model, new_state, loss = problem.step(model, opt_state, batch)
        new_model = _constrain(new_model, model_shardings)
        new_state = _constrain(new_state, opt_shardings)
        if offload:
            new_state = filter_put(new_state, memory_kind=HOST_MEMORY_KIND)
        return eqx.filter((new_model, new_state, loss), eqx.is_array)

    return run


@dataclasses.dataclass(frozen=True)
class Placed:
    """A candidate's arguments, laid out: the abstract model arrays, optimiser state and
    batch with shardings, the model's static part, and bytes per device of each."""

    args: tuple[Any, Any, Any]
    static: Any
    model_shardings: Any
    opt_shardings: Any
    parameters: int
    gradients: int
    opt_state: int
    batch: int
    offload: bool = False
    remat: bool = False  # a stack rematerialises (its own `remat` or the candidate's)
    mesh_set: Any = None  # the mesh set while the step traces (it pipelines by itself)


def _on_host(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding.with_memory_kind(HOST_MEMORY_KIND)
        ),
        tree,
    )


def step_arguments(
    problem: Problem,
    mesh: Mesh | AbstractMesh,
    rules: Any,
    batch: Any,
    batch_spec: Any,
    offload: bool = False,
    remat: tuple[tuple[str, str], ...] = (),
    pipeline: tuple[int, int] | None = None,
    in_step: bool = False,
) -> Placed:
    """The candidate's arguments laid out on `mesh`; with `offload`, the optimiser state
    in pinned host memory (`opt_state` bytes are then host bytes); with `remat` or
    `pipeline`, the model's `Stacked` layers configured so (`configured`); with
    `in_step` (the step calls `filter_pipeline` itself), nothing configured and `mesh`
    set while the step traces."""
    model = configured(problem.model, mesh, remat, None if in_step else pipeline)
    state = configure_like(problem.opt_state, model) if model is not problem.model else None
    model, model_shardings, parameters, gradients = placed(model, mesh, rules)
    arrays, static = eqx.partition(model, is_array_like)
    opt_state, opt_shardings, opt_bytes = None, None, 0
    if problem.trains:
        state = problem.opt_state if state is None else state
        opt_state, opt_shardings, opt_bytes, _ = placed(state, mesh, rules)
        if offload:
            opt_state = _on_host(opt_state)
    batch_placed, _, batch_bytes, _ = placed(batch, mesh, batch_spec)
    return Placed(
        (arrays, opt_state, batch_placed),
        static,
        model_shardings,
        opt_shardings,
        parameters,
        gradients,
        opt_bytes,
        batch_bytes,
        offload and problem.trains,
        # The model's own `remat` counts too (a stack built `Stacked(..., remat="full")`).
        any(s.remat != "none" for s in stacks(model).values()),
        mesh if in_step else None,
    )


def configured(
    model: Any, mesh: Any, remat: tuple[tuple[str, str], ...], pipeline: tuple[int, int] | None
) -> Any:
    """`model` (abstract) with its stacks set to a candidate's remat and pipeline."""
    if not remat and pipeline is None:
        return model
    options = None
    if pipeline is not None:
        options = {"axis": "stage", "microbatches": pipeline[0], "repeats": pipeline[1]}
    return configure("auto_plan", model, remat=dict(remat), pipeline=options, mesh=mesh)


def _mesh_set(p: Placed) -> Any:
    return contextlib.nullcontext() if p.mesh_set is None else with_mesh_set(p.mesh_set)


def _jit(problem: Problem, p: Placed) -> Any:
    run = program(problem, p.model_shardings, p.opt_shardings, p.static, p.offload)
    return jax.jit(run, donate_argnums=(0, 1) if problem.trains else ())


def _flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def measurement(memory: Any, flops: float, hlo_text: str, shape: dict[str, int]) -> Measurement:
    stats = {
        "argument": int(memory.argument_size_in_bytes),
        "output": int(memory.output_size_in_bytes),
        "alias": int(memory.alias_size_in_bytes),
        "temp": int(memory.temp_size_in_bytes),
    }
    host = host_bytes(hlo_text, stats["alias"])
    if getattr(memory, "host_argument_size_in_bytes", 0):  # counted apart already (GPU)
        host = 0
    found = tuple(collectives(hlo_text, shape))
    # GPU and TPU count the temporaries a step keeps in host memory (remat's offloaded
    # activations) apart from `temp_size_in_bytes`; CPU, where they are one memory, does not.
    host_temp = int(getattr(memory, "host_temp_size_in_bytes", 0) or 0)
    return Measurement(stats, flops, found, tuple(pinned_ops(hlo_text)), host, host_temp)


def compile_here(problem: Problem, p: Placed, shape: dict[str, int]) -> Measurement:
    """Compiles the step on this machine's devices (the placed mesh is a real `Mesh`)."""
    with warnings.catch_warnings():
        # A step may return leaves that cannot reuse a donated buffer (a new dtype, say).
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        with _mesh_set(p):
            lowered = _jit(problem, p).lower(*p.args)
        compiled = lowered.compile(compiler_options=FAST_COMPILE)
    memory = compiled.memory_analysis()
    if memory is None:
        raise ValueError(
            "`auto_plan` needs `compiled.memory_analysis()`, which this backend "
            f"({jax.default_backend()!r}) does not provide."
        )
    return measurement(memory, _flops(compiled), compiled.as_text(), shape)


def lower_text(problem: Problem, p: Placed) -> str:
    """The StableHLO of the step on an `AbstractMesh` (no devices), for a compile in a
    process that has enough of them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        with _mesh_set(p):
            traced = _jit(problem, p).trace(*p.args)
        return traced.lower(lowering_platforms=("cpu",)).as_text()
