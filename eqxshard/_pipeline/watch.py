"""Which `filter_pipeline` calls a function makes when traced: how `auto_plan` finds a step
that pipelines by itself (rather than through a `Stacked` it can configure)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class PipelineCall:
    """One `filter_pipeline` call: its stage axis and schedule."""

    axis: str
    microbatches: int
    repeats: int


_WATCHING: list[list[PipelineCall]] = []


@contextlib.contextmanager
def watching() -> Iterator[list[PipelineCall]]:
    """A list that fills with the `filter_pipeline` calls made inside the `with` block."""
    calls: list[PipelineCall] = []
    _WATCHING.append(calls)
    try:
        yield calls
    finally:
        _WATCHING.pop()


def note(axis: object, microbatches: object, repeats: object) -> None:
    """Records a `filter_pipeline` call for the innermost `watching()` (if any)."""
    if _WATCHING:
        _WATCHING[-1].append(PipelineCall(str(axis), microbatches, repeats))  # type: ignore[arg-type]
