"""`filter_pipeline`: a stack of layers run as a pipeline over a mesh axis."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ... import _compat
from ..._placement.shard import filter_shard
from ..._shard_map.shard_map import filter_shard_map
from .. import checks, watch
from ..remat import check_remat, with_remat
from .schedule import run_stages
from .stage_major import regroup, warn_regrouped

_VERB = "filter_pipeline"


def _over_stages(leaf: Any, axis: str) -> PartitionSpec | None:
    """The spec that splits the layer dim of `leaf` over `axis` and keeps its other dims
    as they are (`None`: already so). On an Explicit stage axis `jax.shard_map` wants its
    inputs laid out as its `in_specs` say (jax 0.12 also inside `grad`)."""
    tracer = _compat.is_tracer(leaf)
    sharding = _compat.traced_sharding(leaf) if tracer else getattr(leaf, "sharding", None)
    entries = [None] * leaf.ndim
    if isinstance(sharding, NamedSharding):
        entries = [*_compat.spec_entries(sharding.spec), *entries][: leaf.ndim]
    if entries[0] == axis:
        return None
    return PartitionSpec(axis, *entries[1:])


def run_pipeline(
    verb: str,
    layer: Callable[[Any, Any], Any],
    blocks: Any,
    x: Any,
    *,
    mesh: Mesh | AbstractMesh | None,
    axis: str,
    microbatches: int,
    repeats: int,
    remat: str | None,
    stage_major: bool,
) -> Any:
    """`filter_pipeline`, also for a stack stored stage-major (`stage_major=True`: chunk
    `r*S + s` of the layers is local chunk `r` of stage `s`, as `stage_major.to_stage_major`
    stores a stack), which runs the circular schedule without moving weights."""
    checks.check_layer(verb, layer)
    mesh = checks.get_mesh(verb, mesh, axis)
    stages = dict(mesh.shape)[axis]
    checks.check_counts(verb, microbatches, repeats, stages)
    checks.check_blocks(verb, blocks, stages, repeats)
    batch, batch_axes = checks.batch_size(verb, x, mesh, axis, microbatches)
    if not batch_axes:
        checks.warn_unsplit(verb, batch, microbatches, mesh, axis)
    policy = check_remat(verb, remat, mesh)
    warn_regrouped(verb, stage_major, repeats, stages, axis)
    weights, static = eqx.partition(blocks, eqx.is_array)
    if _compat.axis_type_map(mesh)[axis] == AxisType.Explicit:
        weights = filter_shard(weights, mesh, lambda path, a: _over_stages(a, axis))
    step = with_remat(lambda w, h: layer(eqx.combine(w, static), h), policy)
    size = batch // microbatches

    # Microbatch m is rows m, m+M, m+2M, ...: a batch split over data-parallel axes stays
    # where it is (each device cuts its own rows), with no collective.
    def cut(a: jax.Array) -> jax.Array:
        return a.reshape(size, microbatches, *a.shape[1:]).swapaxes(0, 1)

    def join(a: jax.Array) -> jax.Array:
        return a.swapaxes(0, 1).reshape(batch, *a.shape[2:])

    def per_stage(local: Any, xs: Any) -> Any:
        if not stage_major:
            local = regroup(local, axis, stages, repeats)
        return run_stages(
            step, local, xs, axis=axis, stages=stages, microbatches=microbatches, repeats=repeats
        )

    # The mesh axes the batch is split over are mapped too, so each device runs its own
    # rows (under Explicit axes the compiler would gather them otherwise); the others (a
    # layer's "model" axis, an unsplit batch's axes inside `jit`) stay with the compiler.
    rows = PartitionSpec(None, batch_axes or None)
    mapped = filter_shard_map(
        per_stage,
        mesh=mesh,
        in_specs=(PartitionSpec(axis), rows),
        out_specs=rows,
        axis_names={axis, *batch_axes},
    )
    return jax.tree.map(join, mapped(weights, jax.tree.map(cut, x)))


SCHEDULES = ("gpipe", "circular")


def _repeats(schedule: object, repeats: Any) -> int:
    """The chunks per stage that `schedule` and `repeats` ask for; a `repeats` that is not
    a positive int is returned as it is, for `checks.check_counts` to name."""
    counted = isinstance(repeats, int) and not isinstance(repeats, bool)
    if schedule is None:
        if counted and repeats > 1:
            warnings.warn(
                f"`{_VERB}(repeats={repeats})` without `schedule`: pass "
                f'`schedule="circular", repeats={repeats}` (the circular schedule, as before).',
                DeprecationWarning,
                stacklevel=3,
            )
        return 1 if repeats is None else repeats
    if not isinstance(schedule, str):
        raise TypeError(
            f"`{_VERB}` takes `schedule` as one of {', '.join(map(repr, SCHEDULES))}, but got "
            f"{type(schedule).__name__}."
        )
    if schedule not in SCHEDULES:
        raise ValueError(
            f"`{_VERB}` got `schedule={schedule!r}`; the schedules are "
            f"{', '.join(map(repr, SCHEDULES))}."
        )
    if schedule == "gpipe":
        if counted and repeats > 1:
            raise ValueError(
                f'`{_VERB}` got `schedule="gpipe"` with `repeats={repeats}`: GPipe holds one '
                f'chunk of layers per stage. Pass `schedule="circular", repeats={repeats}` '
                "for the circular schedule, or drop `repeats`."
            )
        return 1 if repeats is None else repeats
    if repeats is None or (counted and repeats < 2):
        raise ValueError(
            f'`{_VERB}` got `schedule="circular"` with `repeats={repeats}`: the circular '
            "schedule holds `repeats` chunks of layers per stage, 2 or more. Pass "
            '`repeats=2` (or more), or `schedule="gpipe"` for one chunk per stage.'
        )
    return repeats


def filter_pipeline(
    layer: Callable[[Any, Any], Any],
    blocks: PyTree,
    x: PyTree,
    *,
    mesh: Mesh | AbstractMesh | None = None,
    axis: str = "stage",
    microbatches: int,
    schedule: str | None = None,
    repeats: int | None = None,
    remat: str | None = None,
) -> PyTree:
    """Runs a stack of layers as a pipeline over the mesh axis `axis`: each stage holds
    only its own layers, the batch is cut into microbatches, and activations pass from
    stage to stage by collective permutes.

    Returns what `jax.lax.scan(lambda h, b: (layer(b, h), None), x, blocks)[0]` returns,
    with the same gradients with respect to `blocks` and `x`, eagerly and inside `jax.jit`
    / `eqxshard.filter_jit` / `eqx.filter_jit`. The layer dim of `blocks` is split over
    `axis` (`S` stages): stage `s` runs layers `s*n/S ..` (`schedule="gpipe"`) or, for
    `schedule="circular", repeats=R`, the chunks `c` of `n/(S*R)` layers with
    `c % S == s` (a microbatch goes round the stages `R` times, and the idle time, the
    bubble, falls from `(S-1)/(M+S-1)` to `(S-1)/(M*R+S-1)`). For `R > 1` a stack
    split contiguously over the stages is first regrouped by one all-to-all of each
    stage's weights (in the forward pass, and once more for their gradients; padded to
    `S*ceil(R/S)` chunks, so twice the stage's weights for `R=2, S=4`); a circular
    `eqxshard.Stacked` stores its stack stage-major instead and moves no weights. None of
    the stacked weights is ever gathered whole. The mesh's other axes stay under the
    compiler: a batch split over `"data"` stays split (microbatch `m` is rows `m, m+M,
    ...`), and each stage's weights keep their layout over `"fsdp"`/`"model"` axes (lay
    them out with `eqxshard.stages(axis)` in `first(...)` with other rules).

    Microbatches fewer than the stages are refused (the pipeline would mostly idle, and
    the circular schedule needs `M >= S`). A batch not split over the mesh's data axes
    (those named like `"data"`, `"fsdp"`, `"batch"`) whose microbatches those axes cannot
    split either (batch 20, `microbatches=4`, `data=2`: rows of 5) runs replicated over
    them, each device doing all the work: the result is right, so this is a
    `FallbackWarning` (not an error) naming the sizes and a batch that splits.

    **Arguments:**

    - `layer`: `layer(block, h) -> h`, one layer: `block` is one layer's slice of `blocks`
        (its non-array leaves as they are), `h` a PyTree of arrays like `x` (a microbatch
        of it), and the result has the structure, shapes and dtypes of `h`.
    - `blocks`: a PyTree whose array leaves share a leading layer dim `n`, typically
        `eqx.filter_vmap(make_block)(jax.random.split(key, n))`; its non-array leaves are
        shared by every layer.
    - `x`: an array, or a PyTree of arrays, with a leading batch dim.
    - `mesh`: the mesh with the stage axis. `None` (default) uses the mesh set by
        `jax.set_mesh`.
    - `axis`: the name of the mesh axis the stages are laid out over (default `"stage"`).
    - `microbatches`: how many pieces the batch is cut into (`M >= S`; the larger, the
        smaller the bubble and each piece).
    - `schedule`: which layers each stage runs:
        - `"gpipe"` (default): each stage its `n/S` consecutive layers, once per microbatch;
        - `"circular"`: each stage `repeats` chunks of layers, visited in turn.
    - `repeats`: with `schedule="circular"`, how many chunks of layers each stage holds
        (2 or more). Without `schedule`, a `repeats` above 1 still picks the circular
        schedule, with a `DeprecationWarning`.
    - `remat`: what each layer keeps for the backward pass:
        - `None` or `"none"`: everything (the most memory, no recomputation);
        - `"dots"`: the outputs of matmuls without batch dims; the rest is recomputed;
        - `"full"`: nothing; the whole layer is recomputed;
        - `"offload"`: matmul outputs moved to host memory (`pinned_host`) and back
            (jax 0.8 or newer on CPU devices).

    **Returns:**

    The output of the last layer: a PyTree with the structure, shapes and dtypes of `x`.

    **Raises:**

    - `ValueError`: if no mesh is given or set; `axis` is not an axis of the mesh; the
        array leaves of `blocks` (each named) do not share a leading dim, or there are
        none; `n` is not divisible by stages x `repeats`; the leaves of `x` (each named)
        do not share a leading dim, or it is not divisible by `microbatches` times the
        data-parallel parts `x` is split into; `microbatches` or `repeats` is below 1;
        `microbatches` is fewer than the stages; `schedule` is not one named above,
        `"gpipe"` with `repeats` above 1, or `"circular"` without `repeats` of 2 or more;
        `remat` is not a policy named above, or `"offload"` on devices without a host
        memory.
    - `TypeError`: if `layer` is not callable, `mesh` is not a mesh, `microbatches` or
        `repeats` is not an int, or `x` has non-array leaves (each named).

    **Warns:**

    - `eqxshard.FallbackWarning`: if the microbatches do not split over the mesh's data
        axes, which then each run every row.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "stage"), axis_types=auto)
        n = 2 * mesh.shape["stage"]  # layers
        make = lambda key: eqx.nn.Linear(16, 16, key=key)
        blocks = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), n))
        blocks = eqxshard.filter_shard(blocks, mesh, eqxshard.stages("stage"))
        x = jnp.ones((32, 16))

        @eqx.filter_jit
        def run(blocks, x):
            layer = lambda block, h: jax.nn.tanh(jax.vmap(block)(h))
            return eqxshard.filter_pipeline(layer, blocks, x, mesh=mesh, microbatches=8)

        y = run(blocks, x)  # as jax.lax.scan over the n layers gives
        ```
    """
    chunks = _repeats(schedule, repeats)
    watch.note((axis, microbatches, chunks), blocks, mesh, _VERB)
    return run_pipeline(
        _VERB,
        layer,
        blocks,
        x,
        mesh=mesh,
        axis=axis,
        microbatches=microbatches,
        repeats=chunks,
        remat=remat,
        stage_major=False,
    )
