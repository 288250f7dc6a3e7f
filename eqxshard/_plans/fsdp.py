"""`fsdp(axis)`: a rule that splits each leaf along its largest dim the axis divides."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .._placement.targets import RuleError
from .._tree import Path, did_you_mean, shape_str
from .rules import Rule


class FSDP(Rule):
    """Each leaf split along its largest dim divisible by the axis size; see `fsdp`."""

    def __init__(self, axis: str | tuple[str, ...], min_size: int):
        self.axis, self.min_size = axis, min_size
        self.names = (axis,) if isinstance(axis, str) else tuple(axis)

    def match(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> Any:
        sizes = dict(mesh.shape)
        missing = [n for n in self.names if n not in sizes]
        if missing:
            # The fix leads (the same for every leaf); the leaves follow, then it again.
            guess = did_you_mean(missing[0], list(sizes))
            raise RuleError(
                f"was given `fsdp` over mesh axes {missing} that the mesh lacks: the mesh has "
                f"axes {tuple(sizes)}.{guess} Pass `fsdp(axis=...)` one of them. The "
                "leaves it was asked to lay out:",
                (),
                "Pass `fsdp(axis=...)` one of the mesh's axis names (or a tuple of them).",
            )
        parts = math.prod(sizes[n] for n in self.names)
        shape = tuple(leaf.shape)
        if not shape or math.prod(shape) < self.min_size or parts == 1:
            return PartitionSpec()
        fits = [d for d in range(len(shape)) if shape[d] >= parts and shape[d] % parts == 0]
        if not fits:
            raise RuleError(
                f"cannot split these leaves with `fsdp`: no dim is divisible by {parts} "
                f"(mesh axes {self.names}):",
                (f"shape {shape_str(shape)}", f"{math.prod(shape)} elements"),
                f"Pad a dim of each to a multiple of {parts}, raise `min_size` above their size "
                "to replicate them, or give them a spec with a rule before `fsdp` "
                "(`path_rules([...]) | fsdp(...)`).",
            )
        best = max(fits, key=lambda d: (shape[d], -d))  # the largest; on a tie, the first
        return PartitionSpec(*([None] * best), self.axis)

    def replicated_because(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> str | None:
        sizes = dict(mesh.shape)
        parts = math.prod(sizes.get(n, 1) for n in self.names)
        shape = tuple(leaf.shape)
        if parts == 1:
            return f"{self!r}: mesh axes {self.names} have size 1"
        if not shape:
            return f"{self!r}: scalars"
        if math.prod(shape) < self.min_size:
            if not any(d >= parts and d % parts == 0 for d in shape):
                return f"{self!r}: fewer than `min_size` elements, and no dim divisible by {parts}"
            return f"{self!r}: fewer than `min_size` elements"
        return None

    def __repr__(self) -> str:
        return f"fsdp(axis={self.axis!r}, min_size={self.min_size})"


def fsdp(axis: str | tuple[str, ...] = "data", *, min_size: int = 2**14) -> FSDP:
    """A rule for fully sharded data parallelism: each leaf split along one dim over `axis`.

    Each array leaf with at least `min_size` elements is split along its largest dim that
    the size of `axis` divides (on a tie, the first such dim); every other dim stays whole.
    Smaller leaves, and scalars, are replicated: splitting them saves little memory and
    costs a collective each. A leaf of at least `min_size` elements with no dim divisible
    by the axis size is an error listing every such leaf (pad it, raise `min_size`, or give
    it a spec with a rule placed before `fsdp`).

    **Arguments:**

    - `axis`: the mesh axis to split over (default `"data"`), or a tuple of axes to split
        one dim over all of them (their sizes multiply).
    - `min_size`: leaves with fewer elements than this are replicated (default `2**14`,
        i.e. 64 KiB of float32). `0` splits every leaf that can be split.

    **Returns:**

    A `Rule`, to pass as a `spec`.

    **Raises:**

    - `TypeError`: if `axis` is not a string or a tuple of strings, or `min_size` is not an
        int.
    - `ValueError`: if `min_size` is negative; when resolved, for leaves of at least
        `min_size` elements with no dim divisible by the axis size, or an `axis` the mesh
        lacks.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        model = eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))
        model = eqxshard.filter_shard(model, mesh, eqxshard.fsdp("data"))
        ```
    """
    names = (axis,) if isinstance(axis, str) else axis
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"`fsdp` takes `axis` as a mesh axis name or a tuple of them, but got {axis!r}."
        )
    if isinstance(min_size, bool) or not isinstance(min_size, int):
        raise TypeError(f"`fsdp` takes `min_size` as an int (elements), but got {min_size!r}.")
    if min_size < 0:
        raise ValueError(f"`fsdp` takes `min_size` >= 0 (elements), but got {min_size}.")
    return FSDP(axis, min_size)
