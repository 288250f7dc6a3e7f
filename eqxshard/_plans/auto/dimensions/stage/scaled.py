"""Stage meshes with more devices than `compile_limit`: scaled from a compile on a smaller
stage mesh, as the plain meshes are (`extrapolate`), and weighed by a floor first.

A stage mesh `stage x data x fsdp x model` shrinks like any other
(`extrapolate.reduced_shape`): `data` first (to 1), then `fsdp` and `model` (to 2); the
stage axis keeps its size, so every device of the smaller mesh holds the same layers and
runs the same microbatches of the same rows as on the large one, and the same rule
scales its figures (its rows say "estimated from a compile on ..."). Every mesh of as
many stages with the same axes shrinks to the same smaller one: one compile. Where that
one is over `compile_limit` (a stage axis near it), the meshes are rows that say so.

Since one compile stands for many large meshes, and the search's time is spent compiling,
scaled stage meshes are weighed only with the axes of the fastest layout without stages
that fits (its `data`, `fsdp` and `model` axes, and its `model` size: what the links
favour), the stage axis taking a share of its devices, and each is compiled only when
its floor can beat that layout: its compute over `1 - bubble` (the step's matmul flops
shared out), and where it has a `data` axis, the all-reduce of its gradients over it
(their bytes per device are exact before compiling). A mesh whose floor is slower is a
row that says so.
"""

from __future__ import annotations

from collections.abc import Callable

from ....._pipeline.bubble import bubble_fraction
from ...candidate import Candidate, not_compiled
from ...layout import Layout
from ...links import Link, seconds
from ...measure.jobs import Job
from ...scale.extrapolate import stage_mesh_devices
from ...view import seconds_str
from .schedule import AXIS, options


def _leave_out(
    layouts: list[Layout], why: Callable[[Layout], str | None]
) -> tuple[list[Layout], list[Candidate]]:
    """The layouts for which `why` gives no reason, and a not-compiled row for each of the
    others, saying its reason."""
    kept, rows = [], []
    for layout in layouts:
        reason = why(layout)
        if reason is None:
            kept.append(layout)
        else:
            rows.append(not_compiled(layout, reason, pipeline=options(layout)))
    return kept, rows


def compilable(layouts: list[Layout], reach: int) -> tuple[list[Layout], list[Candidate]]:
    """The stage layouts whose stage axis fits in a compile of `reach` devices, and a row
    for each of the others."""

    def why(layout: Layout) -> str | None:
        needs = stage_mesh_devices(layout.shape)
        if needs <= reach:
            return None
        axes = " x ".join(
            f"{a}={2 if a != AXIS else s}" for a, s in layout.shape.items() if a != "data"
        )
        return (
            f"not compiled: scaled from a compile on {axes}, {needs} devices, over "
            f"`compile_limit` = {reach} (raise it to weigh this mesh)"
        )

    return _leave_out(layouts, why)


def floor(job: Job, flops: float, n: int, flops_per_second: float, links: dict[str, Link]) -> float:
    """Seconds no step of `job`'s stage layout can beat: its compute over `1 - bubble`, and
    the all-reduce of its gradients over `data`."""
    layout = job.layout
    assert layout.pipeline is not None
    share = bubble_fraction(layout.shape[AXIS], *layout.pipeline)
    total = flops / n / flops_per_second / (1 - share)
    data = layout.shape.get("data", 1)
    if data > 1 and "gradients" in job.exact:
        total += seconds("all-reduce", job.exact["gradients"], data, ("data",), links)
    return total


def dominated(layout: Layout, floor_: float, best: float) -> Candidate:
    why = (
        f"not compiled: dominated, at least {seconds_str(floor_)} per step (compute over "
        f"1 - bubble, and the gradients' all-reduce over `data`), slower than "
        f"{seconds_str(best)} of a layout without stages that fits"
    )
    return not_compiled(layout, why, pipeline=options(layout))


def like_fastest(
    layouts: list[Layout], fastest: dict[str, int] | None
) -> tuple[list[Layout], list[Candidate]]:
    """The stage layouts whose other axes are those of `fastest` (the mesh of the fastest
    layout without stages that fits; None: none fits, all are kept), with its `model`
    size, and a row for each of the others."""
    if fastest is None:
        return list(layouts), []
    axes = set(fastest)
    like = " x ".join(f"model={s}" if a == "model" else a for a, s in fastest.items())

    def why(layout: Layout) -> str | None:
        rest = {a: s for a, s in layout.shape.items() if a != AXIS}
        if set(rest) == axes and rest.get("model") == fastest.get("model"):
            return None
        return (
            f"not compiled: above `compile_limit`, stages are weighed with the axes of the "
            f"fastest layout without stages that fits ({like}) only"
        )

    return _leave_out(layouts, why)


def worth(
    jobs: list[Job],
    *,
    best: float | None,
    flops: float,
    n: int,
    flops_per_second: float,
    links: dict[str, dict[str, Link]],
) -> tuple[list[Job], list[Candidate]]:
    """The scaled stage jobs worth compiling (their floor beats `best`, the fastest layout
    that fits; all of them when none fits), and a row for each of the others. `links`:
    each layout's axis links, by `repr` of its mesh shape."""
    kept: list[Job] = []
    rows: list[Candidate] = []
    for job in jobs:
        if job.rejected or best is None:
            kept.append(job)
            continue
        low = floor(job, flops, n, flops_per_second, links[repr(job.layout.shape)])
        if low >= best:
            rows.append(dominated(job.layout, low, best))
        else:
            kept.append(job)
    return kept, rows


def instead(rows: list[Candidate], meshes: list[Candidate]) -> list[Candidate]:
    """`rows` (a mesh's other schedules, dominated) less those of the meshes left out as
    a whole, and the rows of those meshes: one row for each, not one per schedule."""
    gone = {repr(m.mesh_shape) for m in meshes}
    return [r for r in rows if repr(r.mesh_shape) not in gone] + meshes
