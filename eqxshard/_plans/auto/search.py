"""`auto_plan`: the layout that fits a per-device budget with the least estimated step time,
chosen by compiling the user's own step under every candidate layout."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import AbstractMesh

from .dimensions import registry
from .dimensions.base import Measured, Search
from .dimensions.propose import propose
from .dimensions.refine import refine
from .links import DEFAULT_FLOPS
from .measure.phase import measure
from .rank.phase import rank
from .result import Plan
from .scale.phase import scale
from .trace.phase import trace

# The search's phases, in the order `auto_plan` runs them: each a function of this
# folder, named for what it does (`tests/test_auto_plan_phases.py` checks the order).
PHASES = (
    "trace.phase.trace",  # the arguments checked, the step traced: `Traced`
    "dimensions.propose.propose",  # each dimension's layouts: `Proposal`
    "measure.phase.measure",  # each compiled and read: `Search`
    "scale.phase.scale",  # layouts over `compile_limit`, from smaller compiles
    "dimensions.refine.refine",  # variants of measured layouts (offload, remat)
    "rank.phase.rank",  # the rows ranked into a `Plan`
)

# Meshes of up to this many devices are compiled (here, or in a subprocess with that many
# CPU devices when this process has fewer); larger ones are estimated from a smaller mesh.
COMPILE_LIMIT = 64

# The budget a search weighs every layout under in full, to tell the least that fits.
UNBOUNDED = 2**62


def auto_plan(
    step: Callable[..., Any],
    model: Any,
    batch: Any,
    *,
    devices: int | Sequence[Any] | Sequence[int] | AbstractMesh,
    budget: int | float | str | None = None,
    optimizer: Any = None,
    rules: Sequence[Any] = (),
    links: Any = None,
    devices_per_node: int | None = None,
    flops_per_second: float = DEFAULT_FLOPS,
    compile_limit: int = COMPILE_LIMIT,
    progress: bool | None = None,
    exclude: str | Sequence[str] = (),
    cache_dir: str | os.PathLike[str] | bool | None = None,
) -> Plan:
    """Chooses the layout of `model` (and its optimiser state and batch) over `devices`
    that fits `budget` bytes per device with the least estimated step time.

    Every factorisation of the device count into mesh axes `data`, `fsdp` and `model`
    (size-1 axes dropped) is tried with the rule families built from eqxshard's rules:
    data parallel (parameters replicated, `P()`), FSDP (`fsdp("fsdp")`), tensor parallel
    (matmul weights split over `model`, in-projections on their output dim and
    out-projections on their input dim, found from the model's structure and shapes, so
    that each pair needs one collective) and FSDP x TP, plus each of `rules` on every
    mesh. The batch's leading dim is split over the `data` and `fsdp` axes. A step that
    calls `filter_pipeline` itself (without `mesh=`) is planned on the meshes with its own
    stage axis only, the leaves it pipelines split over it (`Plan.pipeline` then has
    `"in_step": True`, and `plan.jit(step)` runs the step with the plan's mesh set). A
    model holding `eqxshard.Experts` is weighed with them unsplit on those meshes, and
    with an `expert` axis (alone, or beside `data` or `fsdp`) that splits them
    (`Plan.experts`; each row says what the split saves and what the dispatch sends).

    Each candidate's step is compiled (`jax.jit(...).lower(...).compile()`, nothing
    allocated) and measured: bytes per device from `memory_analysis()` (split into
    parameters, gradients, optimiser state, batch and activations), the bytes each
    collective of the HLO moves, turned into seconds by an alpha-beta model over each
    axis' `Link`, and compute seconds from `cost_analysis()` flops. Meshes of up to
    `compile_limit` devices are compiled (in a subprocess with that many CPU devices when
    this process has fewer); larger ones are scaled from a smaller mesh and marked as
    estimates. Results are cached, in memory and on disk: a second call with the same
    inputs, in this process or a later one, compiles nothing.

    **Arguments:**

    - `step`: the training step: with `optimizer`, `step(model, opt_state, batch)`
        returning `(model, opt_state, loss)`; without, `step(model, batch)` returning
        anything (an evaluation, say).
    - `model`: the model, concrete or abstract (`eqx.filter_eval_shape`).
    - `batch`: one step's batch: a PyTree of arrays or `jax.ShapeDtypeStruct`s sharing a
        leading (batch) dim.
    - `devices`: how many devices to plan for:
        - an int (more than this machine has is allowed: the plan's mesh is then an
            `AbstractMesh`);
        - a list of `jax.Device`s (the plan's mesh is over them);
        - a mesh shape such as `(64, 8)` or an `AbstractMesh`: only its size is used.
    - `budget`: bytes per device: an int, or a string like `"16GiB"` or `"80GB"`.
        `None` takes the device's `memory_stats()["bytes_limit"]` less 10% headroom
        (CPU devices report none: pass a budget).
    - `optimizer`: an optax transformation (`optax.adamw(...)`), whose state the step
        takes and which the plan lays out like the model; `None` for a step without one.
    - `rules`: more candidate rules (any `spec` form), each tried on every mesh shape.
    - `links`: the link of each mesh axis, for the time estimate: a preset name from
        `eqxshard.links.LINKS` (`"nvlink4"`, `"infiniband_ndr"`, `"intra_node"`, ...), an
        `eqxshard.links.Link(bandwidth, latency)`, or a dict `{axis: preset or Link}` (e.g.
        `{"data": "inter_node"}`), where the axis `"host"` is the link to pinned host
        memory (default `"host"`, PCIe 5). Axes not given get `"inter_node"` when they
        cross nodes (see `devices_per_node`) and `"intra_node"` otherwise.
    - `devices_per_node`: how many devices share a node (`None`: all of them). The mesh's
        outer axes cross nodes, as `jax.make_mesh` orders devices: an axis crosses when
        it and the axes after it (`data`, then `fsdp`, then `model`) span more devices.
    - `flops_per_second`: what one device computes per second (default 4e14).
    - `compile_limit`: the most devices a candidate is compiled on (default 64).
    - `progress`: show a progress bar (`None`: when standard error is a terminal).
    - `exclude`: what not to weigh, by name (a name or a tuple of them): the dimensions
        `"stage"` (pipeline stages), `"offload"` (optimiser state in host memory),
        `"remat"` (rematerialised stacks), `"experts"` (an `expert` axis for the
        `eqxshard.Experts` of a model), `"context"` (a split sequence) and
        `"data_fsdp_tensor"` (every layout without stages), and the layout families
        `"data"`, `"fsdp"` and `"tensor"` (each layout with a `data`, `fsdp` or `model`
        axis). Their rows are not in the table.
    - `cache_dir`: where the figures of each compile are kept across processes (one small
        JSON file each, keyed by the step's jaxpr, the layout and the JAX, jaxlib, backend
        and eqxshard versions):
        - `None`: `$EQXSHARD_CACHE_DIR` if set (empty: none), else
            `$XDG_CACHE_HOME/eqxshard/auto_plan` or `~/.cache/eqxshard/auto_plan`;
        - a folder (a str or a path);
        - `False`: none (only this process' memory, which emptying eqxshard's caches
            empties; the folder is left: delete it to empty it).

    **Returns:**

    A `Plan`: `plan.mesh`, `plan.rules`, `plan.batch_spec`, `plan.shard(...)`,
    `plan.init(...)`, and `plan.table`, every `Candidate` ranked with its figures and
    the reason it was or was not chosen. `print(plan)` shows the table.

    **Raises:**

    - `TypeError`: if `step` is not callable, or `devices`, `budget`, `optimizer`,
        `flops_per_second`, `links`, `devices_per_node`, `exclude` or `cache_dir` is of
        the wrong type.
    - `ValueError`: if `devices`, `budget` or `flops_per_second` is not positive (or is
        infinite), `devices_per_node` is below 1 or does not divide `devices`, `links`
        names an unknown axis or preset, `budget` cannot be read or found, `step` fails
        to trace (with the error it raised), `batch` has no common leading dim, `step`
        pipelines in a way no plan can choose (its own `mesh=`, `blocks` it computes, two
        schedules, `pipeline_value_and_grad`: each said), `exclude` names an unknown
        dimension or family (the valid ones are listed) or leaves no layout.
    - `eqxshard.NothingFits` (a `ValueError`): if no candidate fits, naming the smallest
        footprint found, what dominates it, what would help, the closest rows and the
        least budget that fits; `.table` holds every row, `.smallest_budget` that budget.

    !!! Example

        ```python
        import optax

        model = eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))
        optimizer = optax.adamw(1e-3)

        def step(model, opt_state, batch):
            loss, grads = eqx.filter_value_and_grad(
                lambda m: jnp.mean((jax.vmap(m)(batch) - batch) ** 2)
            )(model)
            updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        batch = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        plan = eqxshard.auto_plan(step, model, batch, devices=4, budget="1MiB", optimizer=optimizer)
        print(plan)
        ```
    """
    left_out = registry.excluded(exclude)
    traced = trace(
        step,
        model,
        batch,
        devices=devices,
        budget=budget,
        optimizer=optimizer,
        rules=rules,
        links=links,
        devices_per_node=devices_per_node,
        flops_per_second=flops_per_second,
        compile_limit=compile_limit,
        progress=progress,
        exclude=left_out,
        cache_dir=cache_dir,
    )
    dimensions = tuple(d for d in registry.DIMENSIONS if d.name not in left_out)
    proposal = propose(traced, dimensions)
    search = measure(traced, dimensions, proposal)
    # Meshes above `compile_limit` are weighed against the fastest of those measured.
    search = scale(search, proposal)
    # Offload and remat vary the measured layouts that are over budget.
    search = refine(search)
    # Where nothing fits, the layouts ruled out before a compile are compiled too: the
    # error then names the least budget that fits, with every layout's figures.
    search = every_footprint(search)
    return rank(search)


def every_footprint(search: Search) -> Search:
    """`search` unchanged where a layout fits, or where each layout its budget ruled out
    before a compile needs (by the parts known) no less than the smallest compiled
    footprint; else with those layouts' rows from a search without a budget (as one with
    a generous budget would compile them), each still over `search`'s budget."""
    rows = search.measured.rows
    if any(c.fits for c in rows):
        return search
    least = min((c.total_bytes for c in rows if c.time is not None and c.total_bytes), default=None)
    hidden = {
        (c.name, tuple(c.mesh_shape.items()))
        for c in rows
        if c.time is None and c.total_bytes is not None and (least is None or c.total_bytes < least)
    }
    if not hidden:
        return search
    roomy = dataclasses.replace(search.traced, budget=UNBOUNDED)
    proposal = propose(roomy, search.dimensions)
    measured = scale(measure(roomy, search.dimensions, proposal), proposal).measured.rows
    found = {
        (c.name, tuple(c.mesh_shape.items())): dataclasses.replace(c, fits=False)
        for c in measured
        if c.time is not None and (c.name, tuple(c.mesh_shape.items())) in hidden
    }
    complete = tuple(
        found.get((c.name, tuple(c.mesh_shape.items())), c) if c.time is None else c for c in rows
    )
    return dataclasses.replace(search, measured=Measured(search.measured.jobs, complete))
