"""`pipeline_value_and_grad`: a training step's value and gradients through a layer stack
run as an MPMD pipeline (each stage its own program on its own devices), in the 1F1B
order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from ..._placement.put import filter_put
from .. import checks, watch
from ..remat import check_remat
from .checks import check_concrete, check_mpmd, check_scalar_loss, check_targets
from .driver import run_mpmd
from .ticks import SCHEDULES

_VERB = "pipeline_value_and_grad"


def _like_x(grad: Any, x: Any) -> Any:
    """`grad` laid out as `x` where `x`'s leaves are `jax.Array`s (else where it is)."""
    target = jax.tree.map(lambda a: a.sharding if isinstance(a, jax.Array) else None, x)
    return filter_put(grad, target) if any(jax.tree.leaves(target)) else grad


def pipeline_value_and_grad(
    layer: Callable[[Any, Any], Any],
    blocks: PyTree,
    x: PyTree,
    loss: Callable[..., Any],
    *,
    targets: PyTree = None,
    mesh: Mesh | None = None,
    axis: str = "stage",
    microbatches: int,
    remat: str | None = None,
    schedule: str = "1f1b",
    on_tick: Callable[[list[int], list[int]], object] | None = None,
) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
    """The value of a loss over a layer stack's output and its gradients with respect to
    the stack and the input, run as an MPMD pipeline in the 1F1B order: each stage is its
    own compiled program on its own devices, and each holds at most `S` microbatches'
    residuals at a time (`S` stages) where GPipe holds all `M`.

    Stage `s` runs layers `s*n/S ..` on the devices of index `s` of the mesh axis `axis`
    (with the mesh's other axes, e.g. a batch split over `"data"`). The batch is cut into
    `microbatches` (microbatch `m` is rows `m, m+M, ...`, as `filter_pipeline` cuts it);
    each stage runs one forward per microbatch (`jax.vjp` of its layers, the last stage's
    with `loss`) and one backward, and `eqxshard.filter_put` moves activations to the next
    stage's devices and cotangents to the previous one's. In the `"1f1b"` order stage `s`
    runs `S-s-1` forwards, then one forward and one backward in turn, then the backwards
    left; a backward frees the residuals its forward kept. Each stage's forward and
    backward compile once and are cached across calls (keyed as `eqx.filter_jit` keys:
    by `layer`, `loss` and the non-array part of `blocks`).

    The value is the mean over microbatches of `loss(y_m)` (`loss(y_m, t_m)` with
    `targets`), so for a loss that is a mean over rows it is `loss(y)` of the whole
    output `y = jax.lax.scan(lambda h, b: (layer(b, h), None), x, blocks)[0]`, and the
    gradients are `jax.value_and_grad`'s of that, to float32 summation order.

    It runs outside `jit` (it drives the stages' programs from Python): call it as the
    step itself and give its gradients to the optimiser.

    **Arguments:**

    - `layer`: `layer(block, h) -> h`, one layer (as for `filter_pipeline`).
    - `blocks`: the layer stack, as for `filter_pipeline`, its `n` divisible by the
        stages. Laid out over `axis` with `eqxshard.stages(axis)` it moves nothing;
        otherwise it is laid out so first.
    - `x`: the input, as for `filter_pipeline`: its batch divisible by `microbatches` (times
        the parts of a split over data-parallel axes).
    - `loss`: `loss(y) -> scalar` on a microbatch `y` of the last layer's output, or
        `loss(y, t) -> scalar` with `targets`.
    - `targets`: `None`, or arrays with the batch of `x` leading, cut as `x` is and handed
        to `loss` on the last stage.
    - `mesh`: as for `filter_pipeline`, but a `jax.sharding.Mesh` (its devices run the
        stages), not an abstract one.
    - `axis`: the mesh axis of the stages, as for `filter_pipeline` (default `"stage"`).
    - `microbatches`: how many pieces the batch is cut into, as for `filter_pipeline`.
    - `remat`: each layer's `remat` policy, as for `filter_pipeline`.
    - `schedule`: `"1f1b"` (default), or `"gpipe"` (every forward, then every backward:
        the same values, `M` microbatches' residuals held per stage; for comparison).
    - `on_tick`: `None`, or `on_tick(held, held_bytes)`, called after each tick (each
        stage's next forward or backward) with, per stage, how many microbatches'
        residuals it holds and their bytes on its fullest device: to measure memory.

    **Returns:**

    `(value, (grad_blocks, grad_x))`: the scalar loss (on the last stage's devices), the
    gradient of `blocks` (a PyTree like `blocks` with `None` at its non-array leaves, laid
    out over `axis` as the stack is) and the gradient of `x` (laid out as `x` where `x`
    holds `jax.Array`s).

    **Raises:**

    - `ValueError`: everything `filter_pipeline` raises for its arguments (with
        `repeats=1`); a mesh without devices; `loss` returning other than a scalar;
        `schedule` not one named above; array leaves that are traced (inside `jit`,
        `grad` or `vmap`), each named; leaves of `targets` whose leading dim is not the
        batch, each named.
    - `TypeError`: everything `filter_pipeline` raises for its types; `loss` or `on_tick`
        not callable; non-array leaves of `targets`, each named.

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import jax.numpy as jnp
        import optax
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "stage"), axis_types=auto)
        make = lambda key: eqx.nn.Linear(16, 16, key=key)
        keys = jax.random.split(jax.random.key(0), 2 * mesh.shape["stage"])  # 2 layers a stage
        blocks = eqx.filter_vmap(make)(keys)
        blocks = eqxshard.filter_shard(blocks, mesh, eqxshard.stages("stage"))
        x, t = jnp.ones((32, 16)), jnp.zeros((32, 16))
        optimiser = optax.sgd(0.1)
        state = optimiser.init(eqx.filter(blocks, eqx.is_array))

        layer = lambda block, h: jax.nn.tanh(jax.vmap(block)(h))
        loss = lambda y, t: jnp.mean((y - t) ** 2)
        value, (grads, _) = eqxshard.pipeline_value_and_grad(
            layer, blocks, x, loss, targets=t, mesh=mesh, microbatches=8
        )
        updates, state = optimiser.update(grads, state)
        blocks = eqx.apply_updates(blocks, updates)  # one training step
        ```
    """
    watch.note((axis, microbatches, 1), blocks, mesh, _VERB)
    checks.check_layer(_VERB, layer)
    found = checks.get_mesh(_VERB, mesh, axis)
    check_mpmd(_VERB, loss, schedule, SCHEDULES, found, on_tick)
    assert isinstance(found, Mesh)
    mesh = found
    stages = dict(mesh.shape)[axis]
    checks.check_counts(_VERB, microbatches, 1, stages)
    checks.check_blocks(_VERB, blocks, stages, 1)
    check_concrete(_VERB, blocks=blocks, x=x, targets=targets)
    batch, batch_axes = checks.batch_size(_VERB, x, mesh, axis, microbatches)
    check_targets(_VERB, targets, batch)
    check_scalar_loss(_VERB, loss, x, targets, microbatches)
    policy = check_remat(_VERB, remat, mesh)
    weights, static = eqx.partition(blocks, eqx.is_array)
    value, grad_w, grad_x = run_mpmd(
        layer,
        weights,
        static,
        x,
        loss,
        targets,
        mesh=mesh,
        axis=axis,
        microbatches=microbatches,
        batch_axes=batch_axes,
        policy=policy,
        schedule=schedule,
        on_tick=on_tick,
    )
    return value, (grad_w, _like_x(grad_x, x))
