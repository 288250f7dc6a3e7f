"""What `auto_plan` was given, as shapes: the problem every phase of the search reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ...._tree import is_array_like


@dataclasses.dataclass(frozen=True)
class Problem:
    """What `auto_plan` was given, as shapes: the step, the model, the optimiser state
    (None without an optimiser) and the batch."""

    step: Callable[..., Any]
    model: Any
    opt_state: Any
    batch: Any

    @property
    def trains(self) -> bool:
        return self.opt_state is not None


def abstract(tree: Any) -> Any:
    """`tree` with each array leaf a `jax.ShapeDtypeStruct` without sharding."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array_like(x) else x,
        tree,
        is_leaf=is_array_like,
    )
