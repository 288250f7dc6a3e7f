"""`filter_shard` and `filter_replicate`: give every array leaf of a PyTree a layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._tree import Flat, T
from . import cache, place, resolve

# A PartitionSpec, a rule, a callable, or a prefix PyTree of these (`spec_tree`).
SpecLike = PartitionSpec | PyTree[Any] | Callable[[Any, Any], Any] | None


def filter_shard(
    tree: T,
    target: Any = None,
    spec: SpecLike = None,
    *,
    process_local: bool = False,
    check_consistent: bool = True,
) -> T:
    """Gives every array leaf of `tree` the layout that `target` and `spec` describe.

    Outside `jax.jit` this is a real transfer: one batched `jax.device_put` over every
    leaf that needs moving, across devices, device sets and backends (NumPy inputs,
    uncommitted and committed `jax.Array`s alike). Leaves already laid out as asked are
    returned as they are, with no copy (and if none has to move, `tree` itself). Big host
    NumPy leaves bound for an accelerator are staged through pinned host memory in parts
    (`EQXSHARD_STAGING`, `EQXSHARD_STAGING_BYTES`; bit-identical to `jax.device_put`). A
    call like one made before (the same tree structure, leaf types, shapes, dtypes,
    `target` and `spec`) reuses what that call resolved. Inside `jax.jit` it is a layout
    constraint chosen by the mesh's axis types (`with_sharding_constraint` on Auto axes, a
    reshard on Explicit axes, both on a mixed mesh), so the same call works in both places.
    Non-array leaves are returned unchanged (the very same objects).

    It is a drop-in replacement for `eqx.filter_shard(x, device_or_shardings)`.

    **Arguments:**

    - `tree`: any PyTree, e.g. an `eqx.Module`. Array leaves are `jax.Array`s (PRNG key
        arrays included), NumPy arrays and NumPy scalars.
    - `target`: where the array leaves go. One of:
        - a `jax.sharding.Mesh`: laid out over it as `spec` says (no `spec`: replicated);
        - a `jax.sharding.AbstractMesh`, or a `NamedSharding` over one: inside `jit`
            only, where it stands for the mesh set by `jax.set_mesh` (it has no devices
            to place onto outside);
        - a `jax.sharding.Sharding`, e.g. a `NamedSharding`;
        - a `jax.Device`: committed to that one device;
        - a `PartitionSpec`: against the mesh set by `jax.set_mesh(mesh)`;
        - `None` (default): the mesh set by `jax.set_mesh`, laid out as `spec` says;
        - a PyTree whose structure is a prefix of `tree`, with any of the above at its
            leaves and `None` to leave that subtree alone. A target that lands on a
            non-array leaf is ignored there, as in `eqx.filter_shard`.
    - `spec`: how to lay leaves out over a mesh target; only with a `Mesh` target or the
        ambient mesh. One of:
        - a `PartitionSpec`, for every array leaf;
        - a rule (`fsdp`, `path_rules`, `like`, `logical`, `first`), called on each
            array leaf with its path, shape and mesh;
        - a callable `(path, leaf) -> PartitionSpec | None`, called on each array leaf
            with its key path (`None` leaves that leaf alone);
        - a PyTree whose structure is a prefix of `tree`, with any of the above at its
            leaves and `None` to leave that subtree alone, e.g. `(fsdp("data"),
            like(params))` for `(model, opt_state)`; a rule or callable there sees each
            leaf's path from the subtree it was given for;
        - `None` (default): replicated.
    - `process_local`: with several processes, `True` means each process passes its own
        local part (e.g. its slice of a batch) and the parts together make one global
        array: the global size of each dim split across processes is the sum of the
        local sizes. Outside `jit` only; needs a mesh target.
    - `check_consistent`: with several processes and a target that spans them, host
        data passed with `process_local=False` is checked to be identical on every
        process (a checksum per leaf: different data would silently diverge). `False`
        skips that check. Either way every process first checks that all passed the same
        tree and flags: one 16-byte digest of the paths, shapes and dtypes of the leaves
        placed across processes (local shapes with `process_local=True`) and of these
        two flags, exchanged through JAX's coordination service. A process that does not
        make the same call is reported after `EQXSHARD_SYNC_TIMEOUT` seconds (default
        600) instead of the run hanging.

    **Returns:**

    A PyTree with the structure of `tree`.

    **Raises:**

    - `TypeError`: for a `target` or `spec` of the wrong type (naming every such leaf
        and what a `spec` may be), a non-bool
        `process_local` or `check_consistent`, or a `spec` given with a
        `Sharding`/`Device` target; naming every such leaf, for array leaves of a dtype
        JAX has no arrays of (NumPy strings, bytes, objects, datetimes, records).
    - `ValueError`: naming every failing leaf by path, when a prefix tree does not match
        `tree`; a `spec` is given for a non-array leaf; a `PartitionSpec` or no target is
        given and no mesh is set; with several processes, they pass different trees
        (leaf paths, shapes or dtypes), raised on every process before any per-leaf
        collective; a spec names an axis the mesh lacks, uses an axis twice, has more
        entries than the leaf has dims, or splits a dim that does not divide evenly; a
        traced leaf would have to move to another device set or backend inside `jit`
        (do that move outside `jit`); `process_local=True` is used inside `jit` or with a
        non-mesh target, or processes pass different local shapes; processes pass
        different data for a global array; `EQXSHARD_STAGING` or
        `EQXSHARD_STAGING_BYTES` holds a value it cannot read; the target is an
        `AbstractMesh` outside `jit`, or inside `jit` one with the set mesh's axes but
        other axis types.
    - `TimeoutError`: with several processes, if another process does not make the same
        call within `EQXSHARD_SYNC_TIMEOUT` seconds (default 600), naming it.

    Nothing is placed unless every leaf passes these checks. Inside `jit`, a move that
    eqxshard cannot see at trace time (the traced array carries no mesh and none is set)
    is reported by JAX when it compiles, as "Received incompatible devices for jitted
    computation": move the data outside `jit` with `filter_put` or `filter_shard`.
    One move JAX does not report: on Explicit axes, inside `jit`, an array on one set of
    devices asked onto a mesh of another set of the same size and platform keeps its
    devices (at trace time JAX knows meshes by shape only, not by device ids).

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        model = eqx.nn.MLP(4, 4, 8, 2, key=jax.random.key(0))
        model = eqxshard.filter_shard(model, mesh)  # replicated
        x = eqxshard.filter_shard(jnp.ones((8 * jax.device_count(), 4)), mesh, P("data"))

        @eqx.filter_jit
        def step(model, x):
            x = eqxshard.filter_shard(x, mesh, P("data"))  # a constraint inside jit
            return jax.vmap(model)(x)
        ```
    """
    for name, flag in (("process_local", process_local), ("check_consistent", check_consistent)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"`filter_shard` takes `{name}` as a bool, but got {flag!r} of type "
                f"{type(flag).__name__}. Pass `{name}=True` or `{name}=False`."
            )
    target = resolve.UNSET if target is None else target
    spec = resolve.UNSET if spec is None else spec
    # A call like one seen before (same tree structure, leaf types, shapes, dtypes,
    # target and spec) is placed from its remembered moves, skipping the checks it passed.
    if not process_local:
        placed, found = cache.recall(
            tree, ("filter_shard", check_consistent), target=target, spec=spec
        )
        if placed is not cache.MISSED:
            return placed
    else:
        found = cache.NEVER
    flat = Flat(tree)
    # With several processes, a call that spans them checks its leaves with the other
    # processes even if this process has no arrays (theirs may differ).
    sync = resolve.must_sync(target)
    if not any(flat.is_array) and not sync:
        return tree
    shardings = resolve.resolve(
        "filter_shard",
        flat,
        target,
        spec,
        process_local=process_local,
        check_consistent=check_consistent,
    )
    placed = place.place(
        "filter_shard",
        flat,
        shardings,
        process_local=process_local,
        check_consistent=check_consistent,
    )
    cache.remember(found, shardings)
    return flat.rebuild(placed) if placed else tree


def filter_replicate(tree: T, mesh: Mesh | None = None) -> T:
    """Replicates every array leaf of `tree` on every device of `mesh`.

    Works inside and outside `jax.jit`; non-array leaves are returned unchanged. The same
    as `filter_shard(tree, mesh)`.

    **Arguments:**

    - `tree`: any PyTree.
    - `mesh`: the mesh to replicate over. `None` uses the mesh set by `jax.set_mesh`.

    **Returns:**

    A PyTree with the structure of `tree`.

    **Raises:**

    - `ValueError`: if `mesh` is `None` and no mesh is set, or (inside `jit`) if a traced
        leaf lives on other devices than `mesh`; if `mesh` is an `AbstractMesh` outside
        `jit` (it has no devices); with several processes, if they pass different trees.
    - `TimeoutError`: with several processes, if another process does not make the same
        call within `EQXSHARD_SYNC_TIMEOUT` seconds (default 600), naming it.
    - `TypeError`: if `mesh` is not a `Mesh`, or for array leaves of a dtype JAX has no
        arrays of (NumPy strings, objects, ...).

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        model = eqxshard.filter_replicate(eqx.nn.Linear(3, 3, key=jax.random.key(0)), mesh)
        ```
    """
    if mesh is not None and not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(
            f"`filter_replicate` takes a `Mesh` as `mesh`, but got {type(mesh).__name__}. "
            "To replicate on a device or a sharding, use `filter_shard(tree, target)`."
        )
    target = resolve.UNSET if mesh is None else mesh
    replicated, found = cache.recall(tree, ("filter_replicate",), target=target, spec=resolve.UNSET)
    if replicated is not cache.MISSED:
        return replicated
    flat = Flat(tree)
    sync = resolve.must_sync(target)
    if not any(flat.is_array) and not sync:
        return tree
    shardings = resolve.resolve("filter_replicate", flat, target, resolve.UNSET)
    placed = place.place("filter_replicate", flat, shardings)
    cache.remember(found, shardings)
    return flat.rebuild(placed) if placed else tree
