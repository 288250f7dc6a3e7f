"""The dimensions the search weighs, in the order it asks them (see `base.Dimension`).

The order matters where one dimension reads another's rows: the stage meshes are
proposed after the data/fsdp/tensor layouts (the scale phase weighs stage meshes above
`compile_limit` against the fastest of those); offload refines the measured rows before
remat does (remat's variants still over budget are then offered offload too). A new
dimension is a module with a `Dimension` subclass, and one line here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..layout import FAMILIES as FAMILIES
from .base import Dimension
from .context import Context
from .data_fsdp_tensor import DataFsdpTensor
from .experts import ExpertParallel
from .offload import Offload
from .remat.dimension import Remat
from .stage.dimension import Stage

DIMENSIONS: tuple[Dimension, ...] = (
    DataFsdpTensor(),
    Stage(),
    Offload(),
    Remat(),
    Context(),
    ExpertParallel(),
)


def excluded(exclude: Any) -> frozenset[str]:
    """The names `auto_plan(..., exclude=)` leaves out, checked: dimensions of
    `DIMENSIONS` by name, and layout families of `FAMILIES`."""
    names = (exclude,) if isinstance(exclude, str) else exclude
    if not isinstance(names, Sequence | set | frozenset) or not all(
        isinstance(n, str) for n in names
    ):
        raise TypeError(
            "`auto_plan` takes `exclude` as a name or a tuple of names (e.g. "
            f'`exclude=("offload", "remat")`), but got {exclude!r}.'
        )
    valid = [d.name for d in DIMENSIONS] + list(FAMILIES)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(
            f"`auto_plan` cannot exclude {', '.join(repr(n) for n in unknown)}: `exclude` "
            f"takes the names of dimensions and layout families: {', '.join(valid)}."
        )
    return frozenset(names)
