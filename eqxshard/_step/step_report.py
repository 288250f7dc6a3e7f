"""The report `describe_step` returns: a compiled step's inputs and outputs with the layout
asked and the one XLA compiled, the work each device does, and what XLA replicates."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import NamedSharding, Sharding

from .._compat import spec_str
from .._tree import format_bytes, shape_str
from .pinned import FIX, PinnedOp


@dataclasses.dataclass(frozen=True)
class StepLeaf:
    """One array input or output of a compiled step.

    - `path`: where it is: `args[0].layers[0].weight` for an input, `out[1]` for an output.
    - `shape`, `dtype`: its global shape and dtype.
    - `asked`: the layout `in_shardings`/`out_shardings` asked for it, or `None`.
    - `compiled`: the layout XLA compiled it with (`None` where JAX does not say).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    asked: Sharding | None
    compiled: Sharding | None

    @property
    def differs(self) -> bool:
        """Whether XLA compiled another layout than the one asked."""
        if self.asked is None or self.compiled is None:
            return False
        return not self.asked.is_equivalent_to(self.compiled, len(self.shape))


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What `describe_step` returns. `print(report)` shows it as text.

    - `inputs`, `outputs`: a `StepLeaf` per array leaf, in the call's order.
    - `devices`: how many devices the step runs on.
    - `flops_per_device`: XLA's count for one device of the compiled step (`None` where
        the backend does not say).
    - `flops`: the count for the whole step before it is split over devices (`None`
        where JAX does not say).
    - `memory`: bytes per device by kind (`argument`, `output`, `alias`, `temp`), from
        `memory_analysis()`; empty where the backend does not say.
    - `pinned`: the ops XLA runs on one device and replicates the result of on every
        device (host callbacks such as `eqx.error_if`), each a `PinnedOp` with `source`,
        `op_name` and the `shapes` replicated.
    """

    inputs: list[StepLeaf]
    outputs: list[StepLeaf]
    devices: int
    flops_per_device: float | None
    flops: float | None
    memory: dict[str, int]
    pinned: list[PinnedOp]

    @property
    def work_fraction(self) -> float | None:
        """The share of the step's flops each device does: `1 / devices` when the work is
        split evenly, `1.0` when every device does all of it."""
        if not self.flops or self.flops_per_device is None:
            return None
        return self.flops_per_device / self.flops

    @property
    def runs_replicated(self) -> bool:
        """Whether each device does (nearly) all of the step's work, on several devices:
        more than halfway from an even split (`1 / devices`) to all of it."""
        fraction = self.work_fraction
        if fraction is None or self.devices <= 1:
            return False
        return fraction > (1 + 1 / self.devices) / 2

    def problems(self) -> list[str]:
        """What is wrong with the compiled step, in words (empty if nothing)."""
        lines = []
        if self.runs_replicated:
            share = f"{self.work_fraction:.0%}"
            lines.append(
                f"XLA runs this step replicated: each of the {self.devices} devices does "
                f"{share} of its work, not 1/{self.devices}; the layouts chosen do not split it."
            )
        if self.pinned:
            ops = "; ".join(
                f"{p.source} on {' '.join(p.shapes)} ({p.op_name})" for p in self.pinned
            )
            lines.append(
                f"XLA runs these on one device and replicates their results on every device "
                f'("Involuntary full rematerialization" on stderr): {ops}. To fix: {FIX}.'
            )
        elif self.runs_replicated:
            lines.append(
                "Split the batch over the mesh (`in_shardings`), or the parameters "
                "(`fsdp`, `path_rules`): with every input whole, every device does all the work."
            )
        differ = [leaf for leaf in self.inputs + self.outputs if leaf.differs]
        if differ:
            names = ", ".join(leaf.path for leaf in differ[:5])
            lines.append(f"XLA compiled another layout than the one asked for: {names}.")
        return lines

    def __str__(self) -> str:
        header = ["", "path", "shape", "dtype", "asked", "compiled"]
        rows = [header] + [
            [
                "!" if leaf.differs else "",
                leaf.path,
                shape_str(leaf.shape),
                leaf.dtype,
                _layout(leaf.asked),
                _layout(leaf.compiled),
            ]
            for leaf in self.inputs + self.outputs
        ]
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.append(self._work())
        if self.memory:
            held = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.memory.items())
            lines.append(f"Bytes per device: {held}.")
        lines.extend(self.problems())
        return "\n".join(lines)

    __repr__ = __str__

    def _work(self) -> str:
        if self.work_fraction is None:
            return f"{self.devices} devices."
        return (
            f"{self.devices} devices; each does {self.work_fraction:.1%} of the step's "
            f"{_flops(self.flops)} (an even split: {1 / self.devices:.1%})."
        )


def _layout(sharding: Any) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, NamedSharding):
        return spec_str(sharding.spec)
    if sharding.is_fully_replicated:
        return "replicated"
    return type(sharding).__name__


def _flops(n: float | None) -> str:
    n = n or 0.0
    for unit, size in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} FLOP"
