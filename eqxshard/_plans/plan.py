"""`filter_shardings` and `filter_init`: a layout decided before anything is allocated.

`filter_shardings` resolves `target`/`spec` exactly as `filter_shard` does (the same checks,
the same errors) but on any tree, abstract ones included, and returns the shardings
instead of placing anything. `filter_init` uses that plan as the `out_shardings` of a
`jit`, so that XLA creates each shard of a new model on its own device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, NamedSharding, Sharding
from jaxtyping import PyTree

from .._pipeline.stacked.building import building_on, mesh_to_build_on
from .._placement import place, resolve
from .._tree import Flat, Params, T, is_array_like, leaf_error, pathstr


def plan_shardings(
    verb: str, tree: Any, target: Any, spec: Any, *, sync: bool = True
) -> tuple[Flat, dict[int, Sharding]]:
    """The plan of `tree`. `sync=False` for verbs that only read the plan (`filter_shardings`,
    `describe`): they issue no collective, so one process may call them alone (to log a
    plan on process 0, say); the verbs that act on the plan check it across processes."""
    flat = Flat(tree, is_array=is_array_like)
    target = resolve.UNSET if target is None else target
    spec = resolve.UNSET if spec is None else spec
    return flat, resolve.resolve(verb, flat, target, spec, sync=sync)


def filter_shardings(tree: PyTree, target: Any = None, spec: Any = None) -> PyTree:
    """The sharding each array leaf of `tree` would get from `filter_shard(tree, target, spec)`.

    Nothing is placed or allocated: `tree` may be abstract (`jax.ShapeDtypeStruct`
    leaves, as from `eqx.filter_eval_shape`). Every check of `filter_shard` runs (axis
    names, ranks, divisibility, rules that match no leaf), with the same errors.

    **Arguments:**

    - `tree`: any PyTree; its array leaves are arrays or `jax.ShapeDtypeStruct`s.
    - `target`: as for `filter_shard`: a `Mesh`, a `Sharding`, a `Device`, a
        `PartitionSpec`, `None` (the mesh set by `jax.set_mesh`), or a prefix PyTree of
        these.
    - `spec`: as for `filter_shard`: a `PartitionSpec`, a callable `(path, leaf) ->
        PartitionSpec | None`, a rule (`path_rules`, `fsdp`, `logical`, `like`, `first`),
        or a prefix PyTree of these (`(fsdp("data"), like(params))` for `(model,
        opt_state)`).

    **Returns:**

    A PyTree with the structure of `tree`: a `Sharding` (a `NamedSharding` for mesh
    targets) at each array leaf, `None` at leaves left alone and at non-array leaves. It
    can be passed back as the `target` of `filter_shard`, or as `out_shardings`.

    **Raises:**

    The `TypeError`s and `ValueError`s of `filter_shard` about `target` and `spec`, and
    those of the rules, naming every failing leaf.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        key = jax.random.key(0)
        abstract = eqx.filter_eval_shape(lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key), key)
        plan = eqxshard.filter_shardings(abstract, mesh, eqxshard.fsdp("data", min_size=0))
        plan.layers[0].weight  # NamedSharding(mesh, P("data", None))
        ```
    """
    flat, shardings = plan_shardings("filter_shardings", tree, target, spec, sync=False)
    return flat.rebuild({i: shardings.get(i) for i in range(len(flat.leaves))})


def _device_groups(indices: list[int], shardings: dict[int, Sharding]) -> list[list[int]]:
    """Leaves grouped by device set (one `jit` can only output to one); leaves with no
    sharding go with the first group."""
    groups: dict[Any, list[int]] = {}
    for i in indices:
        s = shardings.get(i)
        key = None if s is None else frozenset(d.id for d in s.device_set)
        groups.setdefault(key, []).append(i)
    free = groups.pop(None, [])
    ordered = list(groups.values()) or [[]]
    ordered[0] = sorted(ordered[0] + free)
    return ordered


def _check_devices_known(flat: Flat, shardings: dict[int, Sharding]) -> None:
    rows = [
        (pathstr(flat.paths[i]), f"mesh {s.mesh}")
        for i, s in shardings.items()
        if isinstance(s, NamedSharding) and isinstance(s.mesh, AbstractMesh)
    ]
    if rows:
        raise ValueError(
            leaf_error(
                "`filter_init` cannot create these leaves on an AbstractMesh: it has no devices.",
                rows,
                "Pass a concrete `jax.sharding.Mesh` (e.g. from `jax.make_mesh`); "
                "`filter_shardings` gives the layouts on an AbstractMesh without creating "
                "anything.",
            )
        )


def _settled(sharding: Sharding | None) -> Sharding | None:
    """A concrete output's layout: `P.UNCONSTRAINED` dims not split, as `filter_shard`
    places them outside `jit` (`jit`'s `out_shardings` refuses them)."""
    return None if sharding is None else place.settled(sharding)


class _Init(Generic[Params, T]):
    def __init__(self, fn: Callable[Params, T], target: Any, spec: Any):
        self.fn, self.target, self.spec = fn, target, spec
        self.mesh_set: Any = None

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[Flat, list[tuple[list[int], Any]], Any]:
        abstract = eqx.filter_eval_shape(self.fn, *args, **kwargs)
        # A circular `Stacked` that `fn` builds without knowing its stage count is built
        # again with the mesh set, so that it is stored stage-major (no weights moved per
        # step); `fn` then runs with it set.
        self.mesh_set = mesh_to_build_on(abstract, self.target)
        if self.mesh_set is not None:
            with building_on(self.mesh_set):
                abstract = eqx.filter_eval_shape(self.fn, *args, **kwargs)
        flat, shardings = plan_shardings("filter_init", abstract, self.target, self.spec)
        _check_devices_known(flat, shardings)
        dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
        fn: Callable[..., Any] = self.fn

        def build(indices: list[int]) -> Callable[[Any], list[Any]]:
            def run(dynamic: Any) -> list[Any]:
                call_args, call_kwargs = eqx.combine(dynamic, static)
                leaves = jax.tree_util.tree_leaves(fn(*call_args, **call_kwargs))
                return [leaves[i] for i in indices]

            return run

        # One `jit` per device set the leaves go to (usually one); XLA drops from each
        # the work for the leaves it does not return.
        jitted = []
        for group in _device_groups(flat.array_indices, shardings):
            out_shardings = [_settled(shardings.get(i)) for i in group]
            jitted.append((group, jax.jit(build(group), out_shardings=out_shardings)))
        return flat, jitted, dynamic

    def __call__(self, *args: Params.args, **kwargs: Params.kwargs) -> T:
        flat, jitted, dynamic = self._prepare(args, kwargs)
        arrays: dict[int, Any] = {}
        with building_on(self.mesh_set):
            for group, f in jitted:
                arrays.update(zip(group, f(dynamic), strict=True))
        return flat.rebuild(arrays)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The `jax.stages.Lowered` of the init, e.g. for `.compile().memory_analysis()`
        (of the first device set's part, where the leaves go to several)."""
        _, jitted, dynamic = self._prepare(args, kwargs)
        with building_on(self.mesh_set):
            return jitted[0][1].lower(dynamic)


def filter_init(fn: Callable[Params, T], target: Any = None, spec: Any = None) -> _Init[Params, T]:
    """Wraps `fn` so that the PyTree it returns is created directly in its planned layout.

    `filter_init(fn, mesh, spec)(*args)` returns what `fn(*args)` returns, with every array
    leaf laid out as `filter_shard(..., mesh, spec)` would lay it out, but without ever
    creating a whole leaf on one device: the output's shapes are found with
    `eqx.filter_eval_shape`, its shardings with `filter_shardings`, and `fn` runs under
    `jax.jit` with those `out_shardings`, so XLA computes each shard on its own device.
    Use it to build a model too large for one device. Non-array leaves of the result
    (activation functions, static fields) come from the abstract tree. Where `target` is
    a mesh, none is set, and `fn` builds a circular `eqxshard.Stacked` (`repeats > 1`)
    without one, `fn` runs with `target` set (`jax.set_mesh`), so that the stack is
    stored stage-major for its stage count and its pipeline moves no weights per step.

    With several processes, call it on every process with the same arguments, over a
    mesh spanning all of them: each process then holds only its own devices' shards.

    **Arguments:**

    - `fn`: any callable returning a PyTree, e.g. `lambda key: eqx.nn.MLP(..., key=key)`
        or `optimiser.init`. Its array arguments are traced; others are held static.
    - `target`: as for `filter_shard` (usually a `Mesh`).
    - `spec`: as for `filter_shard`: a `PartitionSpec`, a callable, a rule (`fsdp`,
        `path_rules`, `logical`, `like`, `first`), or a prefix PyTree of these.

    **Returns:**

    A function taking `fn`'s arguments and returning its PyTree, placed. It also has
    `.lower(*args)` (a `jax.stages.Lowered`) to inspect the compiled init, e.g. its
    `memory_analysis()`.

    **Raises:**

    The errors of `filter_shardings`, raised before `fn` runs on any device; `TypeError` if
    `fn` is not callable; `ValueError` if a leaf's layout is on an `AbstractMesh`, which
    has no devices to create it on.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        make = lambda key: eqx.nn.MLP(256, 256, 1024, 2, key=key)
        model = eqxshard.filter_init(make, mesh, eqxshard.fsdp("data"))(jax.random.key(0))
        ```
    """
    if not callable(fn):
        raise TypeError(f"`filter_init` takes a callable `fn`, but got {type(fn).__name__}.")
    return _Init(fn, target, spec)
