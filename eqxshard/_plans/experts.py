"""`experts(axis)`: a rule that lays the expert dim of every `Experts` of a model over the
expert axis, and says nothing about any other leaf."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .._experts.module import FIELD
from .._placement.targets import RuleError
from .._tree import Path, shape_str
from .rules import NO_MATCH, Rule

STACK_FIELD = "blocks"  # `Stacked`'s field: each one above an `Experts` adds a layer dim


def _names(path: Path) -> list[str | None]:
    return [k.name if isinstance(k, jax.tree_util.GetAttrKey) else None for k in path]


class ExpertsRule(Rule):
    """The expert dim of the leaves inside an `Experts` over one axis; see `experts`."""

    def __init__(self, axis: str):
        self.axis = axis

    def match(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> Any:
        names = _names(path)
        if FIELD not in names:
            return NO_MATCH
        sizes = dict(mesh.shape)
        if self.axis not in sizes:
            raise RuleError(
                f"was given `experts` over the mesh axis {self.axis!r}, which the mesh "
                "lacks, for these leaves:",
                (f"mesh axes {list(sizes)}",),
                "Pass `experts(axis=...)` the mesh's expert axis, or add one to the mesh.",
            )
        dim = names[: names.index(FIELD)].count(STACK_FIELD)
        shape = tuple(leaf.shape)
        if len(shape) <= dim or shape[dim] % sizes[self.axis]:
            raise RuleError(
                f"cannot lay out these leaves with `experts`: their expert dim (dim {dim}) "
                f"is not divisible by the size {sizes[self.axis]} of axis {self.axis!r}:",
                (f"shape {shape_str(shape)}",),
                f"Use a multiple of {sizes[self.axis]} experts, or a smaller expert axis.",
            )
        return PartitionSpec(*([None] * dim), self.axis)

    def __repr__(self) -> str:
        return f"experts(axis={self.axis!r})"


def experts(axis: str = "expert") -> ExpertsRule:
    """A rule for expert parallelism: the expert dim of every `Experts` of a model split
    over `axis`, so each device holds `E/A` experts, as `moe` runs them.

    The rule matches exactly the array leaves inside an `Experts` (under its
    `expert_blocks` field) and gives them `P(axis)` on their expert dim: the leading dim,
    or, inside a `Stacked` of MoE layers, the dim after the layer dim (one per `Stacked`
    around the `Experts`: `P(None, axis)`). Every other leaf goes to the next rule of a
    `first(...)`: `experts("expert") | fsdp("data")`. The experts' other dims stay whole.

    **Arguments:**

    - `axis`: the mesh axis of the experts (default `"expert"`).

    **Returns:**

    A `Rule`, to pass as a `spec` (`filter_shard`, `filter_init`, `describe`, the
    `in_shardings` of `filter_jit`), also inside `first(...)`.

    **Raises:**

    - `TypeError`: if `axis` is not a string.
    - `ValueError` (when resolved, e.g. by `filter_shard`): for expert leaves whose expert
        dim the axis size does not divide, or an `axis` the mesh lacks.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=auto)
        keys = jax.random.split(jax.random.key(0), 8)
        layer = eqxshard.Experts(
            eqx.filter_vmap(lambda k: eqx.nn.MLP(16, 16, 32, 1, key=k))(keys)
        )
        layer = eqxshard.filter_shard(layer, mesh, eqxshard.experts("expert") | P())
        # layer.expert_blocks.layers[0].weight: shape (8, 32, 16), laid out as P("expert")
        ```
    """
    if not isinstance(axis, str):
        raise TypeError(f"`experts` takes `axis` as a mesh axis name, but got {axis!r}.")
    return ExpertsRule(axis)
