"""Figures for meshes too large to compile here, from a smaller mesh by mesh arithmetic.

The smaller mesh has the same batch per device. Its `data` axis shrinks first (to 1 if
need be): that changes nothing on any one device, only the gradients' all-reduce over
`data`, whose bytes are known (the gradient bytes per device), so the figures stay
exact. Only then do `fsdp` and `model` shrink (kept at 2 or more while they can). A
`stage` axis never shrinks (`dimensions/stage/scaled.py`): each device keeps its layers and
microbatches, and its permutes go to the same neighbours; such a mesh shrinks to its
stage axis with `fsdp` and `model` at 2, so that one compile serves every mesh of as many
stages with the same axes (and the compile is small). What changes, and how:

- parameters, gradients, optimiser state and batch per device: exact, from the large
  mesh's shardings (`filter_shardings` on an `AbstractMesh`);
- activations and other temporaries: as compiled, divided by how much the model axis
  shrank (their model-split parts grow by that factor on the small mesh); temporaries
  split over `fsdp` (the optimiser's update) are overestimated when `fsdp` shrinks;
- flops per device: as compiled, divided by the model axis' shrink factor;
- each collective: over the large mesh's group along the same axes. Its result is the
  same size, except that a reduce-scatter's result shrinks with its group, and a
  collective over `data` or `fsdp` (parameters or gradients) shrinks with the `fsdp`
  and `model` axes it is not over. With `data` shrunk to 1, the gradients' all-reduce
  over `data` is added: the gradient bytes per device over the large `data` axis, and a
  buffer of that size for its result (XLA often allocates one; where it does not, the
  estimate is that much too high, never too low).
"""

from __future__ import annotations

import dataclasses
import math

from ..measure.collectives import Collective
from ..measure.compiled import Measurement


def _smallest_factor(n: int) -> int:
    return next(p for p in range(2, n + 1) if n % p == 0)


def stage_mesh_devices(shape: dict[str, int]) -> int:
    """The devices a mesh with a `stage` axis is compiled on when it is too large: the
    stage axis whole, `fsdp` and `model` at 2 where it has them (their collectives then
    show), `data` at 1 (its all-reduce is added exactly)."""
    return shape["stage"] * 2 ** sum(shape.get(a, 1) > 1 for a in ("fsdp", "model"))


def reduced_shape(shape: dict[str, int], limit: int) -> dict[str, int]:
    """`shape` shrunk by prime factors until it has at most `limit` devices: `data`
    first, then `fsdp` and `model` kept at 2 or more while they can be; `stage` kept,
    and a mesh with one shrunk to `stage_mesh_devices` (one over `limit` is not scaled:
    `dimensions.stage.scaled.compilable`)."""
    small = dict(shape)
    if "stage" in shape:  # one compile for every mesh of this many stages and axes
        limit = min(limit, stage_mesh_devices(shape))
    while math.prod(small.values()) > limit:
        if small.get("data", 1) > 1:
            axis = "data"
        else:
            axes = [a for a in ("fsdp", "model") if small.get(a, 1) > 1]
            keep = [a for a in axes if small[a] // _smallest_factor(small[a]) >= 2]
            axis = (keep or axes)[0]
        small[axis] //= _smallest_factor(small[axis])
    return small


def scale(
    small: Measurement,
    small_shape: dict[str, int],
    shape: dict[str, int],
    exact: dict[str, tuple[int, int]],
) -> tuple[dict[str, int], float, tuple[Collective, ...]]:
    """Bytes per device by part, flops and collectives of `shape` from a compile on
    `small_shape`. `exact` holds the parts known without compiling (parameters,
    gradients, optimizer state, batch) as `{part: (on small, on large)}`."""
    shrink = {a: shape[a] / small_shape[a] for a in shape}
    model = shrink.get("model", 1.0)
    rest = max(small.total - sum(v[0] for v in exact.values()), 0) / model
    parts = {k: v[1] for k, v in exact.items()}
    parts["activations"] = int(rest)
    flops = small.flops / model
    scaled = []
    for c in small.collectives:
        factor = 1.0
        if c.kind == "reduce-scatter":
            factor /= math.prod(shrink[a] for a in c.axes)
        if set(c.axes) & {"data", "fsdp"}:
            others = [a for a in ("fsdp", "model") if a in shrink and a not in c.axes]
            factor /= math.prod(shrink[a] for a in others)
        group = math.prod(shape[a] for a in c.axes) if c.axes else c.group_size
        scaled.append(dataclasses.replace(c, bytes=int(c.bytes * factor), group_size=group))
    if shape.get("data", 1) > 1 and small_shape.get("data", 1) == 1 and "gradients" in exact:
        grads = exact["gradients"][1]
        scaled.append(Collective("all-reduce", grads, ("data",), shape["data"]))
        parts["activations"] += grads  # XLA often gives that all-reduce its own buffer
    return parts, flops, tuple(scaled)
