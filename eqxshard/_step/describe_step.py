"""`describe_step`: a `filter_jit` step compiled for its arguments, and what XLA made of
its layouts (read from the compiled program; the step does not run), in the `StepReport`
it returns: each input and output with the layout asked and the one XLA compiled, the
work each device does, and what XLA replicates."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding

from .._compat import spec_str
from .._tree import Flat, format_bytes, is_array_like, pathstr, shape_str
from . import layouts as _layouts
from .entry import output as _output
from .jit import JitWrapper, Lowered, filter_jit
from .leaves import call_path
from .pinned import FIX, PinnedOp, pinned_ops


def describe_step(step: Callable[..., Any], /, *args: Any, **kwargs: Any) -> StepReport:
    """Compiles `step` for these arguments and reports what XLA made of its layouts.

    Each array input and output is listed by path with the layout asked
    (`in_shardings`/`out_shardings`) and the one XLA compiled. Below: the share of the
    step's work each device does (XLA's flops for one device of the compiled program
    against the whole step's), bytes per device, and what is wrong, if anything:

    - a step XLA runs replicated, each device doing (nearly) all the work: the layouts
        chosen do not split it, so more devices will not make it faster;
    - ops XLA runs on one device and replicates on every device, e.g. `eqx.error_if` in
        the loss (a host callback; XLA only says "Involuntary full rematerialization" on
        stderr), with what to change;
    - outputs XLA compiled in another layout than asked.

    The step does not run: it is lowered and compiled for these arguments (laid out as
    `in_shardings` asks first, as a call would; JAX's compile cache then spares a later
    call the compile).

    It is the call that gives a step's whole footprint on each device, what to size a
    budget by (`eqxshard.describe` counts the leaves of a tree only):
    `report.total_bytes`, and `report.footprint()` by part: each argument (the model,
    the optimiser state, the batch), the outputs that do not reuse a donated input, and
    the temporaries (the gradients and activations among them).

    **Arguments:**

    - `step`: a function wrapped by `eqxshard.filter_jit` (its layouts, donation and
        mesh are used); a step from `Plan.jit` (the `filter_jit` it runs for these
        arguments); or any other function (wrapped by `filter_jit()` with none).
    - `*args`, `**kwargs`: the arguments of a call, e.g. the model, optimiser state and
        batch, as arrays (not `jax.ShapeDtypeStruct`s: `filter_jit` holds those static).

    **Returns:**

    A `StepReport`; `print(report)` shows it, `report.runs_replicated` and
    `report.pinned` say what is wrong, `report.problems()` in words.

    **Raises:**

    - `TypeError`: if `step` is not callable.
    - The errors of a `filter_jit` call of `step` with these arguments (layouts that do
        not fit them, unhashable static leaves, ...), raised before anything compiles.

    !!! Example

        ```python
        from jax.sharding import PartitionSpec as P

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        model = eqx.nn.MLP(32, 10, 64, 2, key=jax.random.key(0))

        @eqxshard.filter_jit(in_shardings=(P(), P("data")), mesh=mesh)
        def loss(model, x):
            x = eqx.error_if(x, jnp.isnan(x), "NaN input")  # pins x to one device
            return jnp.mean(jax.vmap(model)(x) ** 2)

        report = eqxshard.describe_step(loss, model, jnp.ones((8 * jax.device_count(), 32)))
        print(report)
        assert report.pinned  # `eqx.error_if` on f32[..., 32]
        ```
    """
    if not callable(step):
        raise TypeError(
            f"`describe_step` takes a function (a `filter_jit` step), but got "
            f"{type(step).__name__}."
        )
    wrapper, lowered = _lowered(step, args, kwargs)
    compiled = lowered.compile().compiled
    return StepReport(
        inputs=_inputs(wrapper, lowered, compiled, args, kwargs),
        outputs=_outputs(wrapper, lowered, compiled),
        devices=_devices(compiled),
        flops_per_device=_flops(compiled.cost_analysis),
        flops=_flops(lowered.lowered.cost_analysis),
        memory=_memory(compiled),
        pinned=pinned_ops(compiled.as_text()),
    )


def _lowered(step: Any, args: tuple, kwargs: dict) -> tuple[JitWrapper, Lowered]:
    """The `filter_jit` wrapper `step` runs for these arguments, and its call lowered: its
    own; that of a step whose `lower` gives a `filter_jit` call's (`Plan.jit`'s, which
    picks one by the arguments); else a `filter_jit()` of `step`."""
    if isinstance(step, JitWrapper):
        return step, step.lower(*args, **kwargs)
    if not isinstance(step, jax.stages.Wrapped) and callable(getattr(step, "lower", None)):
        lowered = step.lower(*args, **kwargs)
        if isinstance(lowered, Lowered):
            return lowered.wrapper, lowered
    wrapper: Any = filter_jit(step)
    return wrapper, wrapper.lower(*args, **kwargs)


def _inputs(wrapper: Any, lowered: Any, compiled: Any, args: tuple, kwargs: dict) -> list:
    args, kwargs = wrapper.bind(args, kwargs)
    flat = Flat((wrapper.fun, args, kwargs))
    asked = lowered.entry.in_shardings
    got = jax.tree_util.tree_leaves(compiled.input_shardings)
    return _rows(flat, asked, got, call_path)


def _outputs(wrapper: Any, lowered: Any, compiled: Any) -> list:
    abstract = _output(lowered.lowered.out_info)
    flat = Flat(abstract, is_array=is_array_like)
    config = wrapper.config
    asked: dict[int, Any] = {}
    if config.out_shardings is not None:
        asked = _layouts.resolve_layouts(
            abstract, config.out_shardings, mesh=config.mesh, argname="out_shardings"
        )
    got = jax.tree_util.tree_leaves(compiled.output_shardings)
    return _rows(flat, asked, got, lambda path: pathstr(path, "out"))


def _rows(flat: Flat, asked: dict[int, Any], got: list, name: Callable[[Any], str]) -> list:
    """A `StepLeaf` per array leaf of `flat`: its layout asked (by leaf index) and compiled
    (by its place among the array leaves)."""
    return [
        StepLeaf(
            path=name(flat.paths[i]),
            shape=tuple(flat.leaves[i].shape),
            dtype=str(flat.leaves[i].dtype),
            asked=asked.get(i),
            compiled=got[n] if n < len(got) else None,
        )
        for n, i in enumerate(flat.array_indices)
    ]


def _devices(compiled: Any) -> int:
    shardings = jax.tree_util.tree_leaves((compiled.input_shardings, compiled.output_shardings))
    return max((len(s.device_set) for s in shardings), default=1)


def _flops(cost_analysis: Callable[[], Any]) -> float | None:
    try:
        cost = cost_analysis()
    except Exception:  # a backend without cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return None if flops is None else float(flops)


def _memory(compiled: Any) -> dict[str, int]:
    try:
        m = compiled.memory_analysis()
    except Exception:  # a backend without memory analysis
        return {}
    if m is None:
        return {}
    return {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
    }


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
    def bytes_per_device(self) -> int:
        """Its bytes on one device, in the layout compiled (or asked; whole without)."""
        sharding = self.compiled or self.asked
        shape = self.shape if sharding is None else sharding.shard_shape(self.shape)
        return math.prod(shape) * _itemsize(self.dtype)

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
    - `total_bytes` (a property): bytes per device of the whole step: arguments and
        outputs (less the outputs that reuse a donated argument's buffer) and temporaries;
        `None` where the backend does not say.
    """

    inputs: list[StepLeaf]
    outputs: list[StepLeaf]
    devices: int
    flops_per_device: float | None
    flops: float | None
    memory: dict[str, int]
    pinned: list[PinnedOp]

    @property
    def total_bytes(self) -> int | None:
        m = self.memory
        if not m:
            return None
        return m["argument"] + m["output"] - m["alias"] + m["temp"]

    def footprint(self) -> dict[str, int]:
        """Bytes per device by part, adding up to `total_bytes`: each argument's leaves
        (`args.0`, `args.1`, ..., `kwargs.x`, as leaf paths print), `outputs` (those that
        do not reuse a donated argument's buffer), `temporaries` (the gradients, the activations and
        every other buffer the step holds while it runs) and, where the compiled
        arguments differ from their leaves' sum (padding), `other`. Empty where the
        backend does not say."""
        total = self.total_bytes
        if total is None:
            return {}
        parts: dict[str, int] = {}
        for leaf in self.inputs:
            found = _ARGUMENT.match(leaf.path)
            name = found.group(0) if found else leaf.path
            parts[name] = parts.get(name, 0) + leaf.bytes_per_device
        parts["outputs"] = self.memory["output"] - self.memory["alias"]
        parts["temporaries"] = self.memory["temp"]
        other = total - sum(parts.values())
        if other:
            parts["other"] = other
        return parts

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
            parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.footprint().items())
            lines.append(
                f"Bytes per device: {format_bytes(self.total_bytes or 0)} in all ({parts}; "
                f"temporaries hold the gradients and activations); memory_analysis: {held}."
            )
        lines.extend(self.problems())
        return "\n".join(lines)

    __repr__ = __str__

    def _work(self) -> str:
        if self.work_fraction is None:
            return f"{self.devices} devices."
        return (
            f"{self.devices} devices; each does {self.work_fraction:.1%} of the step's "
            f"{_flops_str(self.flops)} (an even split: {1 / self.devices:.1%})."
        )


# The argument a leaf's path starts with: `args[0]`, `kwargs['x']`.
_ARGUMENT = re.compile(r"(args|kwargs)\.[^.]+")


def _itemsize(dtype: str) -> int:
    try:
        return jax.numpy.dtype(dtype).itemsize
    except TypeError:  # a key array's dtype (`key<fry>`): its data's
        return 8


def _layout(sharding: Any) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, NamedSharding):
        return spec_str(sharding.spec)
    if sharding.is_fully_replicated:
        return "replicated"
    return type(sharding).__name__


def _flops_str(n: float | None) -> str:
    n = n or 0.0
    for unit, size in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} FLOP"
