"""A function written per example that sees the whole batch under `jax.vmap`.

Equinox models are written per example and batched from outside by `jax.vmap`, while a
pipeline needs the batch itself, to cut it into microbatches. `jax.custom_batching.
custom_vmap` gives the function a batching rule: `vmap` hands the rule the batched
arguments, and the rule runs the batch-level program on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from ... import _compat


def batched_call(
    per_example: Callable[[Any, Any], Any],
    on_batch: Callable[[Any, Any], Any],
    params: Any,
    h: Any,
) -> Any:
    """`per_example(params, h)`, where an enclosing `vmap` batches `h`: the `vmap` runs
    `on_batch(params, h_batch)` once on the whole batch (batch dim first) instead.

    `on_batch` must compute what `jax.vmap(per_example, (None, 0))` would. Leaves of `h`
    the `vmap` does not batch (a key shared by every example, say) are repeated along the
    batch first. Where the `vmap` also batches `params` (a `vmap` over models), there is no
    single batch to hand over and `per_example` is vmapped as usual.
    """
    function = custom_vmap(per_example)

    def rule(axis_size: int, in_batched: list[Any], params: Any, h: Any) -> tuple[Any, Any]:
        params_batched, h_batched = in_batched
        if any(jax.tree.leaves(params_batched)):
            axes = jax.tree.map(lambda b: 0 if b else None, (params_batched, h_batched))
            out = jax.vmap(per_example, in_axes=axes)(params, h)
        else:
            repeat = lambda a: jnp.broadcast_to(a, (axis_size, *a.shape))  # noqa: E731
            h = jax.tree.map(lambda a, b: a if b else repeat(a), h, h_batched)
            out = on_batch(params, h)
        return out, jax.tree.map(lambda _: True, out)

    function.def_vmap(rule)
    return function(params, h)


def batching_of(h: Any) -> str:
    """`"innermost"`, `"beneath"` or `"none"`: how a `vmap` batches `h`'s leaves (see
    `_compat.vmap_batching`)."""
    return _compat.vmap_batching(jax.tree.leaves(h))
