"""Pipeline candidates for a step that calls `filter_pipeline` itself (not through a
`Stacked` a plan can configure), found while the step is traced (`trace/own_pipeline.py`).

The step fixes its stage axis' name and its schedule (microbatches, repeats) in its code,
and runs on whatever mesh is set (`filter_pipeline(mesh=None)`). So its candidates are
the meshes with that axis: every stage count `S > 1` dividing the devices and each call's
layer count over its `repeats` (with microbatches >= `S`), times the data x fsdp x model
factorisations of the rest; the leaves the step passes as `blocks` (found by identity
with the model's leaves as traced) split over the axis on their layer dim (the `stages`
rule), every other leaf as on the mesh without the axis. One row per mesh, its bubble
noted. A mesh without the axis cannot run the step: none is a candidate (the chosen row
says so). Each candidate is traced and compiled with its mesh set (`Placed.mesh_set`),
as `Plan.jit` runs the step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from ....fsdp import fsdp
from ....rules import as_rule, dotted_path, first
from ....stages import stages as stages_rule
from ...candidate import Candidate, not_compiled
from ...layout import Layout
from ...trace.own_pipeline import OwnPipeline
from ..data_fsdp_tensor import factorisations, family, mesh_shape
from ..tensor_parallel import tensor_parallel_roles
from . import schedule, tensor_parallel


def _pattern(paths: tuple[str, ...], every: list[str]) -> str:
    """Matches the leaves at `paths`, also behind a prefix (the optimiser state's copies:
    `0.mu.blocks.w`), and none of the model's other leaves (`every`: all their paths)."""
    literal = r"(?:.*\.)?(?:" + "|".join(re.escape(p) for p in paths) + ")"
    clash = [t for t in every if t not in paths and re.fullmatch(literal, t)]
    if clash:
        literal = rf"(?!(?:.*\.)?(?:{'|'.join(re.escape(t) for t in clash)})\Z)" + literal
    return literal


def layouts(model: Any, own: OwnPipeline, n: int, size: int, reach: int):
    """The meshes with the step's stage axis for `n` devices and a batch of `size`, and a
    row for each one left out, saying why."""
    every = [dotted_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    pattern = _pattern(own.paths, every)
    roles = tensor_parallel_roles(model)
    out: list[Layout] = []
    rows: list[Candidate] = []
    m, r = own.microbatches, own.repeats
    for s in range(2, n + 1):
        if n % s:
            continue
        if any(c % (s * r) for c in own.layers) or m < s:
            counts = " and ".join(str(c) for c in own.layers)
            why = f"not compiled: {counts} layers do not split into {s} stages x {r} repeats"
            if m < s:
                why = f"not compiled: the step's {m} microbatches are fewer than {s} stages"
            shape = {own.axis: s} | ({"data": n // s} if n > s else {})
            layout = Layout("PP", shape, None, pipeline=(m, r), stage_axis=own.axis, in_step=True)
            rows.append(not_compiled(layout, why, pipeline=schedule.options(layout)))
            continue
        for sizes in factorisations(n // s):
            rest = {k: v for k, v in mesh_shape(sizes).items() if v > 1}
            split = None
            if sizes[2] != 1:
                split = tensor_parallel.rule(model, roles, list(own.paths), pattern, own.axis, rest)
                if split is None:
                    continue
            inner = fsdp("fsdp") if "fsdp" in rest else None
            rest_rule = fsdp("fsdp") if "fsdp" in rest else as_rule(P(), "auto_plan")
            rule = first(stages_rule(own.axis, path=pattern, inner=inner), rest_rule)
            rule = rule if split is None else split[0]
            name = "PP" + (f" x {family(rest)}" if rest else "")
            layout = Layout(
                name,
                {own.axis: s} | rest,
                rule,
                schedule.note(s, (m, r)),
                pipeline=(m, r),
                stage_axis=own.axis,
                in_step=True,
            )
            ways = sizes[0] * sizes[1]
            if size % ways == 0 and (size // ways) % m:
                why = (
                    f"not compiled: the {size // ways} rows of a data shard do not split into "
                    f"the step's {m} microbatches"
                )
                rows.append(not_compiled(layout, why, pipeline=schedule.options(layout)))
            elif layout.devices > reach:
                why = (
                    f"not compiled: {layout.devices} devices, over `compile_limit` = {reach} "
                    "(a step that pipelines by itself is not scaled from a smaller mesh)"
                )
                rows.append(not_compiled(layout, why, pipeline=schedule.options(layout)))
            else:
                out.append(layout)
    return out, rows


def why_chosen(table: list[Candidate], links: Any, own: OwnPipeline | None) -> list[Candidate]:
    """`stages.why_chosen` (`links`: by mesh); for a step that pipelines by itself, the
    chosen row says instead why no mesh without its stage axis was weighed."""
    if own is None:
        return schedule.why_chosen(table, links)
    if not table or not table[0].fits:
        return table
    reason = (
        f"{table[0].reason}; the step calls `filter_pipeline` over axis {own.axis!r} itself, "
        f"so only meshes with that axis can run it"
    )
    return [dataclasses.replace(table[0], reason=reason), *table[1:]]
