"""A candidate layout, the record every phase of the search passes on: a mesh shape, a
rule, and each dimension's choice (offload, remat, pipeline); and how a mesh splits the
batch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import PartitionSpec as P

# The layout families `exclude=` may name, by the mesh axis each adds: a layout with that
# axis (of more than one device) is left out.
FAMILIES = {"data": "data", "fsdp": "fsdp", "tensor": "model"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A candidate before measuring: a mesh shape, a rule, and where it came from."""

    name: str
    shape: dict[str, int]
    rules: Any
    note: str = ""
    offload: bool = False  # the optimiser state in pinned host memory between steps
    remat: tuple[tuple[str, str], ...] = ()  # (path of a `Stacked`, policy): dimensions/remat
    pipeline: tuple[int, int] | None = None  # (microbatches, repeats) over `stage_axis`
    stage_axis: str = "stage"
    in_step: bool = False  # the step calls `filter_pipeline` itself (trace/own_pipeline.py)

    @property
    def devices(self) -> int:
        return math.prod(self.shape.values())


def batch_axes(shape: dict[str, int]) -> tuple[str, ...]:
    """The axes of `shape` the batch's leading dim is split over (an `expert` axis too:
    outside the experts, its devices run the model data-parallel)."""
    return tuple(a for a in ("data", "fsdp", "expert") if a in shape)


def batch_spec(shape: dict[str, int]) -> P:
    """The spec of the batch on a mesh of `shape`: its leading dim over `batch_axes`."""
    axes: list[Any] = list(batch_axes(shape))
    if not axes:
        return P()
    return P(tuple(axes)) if len(axes) > 1 else P(axes[0])
