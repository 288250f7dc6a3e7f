"""`experts(axis)`: a rule that lays the expert dim of every `Experts` of a model over the
expert axis, and says nothing about any other leaf."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .. import _compat
from .._experts.module import FIELD
from .._placement.targets import RuleError
from .._tree import Path, shape_str
from .rules import NO_MATCH, Rule, as_rule

STACK_FIELD = "blocks"  # `Stacked`'s field: each one above an `Experts` adds a layer dim


def _names(path: Path) -> list[str | None]:
    return [k.name if isinstance(k, jax.tree_util.GetAttrKey) else None for k in path]


def expert_dim(path: Path) -> int | None:
    """The expert dim of the leaf at `path`: the leading dim, after one layer dim per
    `Stacked` around its `Experts`; `None` for a leaf outside every `Experts`."""
    names = _names(path)
    if FIELD not in names:
        return None
    return names[: names.index(FIELD)].count(STACK_FIELD)


def expert_counts(tree: Any) -> set[int]:
    """The numbers of experts of the `Experts` in `tree` (empty: none)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    dims = [(expert_dim(p), x) for p, x in flat if hasattr(x, "shape")]
    return {x.shape[d] for d, x in dims if d is not None and len(x.shape) > d}


class ExpertsRule(Rule):
    """The expert dim of the leaves inside an `Experts` over one axis; see `experts`."""

    def __init__(self, axis: str, inner: Rule | None = None, layers: Rule | None = None):
        self.axis, self.inner, self.layers = axis, inner, layers

    def match(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> Any:
        dim = expert_dim(path)
        if dim is None:
            return NO_MATCH
        sizes = dict(mesh.shape)
        if self.axis not in sizes:
            raise RuleError(
                f"was given `experts` over the mesh axis {self.axis!r}, which the mesh "
                "lacks, for these leaves:",
                (f"mesh axes {list(sizes)}",),
                "Pass `experts(axis=...)` the mesh's expert axis, or add one to the mesh.",
            )
        shape = tuple(leaf.shape)
        if len(shape) <= dim or shape[dim] % sizes[self.axis]:
            raise RuleError(
                f"cannot lay out these leaves with `experts`: their expert dim (dim {dim}) "
                f"is not divisible by the size {sizes[self.axis]} of axis {self.axis!r}:",
                (f"shape {shape_str(shape)}",),
                f"Use a multiple of {sizes[self.axis]} experts, or a smaller expert axis.",
            )
        before = self._part(self.layers, path, shape[:dim], leaf, mesh, dim)
        after = self._part(self.inner, path, shape[dim + 1 :], leaf, mesh, len(shape) - dim - 1)
        entries = [*before, self.axis, *after]
        while entries[-1] is None:  # `P("expert")`, not `P("expert", None, None)`
            entries.pop()
        return PartitionSpec(*entries)

    def _part(
        self, rule: Rule | None, path: Path, shape: tuple, leaf: Any, mesh: Any, ndim: int
    ) -> list[Any]:
        """The entries `rule` gives the dims `shape` of the leaf (the layer dims, or one
        expert's), padded to `ndim`; checked not to use the expert axis."""
        if rule is None:
            return [None] * ndim
        spec = rule.spec_for(path, jax.ShapeDtypeStruct(shape, leaf.dtype), mesh)
        entries = [*_compat.spec_entries(PartitionSpec() if spec is None else spec)]
        used = {a for e in entries for a in (e if isinstance(e, tuple) else (e,))}
        if self.axis in used:
            raise RuleError(
                f"got an `inner` or `layers` rule that lays these leaves out over the expert "
                f"axis {self.axis!r} itself:",
                (f"shape {shape_str(tuple(leaf.shape))}  spec {_compat.spec_str(spec)}",),
                "Give `inner` and `layers` rules over the mesh's other axes.",
            )
        return entries + [None] * (ndim - len(entries))

    def __repr__(self) -> str:
        more = "".join(
            f", {name}={rule!r}"
            for name, rule in (("inner", self.inner), ("layers", self.layers))
            if rule is not None
        )
        return f"experts(axis={self.axis!r}{more})"


def experts(axis: str = "expert", *, inner: Any = None, layers: Any = None) -> ExpertsRule:
    """A rule for expert parallelism: the expert dim of every `Experts` of a model split
    over `axis`, so each device holds `E/A` experts, as `moe` runs them.

    The rule matches exactly the array leaves inside an `Experts` (under its
    `expert_blocks` field) and gives them `P(axis)` on their expert dim: the leading dim,
    or, inside a `Stacked` of MoE layers, the dim after the layer dim (one per `Stacked`
    around the `Experts`: `P(None, axis)`). Every other leaf goes to the next rule of a
    `first(...)`: `experts("expert") | fsdp("data")`. The experts' other dims stay whole,
    unless `inner` lays them out (`inner=fsdp("fsdp")`: each expert's weights also split
    over `fsdp`, gathered for use, as FSDP does); the layer dims stay whole unless `layers`
    lays them out (`layers=stages("stage")`: a pipeline of MoE layers, each stage holding
    its layers' experts split over `axis`).

    **Arguments:**

    - `axis`: the mesh axis of the experts (default `"expert"`).
    - `inner`: how one expert's dims are laid out: a rule (`fsdp("fsdp")`, `path_rules`,
        ...), a `PartitionSpec` or a callable `(path, leaf) -> PartitionSpec`, asked about
        the leaf's shape after its expert dim over the mesh's other axes; `None` (default)
        leaves them whole.
    - `layers`: how the layer dims (one per `Stacked` around the `Experts`) are laid out:
        a rule (`stages("stage")`), spec or callable asked about the leaf's shape before
        its expert dim; `None` (default) leaves them whole.

    **Returns:**

    A `Rule`, to pass as a `spec` (`filter_shard`, `filter_init`, `describe`, the
    `in_shardings` of `filter_jit`), also inside `first(...)`.

    **Raises:**

    - `TypeError`: if `axis` is not a string.
    - `ValueError` (when resolved, e.g. by `filter_shard`): for expert leaves whose expert
        dim the axis size does not divide, an `axis` the mesh lacks, or an `inner` or
        `layers` rule that uses `axis` itself (or raises itself).

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
    as_part = lambda r: None if r is None else as_rule(r, "experts")
    return ExpertsRule(axis, as_part(inner), as_part(layers))
