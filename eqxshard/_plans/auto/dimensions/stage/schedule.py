"""Pipeline candidates: a `stage` axis for models that hold `eqxshard.Stacked` layers.

When the model holds stacks (found by walking it, `_pipeline.stacked.configure.stacks`), every
stage count `S > 1` that divides the devices and every stack's layer count gets a mesh
`stage x data x fsdp x model` (the stage axis outermost, so that it is the one crossing
nodes): the stacks' layer dims split over `stage` (the `stages` rule), their other dims
and every other leaf laid out as on the `data x fsdp x model` mesh of the rest (FSDP or
replicated; with `model`, tensor parallel, `tensor_parallel`, for models with such weights).
The optimiser state's copies of the stacks are split over `stage` as the stacks are.

Each such mesh could run a few microbatch counts `M` (`S`, `2S`, `4S`, as the batch on a
data shard allows) on GPipe (`R = 1`) or the circular schedule (`R = 2`, where the layer
counts allow). These are weighed by arithmetic before anything is compiled: a pipeline
step takes `(M R + S - 1)` ticks of `1 / (M R)` of a stage's work, so it costs its work
over `1 - bubble` with `bubble = (S - 1) / (M R + S - 1)`, plus a permute between
neighbouring stages at each tick, forward and backward, over the stage axis' link. Only
the cheapest `(M, R)` of each mesh is compiled; the others are rows that say they are
dominated. The compiled step gives the memory and the collectives (the permutes
included); its compute time is the step's matmul flops shared out over every device,
over `1 - bubble` (times the recompute the compiled program shows when it remats).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jax.sharding import PartitionSpec as P

from ....._pipeline.bubble import bubble_fraction
from ....._pipeline.stacked.configure import layers, stacks
from ....._tree import format_bytes
from ....fsdp import fsdp
from ....rules import as_rule, first
from ....stages import stages as stages_rule
from ...candidate import Candidate, not_compiled
from ...layout import Layout
from ...links import Link
from ...trace.phase import STAGE_AXIS
from ...view import seconds_str
from ..data_fsdp_tensor import factorisations, family, mesh_shape
from ..tensor_parallel import tensor_parallel_roles
from . import tensor_parallel

AXIS = STAGE_AXIS
MICROBATCHES = (1, 2, 4)  # multiples of the stage count tried
REPEATS = (1, 2)  # GPipe, and the circular schedule with two chunks per stage


def ticks(stages: int, microbatches: int, repeats: int) -> int:
    return microbatches * repeats + stages - 1


def pattern(paths: list[str]) -> str:
    """The dotted paths of every array leaf inside the stacks at `paths`, also behind a
    prefix (the optimiser state's copies: `0.mu.blocks.…`)."""
    return r"(?:.*\.)?(?:" + "|".join(re.escape(p) for p in paths) + r")\..*"


def _name(schedule: tuple[int, int], stages: int) -> str:
    microbatches, repeats = schedule
    kind = "GPipe" if repeats == 1 else f"circular x{repeats}"
    return f"{stages} stages x {microbatches} microbatches ({kind})"


def note(stages: int, schedule: tuple[int, int]) -> str:
    share = bubble_fraction(stages, *schedule)
    return f"{_name(schedule, stages)}: bubble {share:.0%}"


def _estimate(stages: int, schedule: tuple[int, int], work: float, link: Link) -> float:
    """Seconds of a step by arithmetic alone: the work over `1 - bubble`, and a permute's
    latency at each tick, forward and backward."""
    share = bubble_fraction(stages, *schedule)
    return work / (1 - share) + 2 * ticks(stages, *schedule) * link.latency


def layouts(
    model: Any, n: int, *, size: int, flops: float, flops_per_second: float, link: Link
) -> tuple[list[Layout], list[Candidate]]:
    """The pipeline layouts worth compiling for `n` devices and a batch of `size`, and a
    row for each schedule left out, saying why. `flops` is the step's matmul flops, and
    `link` the stage axis' link (the schedules are weighed with them)."""
    found = stacks(model)
    if not found:
        return [], []
    counts = [layers(s) for s in found.values()]
    paths = list(found)
    roles = tensor_parallel_roles(model)
    out: list[Layout] = []
    pruned: list[Candidate] = []
    work = flops / n / flops_per_second
    for s in range(2, n + 1):
        if n % s or any(c % s for c in counts):
            continue
        for sizes in factorisations(n // s):
            rest = {k: v for k, v in mesh_shape(sizes).items() if v > 1}
            split = None
            if sizes[2] != 1:  # tensor parallel inside each stage, where weights split
                split = tensor_parallel.rule(model, roles, paths, pattern(paths), AXIS, rest)
                if split is None:
                    continue
            shape = {AXIS: s} | rest
            ways = sizes[0] * sizes[1]
            if size % ways:
                continue  # the batch does not split: so for the meshes without stages
            local = size // ways
            schedules = [
                (k * s, r)
                for r in REPEATS
                for k in MICROBATCHES
                if local % (k * s) == 0 and all(c % (s * r) == 0 for c in counts)
            ]
            inner = fsdp("fsdp") if "fsdp" in rest else None
            rest_rule = fsdp("fsdp") if "fsdp" in rest else as_rule(P(), "auto_plan")
            rule = first(stages_rule(AXIS, path=pattern(paths), inner=inner), rest_rule)
            if split is not None:
                rule = split[0]
            name = "PP" + (f" x {family(rest)}" if rest else "")
            if not schedules:
                why = (
                    f"not compiled: the {local} rows of a data shard do not split into "
                    f"{s} microbatches or more"
                )
                pruned.append(_row(Layout(name, shape, rule), why))
                continue
            best = min(schedules, key=lambda sc: _estimate(s, sc, work, link))
            layout = Layout(name, shape, rule, note(s, best), pipeline=best)
            out.append(layout)
            for other in schedules:
                if other == best:
                    continue
                why = (
                    f"not compiled: {_name(other, s)} is dominated by {_name(best, s)}, "
                    f"by arithmetic (bubble "
                    f"{bubble_fraction(s, *other):.0%} vs {bubble_fraction(s, *best):.0%}, "
                    f"{2 * ticks(s, *other)} permutes vs {2 * ticks(s, *best)})"
                )
                pruned.append(_row(dataclasses.replace(layout, pipeline=other), why))
    return out, pruned


def _row(layout: Layout, why: str) -> Candidate:
    return not_compiled(layout, why, pipeline=options(layout))


def options(layout: Layout) -> dict[str, Any] | None:
    """The `Plan.pipeline` of a layout."""
    if layout.pipeline is None:
        return None
    microbatches, repeats = layout.pipeline
    chosen = {"axis": layout.stage_axis, "microbatches": microbatches, "repeats": repeats}
    return chosen | ({"in_step": True} if layout.in_step else {})


def timed(
    c: Candidate, layout: Layout, *, flops: float, n: int, fps: float, recompute: float
) -> Candidate:
    """A compiled pipeline row with its compute time by the model above: the step's
    flops shared out, over `1 - bubble`, times `recompute` (the compiled remat's extra)."""
    if layout.pipeline is None or c.time is None:
        return c
    share = bubble_fraction(layout.shape[layout.stage_axis], *layout.pipeline)
    compute = flops / n / fps / (1 - share) * recompute
    time = (c.communication_time or 0.0) + compute + c.host_time
    return dataclasses.replace(c, compute_time=compute, time=time)


def why_chosen(table: list[Candidate], links: dict[str, dict[str, Link]]) -> list[Candidate]:
    """The chosen row, when it pipelines, says what it beat: the fastest fitting layout
    without stages, and the link its collectives cross (`links`: by mesh, as `repr`)."""
    chosen = table[0]
    if chosen.pipeline is None or not chosen.fits:
        return table
    others = [c for c in table if c.fits and c.pipeline is None and c.time]
    if not others:
        reason = f"{chosen.reason}; no layout without stages fits"
        return [dataclasses.replace(chosen, reason=reason), *table[1:]]
    other = others[0]
    kind = max(other.collectives, key=lambda k: other.collectives[k], default=None)
    where = links.get(repr(other.mesh_shape), {})
    slowest = min(
        (where[a] for a in other.mesh_shape if a in where),
        key=lambda link: link.bandwidth,
        default=None,
    )
    because = f"{other.name}'s communication takes {seconds_str(other.communication_time)}"
    if kind is not None:
        sent = format_bytes(other.collectives[kind])
        because = f"{other.name}'s {kind}s ({sent} per device)"
        if slowest is not None:
            because += f" cross links of {slowest.bandwidth / 1e9:.1f} GB/s"
    reason = (
        f"{chosen.reason}; chosen because {because}: "
        f"{seconds_str(other.time)} per step vs {seconds_str(chosen.time)}"
    )
    return [dataclasses.replace(chosen, reason=reason), *table[1:]]
