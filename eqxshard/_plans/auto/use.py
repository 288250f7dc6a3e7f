"""Using a `Plan` in one line: its step compiled with the plan's layouts (`Plan.jit`), and a
model laid out (and, as pipelines and stacked layers come, configured) as the plan chose
(`Plan.apply`)."""

from __future__ import annotations

import functools as ft
from collections.abc import Callable
from typing import Any

from ..._placement.shard import filter_shard
from ..._step.jit import filter_jit


class PlanStep:
    """A step compiled by `Plan.jit`: `step(model, opt_state, batch)` (a training step)
    or `step(model, batch)` (an evaluation), each through its own `filter_jit`."""

    def __init__(
        self, step: Callable[..., Any], mesh: Any, rules: Any, batch_spec: Any, donate: bool
    ):
        self._step = step
        self._train = filter_jit(
            step,
            in_shardings=(rules, rules, batch_spec),
            out_shardings=(rules, rules, None),
            donate=(True, True, False) if donate else "none",
            mesh=mesh,
        )
        self._evaluate = filter_jit(step, in_shardings=(rules, batch_spec), mesh=mesh)
        ft.update_wrapper(self, step)

    def _pick(self, args: tuple, kwargs: dict) -> Any:
        count = len(args) + len(kwargs)
        if count == 3:
            return self._train
        if count == 2:
            return self._evaluate
        name = getattr(self._step, "__name__", "step")
        raise TypeError(
            f"A step compiled by `Plan.jit` takes `(model, opt_state, batch)` (training) or "
            f"`(model, batch)` (evaluation), but `{name}` was called with {count} arguments."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._pick(args, kwargs)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """As `filter_jit`'s `lower`: `.compile().memory_analysis()` gives the bytes per
        device of the step as it runs."""
        return self._pick(args, kwargs).lower(*args, **kwargs)


def jit(step: Callable[..., Any], mesh: Any, rules: Any, batch_spec: Any, donate: bool) -> PlanStep:
    """`Plan.jit`, given the plan's concrete mesh, rules and batch spec."""
    if not isinstance(donate, bool):
        raise TypeError(f"`Plan.jit` takes `donate` as a bool, but got {donate!r}.")
    return PlanStep(step, mesh, rules, batch_spec, donate)


def apply(model: Any, mesh: Any, rules: Any, remat: dict[str, str], pipeline: Any) -> Any:
    """`Plan.apply`, given the plan's concrete mesh, rules and choices."""
    if remat or pipeline is not None:
        raise ValueError(
            f"`Plan.apply` got a plan with remat={remat!r}, pipeline={pipeline!r}: "
            "these configure stacked layers (`eqxshard.Stacked`), which this version of "
            "eqxshard does not have. Build the plan without them (`remat={}`, "
            "`pipeline=None`)."
        )
    return filter_shard(model, mesh, rules)
