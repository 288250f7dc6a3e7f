"""The `remat` policies of a pipeline's (or a layer stack's) layers: what each layer keeps for
the backward pass and what it recomputes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from .. import _compat

POLICIES = ("none", "dots", "full", "offload")


def memory_kinds(device: Any) -> set[str]:
    """The memory kinds `device` can address (`device`, `pinned_host`, ...)."""
    return {m.kind for m in device.addressable_memories()}


def check_remat(verb: str, remat: Any, mesh: Mesh | AbstractMesh) -> str:
    """`remat` as one of `POLICIES` (`None` is `"none"`); `"offload"` only where the devices
    of `mesh` have a host memory (`pinned_host`) to offload to."""
    if remat is None:
        return "none"
    if not isinstance(remat, str) or remat not in POLICIES:
        raise ValueError(
            f"`{verb}(remat=...)` takes one of {', '.join(repr(p) for p in POLICIES)} or "
            f"`None`, but got {remat!r}. 'none' keeps every activation, 'dots' keeps the "
            "matmul outputs and recomputes the rest, 'full' recomputes everything, "
            "'offload' moves the matmul outputs to host memory."
        )
    if remat == "offload" and mesh.size > 1 and not _compat.memory_kinds_in_jit():
        raise ValueError(
            f"`{verb}(remat='offload')` moves residuals to host memory inside `jit`, which "
            f"jax {jax.__version__} cannot do in a program split over {jax.default_backend()} "
            "devices (XLA refuses the placement; jax 0.8 and newer can). Upgrade JAX, or "
            "use remat='dots' (keep matmul outputs on the device) or remat='full' "
            "(recompute them)."
        )
    if remat == "offload" and isinstance(mesh, Mesh):
        device = mesh.devices.flat[0]
        kinds = memory_kinds(device)
        if "pinned_host" not in kinds:
            raise ValueError(
                f"`{verb}(remat='offload')` moves residuals to host memory ('pinned_host'), "
                f"but the {device.platform} devices of this mesh have only the memories "
                f"{sorted(kinds)}. Use remat='dots' (keep matmul outputs on the device) or "
                "remat='full' (recompute them) instead."
            )
    return remat


def with_remat(step: Callable[..., Any], remat: str) -> Callable[..., Any]:
    """`step` (one layer) wrapped in `jax.checkpoint` with the policy `remat` names."""
    if remat == "none":
        return step
    if remat == "full":
        policy = jax.checkpoint_policies.nothing_saveable
    elif remat == "dots":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    else:
        policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return jax.checkpoint(step, policy=policy)
