"""`logical(spec, mapping)`: specs written with model-level axis names, mapped to mesh axes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.sharding import PartitionSpec

from .._compat import spec_str
from .._placement.targets import RuleError
from .._tree import Path
from .rules import NO_MATCH, Rule, as_rule


class Logical(Rule):
    """Specs with model-level axis names, mapped to mesh axes; see `logical`."""

    def __init__(self, rule: Rule, mapping: dict[str, Any]):
        self.rule, self.mapping = rule, mapping
        self.no_match_fix = rule.no_match_fix

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        spec = self.rule.match(path, leaf, mesh)
        if spec is NO_MATCH or spec is None:
            return spec
        if not isinstance(spec, PartitionSpec):
            return spec  # reported by `resolve` as not a PartitionSpec
        entries, unmapped = [], []
        for entry in spec:
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                entries.append(entry)
                continue
            axes: list[str] = []
            for name in entry if isinstance(entry, tuple) else (entry,):
                if name not in self.mapping:
                    unmapped.append(name)
                    continue
                axes.extend(_axes(self.mapping[name]))
            entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        if unmapped:
            raise RuleError(
                "was given logical axis names that the `logical` mapping does not map:",
                (f"spec {spec_str(spec)}", f"unmapped {sorted(set(unmapped))}"),
                f"Mapped names: {sorted(self.mapping)}. Add each name to the mapping: "
                "`{name: mesh_axis}`, or `{name: None}` to leave that dim whole.",
            )
        return PartitionSpec(*entries)

    def unused(self, seen: Any) -> list[str]:
        return self.rule.unused(seen)

    def replicated_because(self, path: Path, leaf: Any, mesh: Any) -> str | None:
        spec = self.rule.match(path, leaf, mesh)
        if not isinstance(spec, PartitionSpec):
            return None
        who = f"logical(..., {self.mapping!r})"
        names = [
            name
            for entry in spec
            if entry is not None and entry is not PartitionSpec.UNCONSTRAINED
            for name in (entry if isinstance(entry, tuple) else (entry,))
        ]
        if not names:
            inner = self.rule.replicated_because(path, leaf, mesh)
            return inner if inner is not None else f"{who}: no logical name for any dim"
        unsplit = sorted({n for n in names if self.mapping.get(n) is None})
        if len(unsplit) == len(set(names)):
            return f"{who}: logical names {unsplit} map to no mesh axis"
        sizes = dict(mesh.shape)
        axes = sorted({a for n in names for a in _axes(self.mapping.get(n))})
        if all(sizes.get(a, 1) == 1 for a in axes):
            return f"{who}: mesh axes {axes} have size 1"
        return None

    def __repr__(self) -> str:
        return f"logical({self.rule!r}, {self.mapping!r})"


def _axes(target: Any) -> tuple[str, ...]:
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def logical(spec: Any, mapping: Mapping[str, str | tuple[str, ...] | None]) -> Logical:
    """Specs written with model-level axis names, and the mesh axes those names map to.

    Write the layout once in the model's own terms (`P("embed", "mlp")`), and choose
    the mesh axes per run (`{"embed": None, "mlp": "model"}`). A name mapped to `None`
    leaves its dim whole; a dim with several names (`P(("batch", "seq"))`) is split over
    all their mesh axes. A name missing from `mapping` is an error listing every leaf
    that uses one. `describe` says why it left leaves whole (their names map to no mesh
    axis, or to axes of size 1; their spec names none).

    **Arguments:**

    - `spec`: the layout with logical names, in any form a `spec` takes:
        - a `PartitionSpec`, for every leaf;
        - a PyTree whose structure is a prefix of the model, with `PartitionSpec`s (or
            `None`, to leave a subtree alone) at its leaves;
        - a rule, e.g. `path_rules([...])` whose specs use logical names;
        - a callable `(path, leaf) -> PartitionSpec | None`.
    - `mapping`: a dict from each logical name to a mesh axis name, a tuple of mesh axis
        names, or `None` (not split).

    **Returns:**

    A `Rule`, to pass as a `spec`.

    **Raises:**

    - `TypeError`: if `mapping` is not a dict of names to axis names, tuples or `None`.
    - `ValueError` (when resolved): for leaves whose spec uses a name `mapping` lacks.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,) * 2
        shape = (2, jax.device_count() // 2)
        mesh = jax.make_mesh(shape, ("data", "model"), axis_types=auto)
        model = eqx.nn.MLP(16, 16, 64, 1, key=jax.random.key(0))  # up, then down
        rules = eqxshard.path_rules([
            (r"layers\\.0\\.weight", P("mlp", "embed")),
            (r"layers\\.1\\.weight", P("embed", "mlp")),
            (r".*", P()),
        ])
        tensor_parallel = eqxshard.logical(rules, {"embed": None, "mlp": "model"})
        model = eqxshard.filter_shard(model, mesh, tensor_parallel)
        ```
    """
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"`logical` takes `mapping` as a dict from logical names to mesh axes, but got "
            f"{type(mapping).__name__}."
        )
    bad = [
        f"{k!r}: {v!r}"
        for k, v in mapping.items()
        if not isinstance(k, str)
        or not (
            v is None
            or isinstance(v, str)
            or (isinstance(v, tuple) and all(isinstance(a, str) for a in v))
        )
    ]
    if bad:
        raise TypeError(
            "`logical` takes `mapping` as {logical name: mesh axis name, tuple of them, or "
            f"None}}, but got: {', '.join(bad)}."
        )
    return Logical(as_rule(spec, "logical"), dict(mapping))
