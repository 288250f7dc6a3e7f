"""The `remat` policies of a layer stack's (or a pipeline's) layers: what each layer keeps
for the backward pass and what it recomputes. One table for every verb here, so that
`remat="dots"` means the same everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

POLICIES = ("none", "dots", "full", "offload")


def check_remat(verb: str, remat: Any, mesh: Mesh | AbstractMesh | None) -> str:
    """`remat` as one of `POLICIES` (`None` is `"none"`), or a `ValueError` naming them."""
    if remat is None:
        return "none"
    if not isinstance(remat, str) or remat not in POLICIES:
        raise ValueError(
            f"`{verb}(remat=...)` takes one of {', '.join(repr(p) for p in POLICIES)} or "
            f"`None`, but got {remat!r}. 'none' keeps every activation, 'dots' keeps the "
            "matmul outputs and recomputes the rest, 'full' recomputes everything, "
            "'offload' moves the matmul outputs to host memory."
        )
    del mesh  # which memories the mesh's devices have: checked where the pipeline runs
    return remat


def with_remat(step: Callable[..., Any], remat: str) -> Callable[..., Any]:
    """`step` (one layer) under `jax.checkpoint` with the policy `remat` names."""
    policies = jax.checkpoint_policies
    if remat == "none":
        return step
    if remat == "full":
        policy = policies.nothing_saveable
    elif remat == "dots":
        policy = policies.dots_with_no_batch_dims_saveable
    else:
        policy = policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return jax.checkpoint(step, policy=policy)
