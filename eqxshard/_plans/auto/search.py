"""`auto_plan`: the layout that fits a per-device budget with the least estimated step time,
chosen by compiling the user's own step under every candidate layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh

from ..._pipeline.configure import stacks
from ..._tree import is_array_like
from ..pipeline_choice import of_options
from . import (
    arguments as args_,
    batch_proxies,
    flops as flops_,
    jobs,
    links as links_,
    offload as offload_,
    rank as rank_,
    remat as remat_,
    remat_mix,
    remat_traced,
    stages as stages_,
    stages_scaled,
    stages_step,
    topology,
)
from .cache import shapes_key as _shapes_key
from .candidates import batch_spec, layouts
from .measure import Problem, abstract
from .meshes import mesh_for as _mesh
from .result import Candidate, Plan

# Meshes of up to this many devices are compiled (here, or in a subprocess with that many
# CPU devices when this process has fewer); larger ones are estimated from a smaller mesh.
COMPILE_LIMIT = 64


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
    flops_per_second: float = links_.DEFAULT_FLOPS,
    compile_limit: int = COMPILE_LIMIT,
    progress: bool | None = None,
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
    `"in_step": True`, and `plan.jit(step)` runs the step with the plan's mesh set).

    Each candidate's step is compiled (`jax.jit(...).lower(...).compile()`, nothing
    allocated) and measured: bytes per device from `memory_analysis()` (split into
    parameters, gradients, optimiser state, batch and activations), the bytes each
    collective of the HLO moves, turned into seconds by an alpha-beta model over each
    axis' `Link`, and compute seconds from `cost_analysis()` flops. Meshes of up to
    `compile_limit` devices are compiled (in a subprocess with that many CPU devices when
    this process has fewer); larger ones are scaled from a smaller mesh and marked as
    estimates. Results are cached: a second call with the same inputs is fast.

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

    **Returns:**

    A `Plan`: `plan.mesh`, `plan.rules`, `plan.batch_spec`, `plan.shard(...)`,
    `plan.init(...)`, and `plan.table`, every `Candidate` ranked with its figures and
    the reason it was or was not chosen. `print(plan)` shows the table.

    **Raises:**

    - `TypeError`: if `step` is not callable, or `devices`, `budget`, `optimizer`,
        `flops_per_second`, `links` or `devices_per_node` is of the wrong type.
    - `ValueError`: if `devices`, `budget` or `flops_per_second` is not positive (or is
        infinite), `devices_per_node` is below 1 or does not divide `devices`, `links`
        names an unknown axis or preset, `budget` cannot be read or found, `step` fails
        to trace (with the error it raised), `batch` has no common leading dim, `step`
        pipelines in a way no plan can choose (its own `mesh=`, `blocks` it computes, two
        schedules, `pipeline_value_and_grad`: each said); and if
        no candidate fits, naming the smallest footprint found, what dominates it and
        what would help.

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
    n, available = args_.resolve_devices(devices)
    budget_bytes = args_.resolve_budget(budget, available)
    args_.check_options(optimizer, flops_per_second, rules, compile_limit)
    node = topology.check_devices_per_node(devices_per_node, n)
    model_abs = abstract(model)
    batch_abs = abstract(batch)
    size = args_.batch_size(batch_abs)
    opt_abs = None
    if optimizer is not None:
        opt_abs = jax.eval_shape(optimizer.init, eqx.filter(model_abs, is_array_like))
    own = args_.trace_step(step, model_abs, opt_abs, batch_abs, optimizer is not None)
    given = topology.resolve(links, ("data", "fsdp", "model", own.axis if own else stages_.AXIS))
    problem = Problem(step, model_abs, opt_abs, batch_abs)
    trace_args = (
        (model_abs, opt_abs, batch_abs) if optimizer is not None else (model_abs, batch_abs)
    )
    problem_key = (step, _shapes_key(model_abs), _shapes_key(opt_abs), _shapes_key(batch_abs))
    local = len(available)
    reach = max(compile_limit, 1)
    paths = list(stacks(model_abs))
    with stages_step.tracing(own):
        loops = flops_.loop_ratio(step, *trace_args)
        flops = flops_.matmul_flops(step, *trace_args) if paths or own else 0.0
    stage_link = topology.axis_links({stages_.AXIS: n}, given, node)[stages_.AXIS]
    piped, skipped = stages_.layouts(model_abs, n, size, flops, flops_per_second, stage_link)
    if own is not None:  # only meshes with the step's own stage axis can run it
        piped, skipped = stages_step.layouts(model_abs, own, n, size, reach)
    scaled: list = []  # stage layouts above `reach`: compiled once the others are ranked
    if n > reach and own is None:
        scaled, too_large = stages_scaled.compilable(piped, reach)
        piped, skipped = [], stages_scaled.instead(skipped, too_large)
    work = [
        jobs.place(problem, layout, size, reach, available, budget_bytes)
        for layout in ([] if own else layouts(model_abs, n, list(rules))) + piped
    ]

    def row(job: jobs.Job, ratio: float = 1.0) -> Candidate:
        c = rank_.candidate(
            job.layout,
            job.exact,
            job.rejected,
            batch_proxies.measured(job),
            None if job.small is None else (job.small, job.placed),  # type: ignore[arg-type]
            job.where,
            budget_bytes,
            topology.axis_links(job.layout.shape, given, node),
            flops_per_second / loops,
            job.host,
        )
        c = stages_.timed(c, job.layout, flops, n, flops_per_second, ratio)
        return remat_.with_choices(c, job.layout, stages_.options(job.layout))

    batch_proxies.measure(problem, problem_key, work, local, progress)
    batch_proxies.settle(problem, problem_key, work, local, progress, row, budget_bytes)
    candidates = [row(job) for job in work]
    if scaled:
        fastest = min((c for c in candidates if c.fits), key=lambda c: c.time or 0, default=None)
        best = None if fastest is None else fastest.time or 0
        like = None if fastest is None else fastest.mesh_shape
        scaled, unlike = stages_scaled.like_fastest(scaled, like)
        placed = [jobs.place(problem, v, size, reach, available, budget_bytes) for v in scaled]
        by_mesh = {repr(v.shape): topology.axis_links(v.shape, given, node) for v in scaled}
        more, dominated = stages_scaled.worth(placed, best, flops, n, flops_per_second, by_mesh)
        batch_proxies.measure(problem, problem_key, more, local, progress)
        work += more
        candidates += [row(job) for job in more]
        skipped = stages_scaled.instead(skipped, dominated + unlike)
    if problem.trains and offload_.supported(available):
        # The optimiser state in host memory, for the layouts only that would then fit,
        # and could then be faster than the fastest that fits already.
        best = min((c.time or 0 for c in candidates if c.fits), default=None)
        extra = []
        for job, c in zip(work, list(candidates), strict=True):
            state = job.exact.get("optimizer state", 0)
            if not offload_.could_fit(c.total_bytes, state, budget_bytes):
                continue
            layout = offload_.variant(job.layout)
            links_here = topology.axis_links(job.layout.shape, given, node)
            floor = (c.time or 0.0) + offload_.seconds(state, links_here)
            if best is None or floor < best:
                extra.append(jobs.place(problem, layout, size, reach, available, budget_bytes))
                continue
            exact = job.exact | {"optimizer state": 0}
            why = offload_.dominated(floor, best)
            candidates.append(
                rank_.candidate(layout, exact, why, None, None, "", budget_bytes, {}, 1.0, state)
            )
        jobs.measure_all(problem, problem_key, extra, local, progress)
        candidates += [row(job) for job in extra]
    if paths:
        pending = [(job.layout, c) for job, c in zip(work, candidates, strict=False)]
        candidates += skipped
        traced = remat_traced.Traced(step, trace_args, lambda: stages_step.tracing(own))

        def remat_rows(todo: list[tuple[Any, Any, Candidate]]) -> list[tuple[Any, Candidate]]:
            """Each variant in `todo` compiled, with its row saying what it chose."""
            extra = [
                jobs.place(problem, v, size, reach, available, budget_bytes) for v, _, _ in todo
            ]
            jobs.measure_all(problem, problem_key, extra, local, progress)
            made = []
            for job, (v, _, c) in zip(extra, todo, strict=True):
                # A pipeline's compute is the model's flops, times what the remat adds to them.
                first = row(job, traced.recomputed(v.remat, ()) if v.pipeline else 1.0)
                links_here = topology.axis_links(v.shape, given, node)
                apart = getattr(batch_proxies.measured(job), "host_temp", 0)
                row_ = remat_.described(first, v, c, traced, budget_bytes, links_here, apart)
                made.append((v, row_))
            return made

        tried: list[tuple[Any, Any, Candidate, Candidate]] = []
        for policies in (remat_.FIRST, remat_.THEN):
            if not offload_.supported(available):
                policies = tuple(p for p in policies if p != "offload")
            best = min((c.time for c in candidates if c.fits and c.time), default=None)
            todo, pruned = remat_.worth(pending, paths, policies, best)
            for v, c in pruned:
                row_ = remat_.dominated(v, c, best or 0.0)
                candidates.append(remat_.with_choices(row_, v, stages_.options(v)))
            todo, same = remat_.saving(todo, traced)  # no fewer bytes than the model's own
            candidates += [remat_.with_choices(r, v, stages_.options(v)) for v, _, _, r in same]
            # Where every stack rematerialised fits, the fewest stacks that would, alone.
            mixes, made = remat_mix.mixes(todo, remat_rows(todo), traced, budget_bytes)
            made += remat_rows(mixes)
            candidates += [c for _, c in made]
            tried += [
                (v, base, c, r) for (v, base, c), (_, r) in zip(todo + mixes, made, strict=True)
            ]
            pending = [
                (base, c)
                for (v, base, c), (_, r) in zip(todo, made, strict=False)
                if not r.fits and remat_.policy_of(v) in remat_.FIRST
            ] + [(b, c) for v, b, c, _ in same if remat_.policy_of(v) in remat_.FIRST]
            pending = list({id(b): (b, c) for b, c in pending}.values())
        if problem.trains and offload_.supported(available):
            # Rematerialised and still over, but not by more than the optimiser state: that
            # in host memory too (dominated when its trips alone make it slower).
            best = min((c.time for c in candidates if c.fits and c.time), default=None)
            both, slow = offload_.after_remat(tried, budget_bytes, best, given, node)
            candidates += [remat_.with_choices(c, v, stages_.options(v)) for v, c in slow]
            candidates += [c for _, c in remat_rows(both)]
    table = rank_.rank(candidates + (skipped if own else []), budget_bytes)
    if not table[0].fits:
        raise rank_.nothing_fits(table, budget_bytes, n, size)
    by_mesh = {repr(c.mesh_shape): topology.axis_links(c.mesh_shape, given, node) for c in table}
    table = stages_step.why_chosen(table, by_mesh, own)
    return Plan(
        mesh=_mesh(table[0].mesh_shape, available),
        rules=table[0].rules,
        batch_spec=batch_spec(table[0].mesh_shape),
        table=table,
        budget=budget_bytes,
        offload=table[0].offload,
        remat=table[0].remat,
        pipeline=of_options(table[0].pipeline),
    )
