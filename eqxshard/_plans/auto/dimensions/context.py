"""The context dimension: a `context` mesh axis splitting the sequence (context
parallelism) of a model whose attention `context_parallel` converts (its
`eqx.nn.MultiheadAttention` layers), beside the data, fsdp and tensor-parallel axes.

It refines: once the other layouts are measured, each layout with a `context` axis is
compiled with the model converted (`context_parallel`, the ring strategy) and every batch
leaf laid out `P(data axes, "context")` (its dim 1 the sequence). Its layouts are, for
each size `C` of the `context` axis, every built-in layout of the other devices
(`data_fsdp_tensor`: DP, FSDP, TP, their products) with the `context` axis added and the
layout's rule kept: parameters replicated, split over `fsdp`, or their matmuls split over
`model`, where the heads then split too (`heads_axis="model"`: each device attends its
heads of its part of the sequence; a layout whose heads do not divide is a row saying
so). Beside a pipeline (`PP x context`): each stage size a measured pipeline row over
`stage` (and `data`) has, with `context` in place of `data`, the pipeline's rules and
schedule kept (the converted attention runs nested in the pipeline's `shard_map`; its
backward pass recomputes the attention). Each row says what the split saves against the
smallest unsplit row and what its collectives send. The chosen row's `context`
(`{"axis": "context", "strategy": "ring"}`, with `"heads_axis": "model"` beside a `model`
axis) is what `Plan.apply` and `Plan.jit` convert by.

What it does not weigh: meshes above `compile_limit` (a row saying so: no smaller mesh
stands in for them yet); `context` beside a pipeline with `fsdp` or `model` axes; the
other strategies (`all_gather`, `all_to_all`); the causal balance (the model's own causal
mask is kept as it is); the user's `rules`; remat and offload on these layouts.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P

from ...._sequence.parallel import convert
from ...._tree import is_array_like
from ..layout import FAMILIES, Layout, batch_axes, batch_spec
from ..measure.cache import ProblemKey
from ..trace.problem import Problem
from . import data_fsdp_tensor
from .base import Search
from .split_rows import Converting, Split

AXIS = "context"
STRATEGY = "ring"


HEADS = "model"  # the tensor-parallel axis, which splits the heads where it is


def options(shape: dict[str, int]) -> dict[str, str] | None:
    """A plan's `context` for a mesh of `shape`: how `Plan.apply` converts the model (with
    a `model` axis, the heads split over it: `heads_axis`)."""
    if shape.get(AXIS, 1) == 1:
        return None
    heads = {"heads_axis": HEADS} if shape.get(HEADS, 1) > 1 else {}
    return {"axis": AXIS, "strategy": STRATEGY, **heads}


def sequence_spec(shape: dict[str, int]) -> P:
    """The spec of every batch leaf on a mesh of `shape`: its leading dim over the data
    axes and, with a `context` axis, its dim 1 (the sequence) over it."""
    spec = batch_spec(shape)
    if options(shape) is None:
        return spec
    return P(spec[0] if len(spec) else None, AXIS)


def _sequence_length(batch: Any) -> int | None:
    """Dim 1 of every batch leaf, when they all have one and agree."""
    lengths = {x.shape[1] if len(x.shape) > 1 else None for x in _leaves(batch)}
    if len(lengths) != 1:
        return None
    return lengths.pop()


def _leaves(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree, is_leaf=is_array_like) if is_array_like(x)]


def layouts(model: Any, devices: int, batch: int, length: int) -> list[tuple[Layout, str]]:
    """The layouts with a `context` axis: for each size `C` of it that divides the
    devices, every built-in layout of the other `devices / C` (data parallel, FSDP,
    tensor parallel and their products, as `data_fsdp_tensor` builds them) with the
    `context` axis added beside its axes and its rule kept; each with why it cannot run
    (`""` where the batch splits over the data axes and the sequence over `context`)."""
    out = []
    for context in range(2, devices + 1):
        if devices % context:
            continue
        for rest in data_fsdp_tensor.layouts(model, devices // context, []):
            shape = {a: s for a, s in rest.shape.items() if s > 1}
            shape = _with_context(shape, context)
            name = f"{rest.name} x context" if rest.devices > 1 else AXIS
            data = math.prod(shape.get(a, 1) for a in batch_axes(shape))
            why = ""
            if length % context:
                why = f"the sequence of {length} does not split over {context} devices ({AXIS})"
            elif batch % data:
                axes = " x ".join(batch_axes(shape))
                why = f"the batch of {batch} does not split over {data} devices ({axes})"
            out.append((dataclasses.replace(rest, name=name, shape=shape), why))
    return out


def _with_context(shape: dict[str, int], context: int) -> dict[str, int]:
    """`shape` with a `context` axis after its data and fsdp axes, before `model` (the
    tensor-parallel axis, whose collectives come in every layer, stays innermost)."""
    outer = {a: s for a, s in shape.items() if a != "model"}
    inner = {a: s for a, s in shape.items() if a == "model"}
    return {**outer, AXIS: context, **inner}


def converted(problem: Problem, heads_axis: str | None = None) -> tuple[Problem, int]:
    """`problem` with the model's (and the optimiser state's) attention converted (the
    heads split over `heads_axis`, if any), and how many layers were."""
    how = ft.partial(
        convert, axis=AXIS, strategy=STRATEGY, causal=False, mesh=None, heads_axis=heads_axis
    )
    model, count = how(problem.model)
    state = problem.opt_state
    if state is not None:
        state, _ = how(state)
    return dataclasses.replace(problem, model=model, opt_state=state), count


def _heads_left_whole(model: Any, size: int) -> list[int]:
    """The head counts of the model's attention layers that do not split over `size`."""
    layers = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, eqx.nn.MultiheadAttention))
    attention = [m for m in layers if isinstance(m, eqx.nn.MultiheadAttention)]
    return sorted({m.num_heads for m in attention if m.num_heads % size})


def _beside_stages(search: Search, length: int) -> list[Layout]:
    """For each size of stage axis a pipeline row over `stage` (and `data`) has, that
    pipeline (its rules, microbatches and repeats) with a `context` axis over the other
    devices instead of `data`."""
    devices, out = search.traced.devices, {}
    for c in search.measured.rows:
        stages = c.mesh_shape.get("stage", 1)
        context = devices // stages
        plain = set(c.mesh_shape) <= {"stage", "data"}
        if c.pipeline and plain and stages > 1 and context > 1 and length % context == 0:
            shape = {"stage": stages, AXIS: context}
            pipeline = (c.pipeline["microbatches"], c.pipeline["repeats"])
            layout = Layout("PP x context", shape, c.rules, pipeline=pipeline)
            out.setdefault(stages, layout)
    return list(out.values())


class Context(Converting):
    """A `context` axis for models with `eqx.nn.MultiheadAttention`: the sequence split,
    weighed once the other layouts are measured (see the module's docstring)."""

    name = field = axis = AXIS
    options = staticmethod(options)
    split = f"sequence split {{size}} ways over `{AXIS}` ({STRATEGY})"
    collective, sending = "collective-permute", "keys and values passed round send"

    def splits(self, search: Search) -> list[Split]:
        length = _sequence_length(search.traced.problem.batch)
        if length is None:
            return []
        traced = search.traced
        problem, count = converted(traced.problem)
        if not count:
            return []
        excluded = {FAMILIES[n] for n in traced.exclude if n in FAMILIES}
        steps: dict[str | None, Problem] = {None: problem}  # converted, by the heads axis

        def split(layout: Layout, why: str, heads: str | None) -> Split:
            if heads not in steps:
                steps[heads] = converted(traced.problem, heads)[0]
            key = ProblemKey((traced.problem_key.key, AXIS, STRATEGY, heads))
            return Split(layout, why, steps[heads], key, sequence_spec(layout.shape))

        out = []
        for layout, why in layouts(problem.model, traced.devices, traced.batch_size, length):
            if any(layout.shape.get(a, 1) > 1 for a in excluded):
                continue
            heads = (options(layout.shape) or {}).get("heads_axis")
            whole = _heads_left_whole(problem.model, layout.shape.get(HEADS, 1))
            if heads and whole and not why:
                why = f"attention of {whole[0]} heads does not split over {HEADS}"
            out.append(split(layout, why, heads))
        # Beside a pipeline: its stage's layers hold the converted attention (inside the
        # pipeline's `shard_map`, nested; its backward pass recomputes the attention).
        return out + [split(layout, "", None) for layout in _beside_stages(search, length)]
