"""`filter_restore`: read a checkpoint of `filter_save` straight into any layout."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec, Sharding

from .. import _compat
from .._pipeline.spmd.stage_major import to_stage_major
from .._placement import place, staging
from .._plans.plan import plan_shardings
from .._tree import Flat, T, is_array_like, leaf_error, pathstr
from . import restore_match, store


def _own_sharding(leaf: Any) -> Sharding | None:
    """The concrete sharding a leaf of `like` already has (an array's, or a
    `ShapeDtypeStruct`'s), if any; abstract-mesh shardings (from `eval_shape` under
    `jax.set_mesh`) have no devices to read into and do not count."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, Sharding):
        return None
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        return None
    return sharding


def _key_impl(leaf: Any) -> Any:
    """The PRNG implementation of a key array or of an abstract one."""
    if isinstance(leaf, jax.Array):
        return jax.random.key_impl(leaf)
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)) or k, leaf)
    return found[0]


def filter_restore(
    directory: str | os.PathLike,
    like: T,
    target: Any = None,
    spec: Any = None,
    *,
    step: int | None = None,
    strict: bool = True,
    cast: bool = False,
) -> T:
    """Reads a checkpoint written by `filter_save` into the layout `target`/`spec` describe.

    `like` gives the structure and the non-array leaves; its array leaves may be arrays
    or `jax.ShapeDtypeStruct`s (e.g. `eqx.filter_eval_shape(make_model, key)`: nothing is
    allocated but the result). Each array leaf is read straight into its sharding:
    every process reads only its own devices' shards, on any mesh, also one of another
    shape or another number of processes than at save time. Everything is checked
    before anything is read: a leaf of `like` missing from the checkpoint, one the
    checkpoint has and `like` lacks, or a shape or dtype that differs is one error that
    lists every such leaf with its saved and asked shape and dtype (unless `strict` or
    `cast` say otherwise).

    A model saved with a list of blocks (`self.blocks = [Block(...) for ...]`: leaves
    `blocks.0.…`, `blocks.1.…`, ...) restores into the same model with an
    `eqxshard.Stacked` at `blocks` (`Stacked.from_layers`, see docs/pipelines.md): each
    leaf of the stack is read block by block and stacked, also into a stack stored
    stage-major.

    With several processes, call it on every process with the same arguments.

    **Arguments:**

    - `directory`: the directory `filter_save` wrote to.
    - `like`: a PyTree with the structure of the saved one: a model, or an abstract one.
    - `target`, `spec`: the layout, in every form `filter_shard` accepts: a `Mesh` with a
        `PartitionSpec`, a rule (`fsdp`, `path_rules`, `like`, ...), a callable, or a
        prefix PyTree of these (`(fsdp("data"), like(params))` for `(model, opt_state)`); a
        `Sharding`; a `Device`; a prefix PyTree of these. If both are `None`, each leaf
        keeps the sharding it has in `like` (a placed model's, or a
        `ShapeDtypeStruct(..., sharding=...)`'s). A leaf that `target` leaves alone
        (`None`) also keeps its own sharding.
    - `step`: the step to read; `None` reads the newest.
    - `strict`: `True` (default): `like` and the checkpoint must hold the same leaves,
        of the same shapes. `False`: restore what matches and keep the rest:
        - leaves the checkpoint has and `like` lacks are not read: a part of a saved
            tree, e.g. the parameters of a `(params, opt_state)` checkpoint with
            `like=(params, None)` (the saved tree's structure, `None` for what to skip);
        - leaves of `like` that the checkpoint lacks or holds in another shape (a model
            changed since the save: a leaf added, or resized) keep `like`'s own value,
            laid out as asked, with a warning listing them. `like` must then hold
            arrays there (e.g. a newly initialised model), not `ShapeDtypeStruct`s.
    - `cast`: `False` (default): a leaf saved in another dtype than `like`'s is an
        error. `True`: it is read and cast to `like`'s dtype (e.g. float32 weights into
        a bfloat16 model), by orbax as it reads, shard by shard.

    **Returns:**

    A PyTree with the structure of `like`: its non-array leaves (the same objects), and
    at each array leaf a `jax.Array` holding the saved value in its planned sharding
    (PRNG key arrays as key arrays again).

    **Raises:**

    - `ImportError`: if `orbax-checkpoint` is not installed.
    - `FileNotFoundError`: if `directory` holds no checkpoint, or not `step`.
    - `ValueError`: if `directory` is empty.
    - `ValueError`: if `step` is damaged (metadata or array data missing or unreadable),
        naming what is and the newest good step before it. With `step=None` damaged steps
        are skipped (with a warning), as by `latest_step`.
    - `ValueError`: if the checkpoint and `like` differ in leaves, shapes or dtypes (every
        such leaf listed, with its saved and asked shape and dtype) where `strict` and
        `cast` do not allow it; with `strict=False`, for leaves to keep from `like` that
        are abstract; if a leaf has no sharding to read into, and the `ValueError`s and
        `TypeError`s of `filter_shard` about `target` and `spec`.
    - `TypeError`: if `strict` or `cast` is not a bool.

    !!! Example

        ```python
        import tempfile

        directory = tempfile.mkdtemp()
        make_model = lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key)
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        saved = eqxshard.filter_replicate(make_model(jax.random.key(0)), mesh)
        eqxshard.filter_save(directory, 0, saved)

        abstract = eqx.filter_eval_shape(make_model, jax.random.key(0))  # nothing allocated
        model = eqxshard.filter_restore(directory, abstract, mesh, eqxshard.fsdp("data"))
        ```
    """
    verb = "filter_restore"
    for name, flag in (("strict", strict), ("cast", cast)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"`filter_restore` takes `{name}` as a bool, but got {flag!r} of type "
                f"{type(flag).__name__}."
            )
    ocp = store.import_orbax(verb)
    directory = store.checked_directory(directory, verb)
    all_steps = store.steps_on_disk(ocp, directory)
    # An explicit step is read or is an error; only `step=None` skips damaged ones, saying so.
    steps = store.complete_steps(ocp, directory, warn=step is None)
    if step is None:
        if not steps:
            damaged = f" (damaged steps, skipped: {all_steps})" if all_steps else ""
            raise FileNotFoundError(
                f"`filter_restore` found no checkpoint in {directory}{damaged}. Check the "
                "directory, or use `latest_step(directory) is None` to start from scratch."
            )
        step = steps[-1]
    else:
        step = store.checked_step(step, verb)
        if step not in all_steps:
            raise FileNotFoundError(
                f"`filter_restore` found no step {step} in {directory}; it holds steps "
                f"{steps}. Pass one of them as `step`, or `step=None` for the newest."
            )
        problem = store.damage(directory, step)
        if problem is not None:
            raise _damaged(directory, step, problem, steps)
    flat = Flat(like, is_array=is_array_like)
    shardings: dict[int, Sharding] = {}
    if target is None and spec is None:
        # Each leaf's own sharding, as a prefix-tree target: the checks of `filter_shard`
        # (divisibility, ...) then run on it too. No sharding anywhere: the error below.
        own = {i: _own_sharding(flat.leaves[i]) for i in flat.array_indices}
        if any(s is not None for s in own.values()):
            statics = {i: None for i, a in enumerate(flat.is_array) if not a}
            flat, shardings = plan_shardings(verb, like, flat.rebuild({**own, **statics}), None)
    else:
        flat, shardings = plan_shardings(verb, like, target, spec)
    names = store.leaf_names(verb, flat, like)
    # What no plan gave (no target, or `None` in a prefix target) keeps its own sharding.
    unplaced = []
    for i in flat.array_indices:
        if shardings.get(i) is None:
            own = _own_sharding(flat.leaves[i])
            if own is None:
                unplaced.append((pathstr(flat.paths[i]),))
            else:
                shardings[i] = own
    if unplaced:
        raise ValueError(
            leaf_error(
                "`filter_restore` has no sharding to read these leaves into (`like` gives "
                "them none, and `target`/`spec` do not place them):",
                unplaced,
                "Pass a `target` (e.g. a mesh, with a `spec`), or a placed `like`.",
            )
        )

    manager = store.open_manager(ocp, directory, create=False)
    try:
        try:
            metadata = manager.item_metadata(step)
            saved = getattr(metadata, "tree", metadata)
            if not isinstance(saved, dict):
                raise ValueError(f"its metadata holds {type(saved).__name__}, not a tree")
        except Exception as e:
            raise _damaged(
                directory, step, f"its metadata is unreadable ({_short(e)})", steps
            ) from e
        where = f"step {step} in {directory}"
        # A `Stacked` of `like` saved as a list of blocks: its leaves read block by block.
        stacking = restore_match.stacked_from_list(flat, names, saved, like, cast=cast)
        pieces = {p: names[n] for n, s in stacking.items() for p in s.pieces}
        read, kept = restore_match.match(
            where,
            flat,
            {n: i for n, i in names.items() if n not in stacking},
            {n: a for n, a in saved.items() if n not in pieces},
            strict=strict,
            cast=cast,
            hint=restore_match.list_hint(like, saved),
        )
        abstract: dict[str, Any] = {}
        for piece, i in pieces.items():
            leaf = flat.leaves[i]
            abstract[piece] = jax.ShapeDtypeStruct(
                leaf.shape[1:], leaf.dtype, sharding=_one_layer(shardings[i])
            )
        via_host = []  # read to host NumPy, then staged onto accelerators (`staging`)
        for name, i in read.items():
            want = restore_match.stored(flat.leaves[i])
            if not _compat.is_prng_key(flat.leaves[i]) and staging.through_host(
                want.shape, want.dtype, shardings[i]
            ):
                abstract[name] = staging.host_placeholder(want.shape, want.dtype)
                via_host.append(name)
                continue
            abstract[name] = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=shardings[i])
        try:
            if len(abstract) == len(saved):
                restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
            else:  # a part of the saved tree: only its leaves are read
                restored = store.read_part(ocp, directory, step, abstract)
        except Exception as e:
            raise _damaged(
                directory, step, f"its array data is unreadable ({_short(e)})", steps
            ) from e
    finally:
        manager.close()
    if via_host:
        targets = [shardings[read[name]] for name in via_host]
        placed = staging.device_put([restored[name] for name in via_host], targets)
        restored = {**restored, **dict(zip(via_host, placed, strict=True))}
    # Leaves kept from `like` (`strict=False`), laid out as asked: the path of `filter_shard`.
    out = place.place(verb, flat, {i: shardings[i] for i in kept}) if kept else {}
    for name, stack in stacking.items():
        value = jnp.stack([restored[p] for p in stack.pieces])
        if stack.order is not None:
            value = to_stage_major(value, *stack.order)
        out[names[name]] = jax.device_put(value, shardings[names[name]])
    for name, i in read.items():
        leaf = flat.leaves[i]
        value = restored[name]
        if _compat.is_prng_key(leaf):
            value = jax.random.wrap_key_data(value, impl=_key_impl(leaf))
        out[i] = value
    return flat.rebuild(out)


def _one_layer(sharding: Sharding) -> Sharding:
    """The sharding to read one layer of a stacked leaf into: the stacked leaf's, less
    its layer dim (split over the stages or not, each layer is read whole along it)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(
            sharding.mesh, PartitionSpec(*sharding.spec[1:]), memory_kind=sharding.memory_kind
        )
    return sharding


def _short(e: BaseException) -> str:
    """An error of orbax or tensorstore in brief (their messages run to pages)."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _damaged(directory: str, step: int, problem: str, steps: list[int]) -> ValueError:
    """The one error for a step that cannot be read, pointing to the good step before."""
    earlier = [s for s in steps if s < step]
    if earlier:
        hint = (
            f"The newest good step before it is {earlier[-1]}: pass `step={earlier[-1]}`, "
            f"or delete {os.path.join(directory, str(step))} and restore with `step=None`."
        )
    else:
        hint = "There is no good step before it: start from scratch or restore another copy."
    return ValueError(f"`filter_restore` cannot read step {step} in {directory}: {problem}. {hint}")
