"""`like(params)`: a rule that lays optimiser state out like the parameters it mirrors."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._tree import Path, is_array_like, leaf_error, pathstr
from .rules import Rule


def _read_spec(x: Any) -> PartitionSpec | None:
    """The spec of a parameter's own sharding, or `None` where it cannot be read."""
    if _compat.is_tracer(x):
        sharding = _compat.traced_sharding(x)
        if sharding is None or sharding.mesh.empty:
            return None
        # Under `jit`, only Explicit axes are known; Auto axes read as unsplit.
        types = _compat.axis_type_map(sharding.mesh)
        if any(t == AxisType.Auto for t in types.values()):
            return None
    else:
        sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, Sharding) and sharding.is_fully_replicated:
        return PartitionSpec()
    return None


class Like(Rule):
    """Leaves laid out like the parameter they mirror; see `like`."""

    def __init__(self, params: Any, plan: Any):
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        given: dict[Path, Any] = {}
        if plan is not None:
            is_leaf = lambda x: isinstance(x, (Sharding, PartitionSpec))
            for p, s in jax.tree_util.tree_flatten_with_path(plan, is_leaf=is_leaf)[0]:
                given[tuple(p)] = s
        self.params: dict[Path, tuple[tuple[int, ...], PartitionSpec]] = {}
        unknown = []
        for p, x in leaves:
            if not is_array_like(x):
                continue
            if plan is not None:
                s = given.get(tuple(p))
                spec = s.spec if isinstance(s, NamedSharding) else s
                if isinstance(s, Sharding) and not isinstance(s, NamedSharding):
                    spec = PartitionSpec() if s.is_fully_replicated else None
            else:
                spec = _read_spec(x)
            if not isinstance(spec, PartitionSpec):
                unknown.append((pathstr(p), _why(x, plan)))
                continue
            self.params[tuple(p)] = (tuple(x.shape), spec)
        if unknown:
            raise ValueError(
                leaf_error(
                    "`like` cannot read the layout of these parameters:",
                    unknown,
                    "Pass their shardings as `plan`, e.g. `like(params, plan=filter_plan(params, "
                    "mesh, spec))` (inside `jit` on Auto mesh axes, JAX does not say how a traced "
                    "array is laid out).",
                )
            )

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        shape = tuple(leaf.shape)
        for k in range(len(path) + 1):  # the longest suffix first
            found = self.params.get(tuple(path[k:]))
            if found is not None and found[0] == shape:
                return found[1]
        return PartitionSpec()

    def __repr__(self) -> str:
        return f"like(<{len(self.params)} parameters>)"


def _why(x: Any, plan: Any) -> str:
    if plan is not None:
        return "has no Sharding in `plan` at this path"
    if _compat.is_tracer(x):
        return "is traced and laid out over Auto mesh axes (or no mesh)"
    if isinstance(x, jax.ShapeDtypeStruct):
        return "is abstract, with no sharding"
    return f"is a {type(x).__name__} that is not placed on a mesh"


def like(params: Any, plan: Any = None) -> Like:
    """A rule that lays out every leaf like the parameter it mirrors; the rest replicated.

    For optimiser state: `optax` state holds, for each parameter, moments of the same
    shape at a path ending with the parameter's own path (`[0].mu.layers.0.weight`
    mirrors `layers.0.weight`). Each leaf whose path ends with a parameter's path (the
    longest such) and whose shape equals that parameter's gets that parameter's spec;
    every other array leaf (step counters, factored moments of other shapes) is
    replicated.

    Use it anywhere a `spec` is, e.g. to create the state directly in its layout:
    `filter_init(optimiser.init, mesh, like(params))(params)`; or to lay out an existing
    state: `filter_shard(opt_state, mesh, like(params))` (inside `jit` too).

    **Arguments:**

    - `params`: the parameters the state was made from (the tree passed to
        `optimiser.init`): placed arrays (their own shardings are read), tracers on
        Explicit mesh axes, or `jax.ShapeDtypeStruct`s with a sharding.
    - `plan`: the parameters' shardings, as from `filter_plan(params, mesh, spec)`; use it
        where `params` do not carry their layout (abstract trees; inside `jit` on Auto mesh
        axes). `None` (default) reads each parameter's own sharding.

    **Returns:**

    A `Rule`, to pass as a `spec`.

    **Raises:**

    - `ValueError`: naming every parameter whose layout cannot be read (not placed on a
        mesh, traced on Auto axes, abstract without a sharding, or missing from `plan`).

    !!! Example

        ```python
        import optax

        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        make = lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key)
        model = eqxshard.filter_init(make, mesh, eqxshard.fsdp("data"))(jax.random.key(0))
        optimiser = optax.adam(1e-3)
        params = eqx.filter(model, eqx.is_array)
        opt_state = eqxshard.filter_init(optimiser.init, mesh, eqxshard.like(params))(params)
        ```
    """
    return Like(params, plan)
