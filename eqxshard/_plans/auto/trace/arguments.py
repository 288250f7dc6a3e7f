"""`auto_plan`'s arguments checked, before any long work: devices, budget, step, batch."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh

from ...._pipeline.stacked.configure import stacks
from ...._pipeline.watch import watching
from ...._tree import format_bytes, is_array_like, pathstr
from . import own_pipeline

# Without `budget=`, this fraction of the device's memory (`bytes_limit`) is left free,
# for the runtime, the data pipeline and fragmentation.
HEADROOM = 0.1

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def resolve_devices(devices: Any) -> tuple[int, list[Any]]:
    """The device count asked for, and the devices of this process a mesh may use."""
    if isinstance(devices, bool):
        pass
    elif isinstance(devices, int):
        if devices >= 1:
            return devices, list(jax.devices())
        raise ValueError(f"`auto_plan` takes `devices` >= 1, but got {devices}.")
    elif isinstance(devices, AbstractMesh):
        return devices.size, list(jax.devices())
    elif isinstance(devices, Sequence) and devices and all(isinstance(d, int) for d in devices):
        if all(d >= 1 for d in devices) and not any(isinstance(d, bool) for d in devices):
            return math.prod(devices), list(jax.devices())
    elif (
        isinstance(devices, Sequence)
        and devices
        and all(isinstance(d, jax.Device) for d in devices)
    ):
        if len(set(devices)) == len(devices):
            return len(devices), list(devices)
        raise ValueError("`auto_plan` got the same device more than once in `devices`.")
    raise TypeError(
        "`auto_plan` takes `devices` as a count (`512`), a list of `jax.Device`s, a mesh "
        f"shape (`(64, 8)`) or an `AbstractMesh`, but got {devices!r}."
    )


def resolve_budget(budget: Any, devices: list[Any]) -> int:
    """Bytes per device: `budget`, or the device's memory less `HEADROOM`."""
    if budget is None:
        stats = devices[0].memory_stats() if devices else None
        limit = None if stats is None else stats.get("bytes_limit")
        if not limit:
            raise ValueError(
                "`auto_plan` needs a `budget`: JAX does not report how much memory a "
                f"{devices[0].platform!r} device has (`memory_stats()` is {stats!r}). Pass "
                '`budget=` in bytes per device of the accelerator you plan for, e.g. "80GB".'
            )
        return int(limit * (1 - HEADROOM))
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", budget)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"`auto_plan` could not read `budget={budget!r}`: write a number and a unit "
                '(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. "16GiB" or "80GB".'
            )
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    elif isinstance(budget, int | float) and not isinstance(budget, bool):
        value = budget
    else:
        raise TypeError(
            "`auto_plan` takes `budget` as bytes per device (an int) or a string such as "
            f'"16GiB", but got {type(budget).__name__}.'
        )
    if not 0 < value < math.inf:
        raise ValueError(
            f"`auto_plan` takes `budget` as a finite number > 0 of bytes per device, but got "
            f"{budget!r}."
        )
    return int(value)


def check_flops(flops_per_second: Any) -> None:
    """Raises unless `flops_per_second` is a finite number > 0."""
    if isinstance(flops_per_second, bool) or not isinstance(flops_per_second, int | float):
        raise TypeError(
            "`auto_plan` takes `flops_per_second` as a number (e.g. `4e14`), but got "
            f"{type(flops_per_second).__name__}."
        )
    if not 0 < flops_per_second < math.inf:
        raise ValueError(
            "`auto_plan` takes `flops_per_second` as a finite number > 0 (what one device "
            f"computes per second, e.g. `4e14`), but got {flops_per_second!r}."
        )


def batch_size(batch: Any) -> int:
    """The leading dim every array leaf of `batch` shares."""
    entries = jax.tree_util.tree_flatten_with_path(batch, is_leaf=is_array_like)[0]
    arrays = [(p, x) for p, x in entries if is_array_like(x)]
    if not arrays:
        raise ValueError("`auto_plan` takes a `batch` with at least one array leaf, but got none.")
    sizes = {x.shape[0] if x.shape else None for _, x in arrays}
    if len(sizes) != 1 or None in sizes:
        rows = "\n".join(f"  {pathstr(p)}  shape {tuple(x.shape)}" for p, x in arrays)
        raise ValueError(
            "`auto_plan` takes a `batch` whose array leaves share a leading (batch) dim, "
            f"but got:\n{rows}\nPass only the per-step batch, every leaf with the examples "
            "along dim 0."
        )
    (size,) = sizes
    return int(size or 0)


def trace_step(step: Any, model: Any, opt_state: Any, batch: Any, trains: bool) -> Any:
    """Traces `step` once on shapes, so that a step that cannot run fails here, first;
    returns the pipeline of a step that calls `filter_pipeline` itself (`OwnPipeline`,
    traced again with one stage over its axis), else `None`."""
    if not callable(step):
        raise TypeError(f"`auto_plan` takes a callable `step`, but got {type(step).__name__}.")
    args = (model, opt_state, batch) if trains else (model, batch)
    call = "step(model, opt_state, batch)" if trains else "step(model, batch)"
    inputs: list[tuple[Any, Any]] = []

    def traced(model: Any, *rest: Any) -> Any:
        inputs[:] = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_array_like)[0]
        return step(model, *rest)

    own = None
    with watching() as calls:
        out, failed = _eval_shape(traced, args)
    if calls:  # again with one stage over its axis: each call now runs, and is seen
        own = own_pipeline.found(calls, inputs, bool(stacks(model)))
        with watching() as calls, own_pipeline.tracing(own):
            out, failed = _eval_shape(traced, args)
        own = own if failed else own_pipeline.found(calls, inputs, bool(stacks(model)))
    if failed is not None:
        e = failed
        raise ValueError(
            f"`auto_plan` could not trace `step`: `{call}` raised {type(e).__name__}: {e}\n"
            "Check that `step` runs on these arguments (with `optimizer`, `step` takes "
            "`(model, opt_state, batch)` and returns `(model, opt_state, loss)`)."
        ) from e
    if trains and not (isinstance(out, tuple) and len(out) == 3):
        raise ValueError(
            f"`auto_plan` was given an `optimizer`, so `step` must return "
            f"`(model, opt_state, loss)`, but `{call}` returned {type(out).__name__}"
            f"{f' of length {len(out)}' if isinstance(out, tuple) else ''}."
        )
    return own


def _eval_shape(step: Any, args: tuple) -> tuple[Any, Exception | None]:
    try:
        return eqx.filter_eval_shape(step, *args), None
    except Exception as e:
        return None, e


def check_options(optimizer: Any, flops_per_second: Any, rules: Any, compile_limit: Any) -> None:
    """Raises unless `optimizer` is an optax transformation or None, `flops_per_second` a
    finite number > 0, `rules` a list of rules and `compile_limit` an int >= 1."""
    check_optimizer(optimizer)
    check_flops(flops_per_second)
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise TypeError(f"`auto_plan` takes `rules` as a list of rules, but got {rules!r}.")
    if isinstance(compile_limit, bool) or not isinstance(compile_limit, int) or compile_limit < 1:
        raise ValueError(
            f"`auto_plan` takes `compile_limit` as an int >= 1, but got {compile_limit!r}."
        )


def check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            "`auto_plan` takes `optimizer` as an optax transformation (with `init` and "
            f"`update`, e.g. `optax.adamw(1e-3)`), or None, but got {type(optimizer).__name__}."
        )


def over_budget(total: int, budget: int) -> str:
    return f"over budget by {format_bytes(total - budget)}"
