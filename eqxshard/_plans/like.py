"""`like(params)`: a rule that lays optimiser state out like the parameters it mirrors."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._placement.targets import RuleError
from .._tree import Path, is_array_like, leaf_error, pathstr, shape_str
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

    def __init__(self, params: Any, plan: Any, min_size: int = 2**14):
        self.min_size = min_size
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        if not any(is_array_like(x) for _, x in leaves):
            raise ValueError(_nothing_to_mirror(params, [x for _, x in leaves]))
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
                    "Pass their shardings as `plan`, e.g. `like(params, "
                    "plan=filter_shardings(params, mesh, spec))` (inside `jit` on Auto mesh "
                    "axes, JAX does not say how a traced array is laid out).",
                )
            )

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        shape, path = tuple(leaf.shape), tuple(path)
        mirrored = None
        for k in range(len(path) + 1):  # the parameter with the longest path ending `path`
            mirrored = self.params.get(path[k:])
            if mirrored is not None:
                break
        if mirrored is not None:
            param_shape, spec = mirrored
            if param_shape == shape:
                return spec
            reduced = _reduced(path, shape, param_shape, spec)
            if reduced is not None:
                return reduced
        else:  # e.g. `lookahead`: state of `params.fast` at `.fast_state[0].mu.<path>`
            spec = self._closest(path, shape)
            if spec is not None:
                return spec
        if math.prod(shape) < self.min_size:
            return PartitionSpec()
        detail = (
            f"mirrors a parameter of shape {shape_str(mirrored[0])}"
            if mirrored is not None
            else "mirrors no parameter of its shape"
        )
        raise RuleError(
            f"cannot lay out these leaves like a parameter (and they have {self.min_size} "
            "elements or more, too many to replicate silently):",
            (f"shape {shape_str(shape)}", detail),
            "Give them a spec with a rule before `like` (`path_rules([...]) | like(params)`), "
            "or raise `min_size` above their size to replicate them.",
        )

    def replicated_because(self, path: Path, leaf: Any, mesh: Any) -> str | None:
        path, shape = tuple(path), tuple(leaf.shape)
        for k in range(len(path) + 1):
            if path[k:] in self.params:
                return f"{self!r}: mirrors a parameter that is replicated"
        if self._closest(path, shape) is not None:
            return f"{self!r}: mirrors a parameter that is replicated"
        return f"{self!r}: mirrors no parameter, fewer than `min_size` elements"

    def _closest(self, path: Path, shape: tuple[int, ...]) -> PartitionSpec | None:
        """The spec of the parameter of this shape whose path shares the longest ending
        with `path` (at least its last key), if any."""
        best, best_spec = 0, None
        for param_path, (param_shape, spec) in self.params.items():
            if param_shape != shape:
                continue
            n = 0
            while n < min(len(path), len(param_path)) and path[-1 - n] == param_path[-1 - n]:
                n += 1
            if n > best:
                best, best_spec = n, spec
        return best_spec

    def __repr__(self) -> str:
        return f"like(<{len(self.params)} parameters>)"


def _reduced(
    path: Path, shape: tuple[int, ...], param_shape: tuple[int, ...], spec: PartitionSpec
) -> PartitionSpec | None:
    """The spec of a state leaf that is its parameter with one dim reduced away (the
    factored moments of `adafactor`): the parameter's spec without that dim's entry.

    Where several dims could be the one reduced (a square parameter), `v_row` is the
    parameter without its largest dim and `v_col` without its second largest, as optax's
    `adafactor` makes them (the last largest on a tie, by `np.argsort`).
    """
    if len(shape) != len(param_shape) - 1:
        return None
    dims = [k for k in range(len(param_shape)) if param_shape[:k] + param_shape[k + 1 :] == shape]
    if not dims:
        return None
    if len(dims) > 1:
        order = [int(k) for k in np.argsort(param_shape)]
        names = {getattr(key, "name", None) for key in path}
        dropped = order[-2] if "v_col" in names else order[-1]
        dims = [dropped] if dropped in dims else dims[:1]
    entries = list(_compat.spec_entries(spec))
    entries += [None] * (len(param_shape) - len(entries))
    del entries[dims[0]]
    while entries and entries[-1] is None:  # `P()`, not `P(None)`, for an unsplit leaf
        entries.pop()
    return PartitionSpec(*entries)


def _nothing_to_mirror(params: Any, leaves: list[Any]) -> str:
    kinds = sorted({type(x).__name__ for x in leaves})
    got = f"{len(leaves)} leaves, none an array ({', '.join(kinds)})" if leaves else "no leaves"
    return (
        f"`like` got `params` with no array leaves ({type(params).__name__} with {got}), so "
        "it has no parameter to lay anything out like (every leaf would be left as it is). "
        "`eqx.filter(abstract, eqx.is_array)` drops every `jax.ShapeDtypeStruct` (they are "
        "not arrays): pass the abstract model itself, `like(abstract, plan=filter_shardings("
        "abstract, mesh, spec))`, or filter it with `eqx.filter(abstract, lambda x: "
        "isinstance(x, jax.ShapeDtypeStruct))`."
    )


def _why(x: Any, plan: Any) -> str:
    if plan is not None:
        return "has no Sharding in `plan` at this path"
    if _compat.is_tracer(x):
        return "is traced and laid out over Auto mesh axes (or no mesh)"
    if isinstance(x, jax.ShapeDtypeStruct):
        return "is abstract, with no sharding"
    return f"is a {type(x).__name__} that is not placed on a mesh"


def like(params: Any, plan: Any = None, *, min_size: int = 2**14) -> Like:
    """A rule that lays out every leaf like the parameter it mirrors: optimiser state.

    `optax` state holds, for each parameter, moments at a path ending with the
    parameter's own path (`[0].mu.layers.0.weight` mirrors `layers.0.weight`), also
    inside `chain`, `masked`, `multi_transform`, `MultiSteps` and `inject_hyperparams`.
    Each array leaf gets, in this order:

    - the spec of the parameter whose path ends its path (the longest such), where the
        shapes are equal (`adam`'s `mu` and `nu`, `lion`'s `mu`, `MultiSteps`'s
        `acc_grads`, ...);
    - where it is that parameter with one dim reduced away (`adafactor`'s factored
        moments `v_row` and `v_col`): the parameter's spec without that dim's entry, so a
        row factor is split like the parameter's rows and a column factor like its
        columns (on a square parameter, `v_row` lacks the largest dim and `v_col` the
        second largest, as optax makes them);
    - where its path ends with no parameter's path (`lookahead`'s `fast_state` mirrors
        `LookaheadParams.fast`): the spec of the parameter of its shape whose path shares
        the longest ending with it;
    - otherwise, if it has fewer than `min_size` elements (step counters, schedules'
        counters, hyperparameters, `adafactor`'s `(1,)` placeholders): replicated;
    - otherwise an error naming it: a big leaf is never replicated silently.

    Use it anywhere a `spec` is, e.g. to create the state directly in its layout:
    `filter_init(optimiser.init, mesh, like(params))(params)`; to lay out an existing
    state: `filter_shard(opt_state, mesh, like(params))` (inside `jit` too); or as the
    `out_shardings` of the state in `filter_jit`.

    **Arguments:**

    - `params`: the parameters the state was made from (the tree passed to
        `optimiser.init`): placed arrays (their own shardings are read), tracers on
        Explicit mesh axes, or `jax.ShapeDtypeStruct`s with a sharding.
    - `plan`: the parameters' shardings, as from `filter_shardings(params, mesh, spec)`; use it
        where `params` do not carry their layout (abstract trees; inside `jit` on Auto mesh
        axes). `None` (default) reads each parameter's own sharding.
    - `min_size`: leaves that mirror no parameter are replicated below this many
        elements and an error from it up (default `2**14`, as `fsdp`'s).

    **Returns:**

    A `Rule`, to pass as a `spec`.

    **Raises:**

    - `ValueError`: if `params` has no array leaves (arrays or `jax.ShapeDtypeStruct`s:
        `eqx.filter(abstract, eqx.is_array)` drops the latter); naming every parameter
        whose layout cannot be read (not placed on a mesh, traced on Auto axes, abstract
        without a sharding, or missing from `plan`);
        when resolved (e.g. by `filter_shard`), naming every leaf of `min_size` elements
        or more that mirrors no parameter.
    - `TypeError`: if `min_size` is not an int >= 0.

    !!! Example

        ```python
        import optax

        mesh = jax.make_mesh(
            (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
        )
        model = eqxshard.filter_init(
            lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key), mesh, eqxshard.fsdp("data")
        )(jax.random.key(0))
        optimiser = optax.adam(1e-3)
        params = eqx.filter(model, eqx.is_array)
        opt_state = eqxshard.filter_init(optimiser.init, mesh, eqxshard.like(params))(params)
        ```
    """
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise TypeError(
            f"`like` takes `min_size` as an int >= 0, but got {min_size!r}. Pass e.g. "
            "`min_size=2**14`."
        )
    return Like(params, plan, int(min_size))
