"""Which `filter_pipeline` (and `pipeline_value_and_grad`) calls a function makes when
traced: how `auto_plan` finds a step that pipelines by itself (rather than through a
`Stacked` it can configure), the layers it pipelines and the schedule it fixes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax

from .. import _compat
from .._tree import is_array_like, pathstr


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineCall:
    """One call: its stage axis and schedule, the array leaves of its `blocks` by their
    path (`blocks.0.weight`) (each as it was traced from: see `_compat.traced_origin`), whether
    `mesh=` was given, and which verb it was."""

    axis: str
    microbatches: int
    repeats: int
    blocks: tuple[tuple[str, Any], ...] = ()
    mesh: bool = False
    verb: str = "filter_pipeline"


_WATCHING: list[list[PipelineCall]] = []


@contextlib.contextmanager
def watching() -> Iterator[list[PipelineCall]]:
    """A list that fills with the pipeline calls made inside the `with` block."""
    calls: list[PipelineCall] = []
    _WATCHING.append(calls)
    try:
        yield calls
    finally:
        _WATCHING.pop()


def note(schedule: tuple[Any, Any, Any], blocks: Any, mesh: Any, verb: str) -> None:
    """Records a pipeline call for the innermost `watching()` (if any): its `schedule`
    (the stage axis, microbatches and chunks per stage), `blocks`, whether `mesh=` was
    given, and the `verb` called."""
    axis, microbatches, repeats = schedule
    if not _WATCHING:
        return
    found = jax.tree_util.tree_flatten_with_path(blocks, is_leaf=is_array_like)[0]
    leaves = tuple(
        (pathstr(p, "blocks"), _compat.traced_origin(x)) for p, x in found if is_array_like(x)
    )
    call = PipelineCall(str(axis), microbatches, repeats, leaves, mesh is not None, verb)  # type: ignore[arg-type]
    _WATCHING[-1].append(call)
