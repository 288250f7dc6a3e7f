"""`stages(axis)`: a rule that lays the layer dim of stacked layers over a pipeline's stage
axis, for `filter_pipeline`."""

from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .. import _compat
from .._placement.targets import RuleError
from .._tree import Path, did_you_mean, shape_str
from .rules import NO_MATCH, Rule, as_rule, dotted_path


class Stages(Rule):
    """The leading dim of matching leaves over the stage axis; see `stages`."""

    def __init__(self, axis: str, path: re.Pattern | None, inner: Rule | None):
        self.axis, self.path, self.inner = axis, path, inner

    def match(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> Any:
        if self.path is not None and not self.path.fullmatch(dotted_path(path)):
            return NO_MATCH
        sizes = dict(mesh.shape)
        if self.axis not in sizes:
            guess = did_you_mean(self.axis, list(sizes))
            raise RuleError(
                f"was given `stages` over the mesh axis {self.axis!r}, which the mesh lacks: "
                f"the mesh has axes {tuple(sizes)}.{guess} Pass `stages(axis=...)` one of "
                "them. The leaves it was asked to lay out:",
                (),
                "Pass `stages(axis=...)` the mesh's stage axis, or add one to the mesh.",
            )
        shape = tuple(leaf.shape)
        if not shape or shape[0] % sizes[self.axis]:
            raise RuleError(
                f"cannot lay out these leaves with `stages`: their leading (layer) dim is not "
                f"divisible by the {sizes[self.axis]} stages of axis {self.axis!r}:",
                (f"shape {shape_str(shape)}",),
                "Stack a multiple of the stage count of layers, or narrow `stages(path=...)` "
                "to the stacked leaves only.",
            )
        rest: Any = PartitionSpec()
        if self.inner is not None:
            one_layer = jax.ShapeDtypeStruct(shape[1:], leaf.dtype)
            rest = self.inner.spec_for(path, one_layer, mesh)
            if rest is None:
                rest = PartitionSpec()
        entries = [*_compat.spec_entries(rest)]
        used = {a for e in entries for a in (e if isinstance(e, tuple) else (e,))}
        if self.axis in used:
            raise RuleError(
                f"got an `inner` rule that lays out one layer over the stage axis "
                f"{self.axis!r} too, for these leaves:",
                (f"shape {shape_str(shape)}", f"inner spec {_compat.spec_str(rest)}"),
                "Give `inner` rules over the mesh's other axes (e.g. 'model', 'fsdp').",
            )
        return PartitionSpec(self.axis, *entries)

    def __repr__(self) -> str:
        path = None if self.path is None else self.path.pattern
        return f"stages(axis={self.axis!r}, path={path!r}, inner={self.inner!r})"


def stages(
    axis: str = "stage", *, path: str | re.Pattern | None = None, inner: Any = None
) -> Stages:
    """A rule for pipelines: the leading (layer) dim of stacked layers split over `axis`, so
    each stage holds its own layers, as `filter_pipeline` runs them.

    The rule recognises the stacked leaves by their dotted path (as `path_rules` does):
    the leaves `path` matches (`re.fullmatch`), or, with `path=None`, every array leaf of
    the tree it is given (use that on the stack alone: `filter_shard(blocks, mesh,
    stages())`). On a whole model, name the stack's field, e.g. `path=r"blocks\\..*"`,
    and follow with rules for the other leaves: `first(stages(path=...), fsdp("data"))`;
    a leaf `path` does not match goes to the next rule of a `first(...)`. The other dims
    of each layer are laid out by `inner`, a rule (or spec) asked about one layer's
    shape (the leaf without its layer dim) over the mesh's other axes. The stack is split
    contiguously: stage `s` holds layers `s*n/S .. (s+1)*n/S - 1`, which is what
    `filter_pipeline` runs for `repeats=1`; for `repeats > 1` it regroups them by one
    all-to-all per step, unless the stack is stored stage-major (as a circular `Stacked`
    built with its mesh stores it), when the split gives each stage its own chunks.

    **Arguments:**

    - `axis`: the mesh axis of the stages (default `"stage"`).
    - `path`: a regular expression (string or compiled) over dotted leaf paths
        (`blocks.weight`) naming the stacked leaves; `None` (default) takes every leaf.
    - `inner`: how one layer's dims are laid out: a rule (`path_rules`, `fsdp`, ...), a
        `PartitionSpec`, or a callable `(path, leaf) -> PartitionSpec`; `None` (default)
        leaves them whole on every device of a stage.

    **Returns:**

    A `Rule`, to pass as a `spec` (also inside `first(...)`).

    **Raises:**

    - `TypeError`: if `axis` is not a string or `path` not a regular expression.
    - `ValueError` (when resolved, e.g. by `filter_shard`): for matching leaves whose
        leading dim the stage count does not divide (or that have no dims), an `axis` the
        mesh lacks, or an `inner` rule that uses `axis` itself.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, jax.device_count() // 2), ("model", "stage"), axis_types=auto)
        n = 2 * mesh.shape["stage"]
        blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(
            jax.random.split(jax.random.key(0), n)
        )
        rule = eqxshard.stages("stage", inner=eqxshard.path_rules([
            (r"weight", P("model", None)),
            (r"bias", P("model")),
        ]))
        blocks = eqxshard.filter_shard(blocks, mesh, rule)
        # blocks.weight: shape (n, 8, 8), laid out as P("stage", "model", None)
        ```
    """
    if not isinstance(axis, str):
        raise TypeError(f"`stages` takes `axis` as a mesh axis name, but got {axis!r}.")
    try:
        pattern = None if path is None else re.compile(path)
    except (re.error, TypeError) as e:
        raise TypeError(
            f"`stages(path=...)` takes a regular expression over dotted leaf paths (or None), "
            f"but got {path!r}: {e}"
        ) from None
    return Stages(axis, pattern, None if inner is None else as_rule(inner, "stages"))
