"""`describe_step`: a `filter_jit` step compiled for its arguments, and what XLA made of
its layouts (read from the compiled program; the step does not run)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._tree import Flat, is_array_like, pathstr
from . import layouts as _layouts
from .call import _JitWrapper
from .entry import output as _output
from .jit import filter_jit
from .pinned import pinned_ops
from .static import call_path
from .step_report import StepLeaf, StepReport


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

    **Arguments:**

    - `step`: a function wrapped by `eqxshard.filter_jit` (its layouts, donation and
        mesh are used), or any other function (wrapped by `filter_jit()` with none).
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
    wrapper: Any = step if isinstance(step, _JitWrapper) else filter_jit(step)
    lowered = wrapper.lower(*args, **kwargs)
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


def _inputs(wrapper: Any, lowered: Any, compiled: Any, args: tuple, kwargs: dict) -> list:
    bound = wrapper._signature.bind(*args, **kwargs) if wrapper._signature else None
    args, kwargs = (bound.args, bound.kwargs) if bound else (args, kwargs)
    flat = Flat((wrapper._fun, args, kwargs))
    asked = lowered._entry.in_shardings
    got = jax.tree_util.tree_leaves(compiled.input_shardings)
    return _rows(flat, asked, got, call_path)


def _outputs(wrapper: Any, lowered: Any, compiled: Any) -> list:
    abstract = _output(lowered.lowered.out_info)
    flat = Flat(abstract, is_array=is_array_like)
    config = wrapper._config
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
