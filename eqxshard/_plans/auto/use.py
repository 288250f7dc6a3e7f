"""Using a `Plan` in one line: its step compiled with the plan's layouts (`Plan.jit`), and a
model laid out and its `Stacked` layers configured (remat, pipeline) as the plan chose
(`Plan.apply`)."""

from __future__ import annotations

import contextlib
import functools as ft
from collections.abc import Callable
from typing import Any

import jax

from ..._pipeline.stacked.building import with_mesh_set
from ..._pipeline.stacked.configure import configure, configure_like as configure_like
from ..._placement.put import filter_put
from ..._placement.shard import filter_shard
from ..._step.jit import filter_jit
from ..plan import filter_shardings
from .choices import HOST_MEMORY_KIND as HOST, IN_STEP


def host_layout(opt_state: Any, mesh: Any, rules: Any) -> Any:
    """The shardings of `opt_state` laid out by `rules`, in pinned host memory."""
    return jax.tree.map(
        lambda s: s.with_memory_kind(HOST), filter_shardings(opt_state, mesh, rules)
    )


def place_state(opt_state: Any, mesh: Any, rules: Any, offload: bool) -> Any:
    """`opt_state` laid out by `rules`, in pinned host memory when `offload`."""
    placed = filter_shard(opt_state, mesh, rules)
    return filter_put(placed, memory_kind=HOST) if offload else placed


class PlanStep:
    """A step compiled by `Plan.jit`: `step(model, opt_state, batch)` (a training step)
    or `step(model, batch)` (an evaluation), each through its own `filter_jit`. With the
    optimiser state offloaded, the training step takes and returns it in pinned host
    memory and moves it to the device for the update inside the step."""

    def __init__(
        self,
        step: Callable[..., Any],
        mesh: Any,
        rules: Any,
        batch_spec: Any,
        donate: bool,
        offload: bool,
        mesh_set: bool = False,
        convert: Callable[[Any], Any] | None = None,
    ):
        self._step, self._mesh, self._rules, self._batch_spec = step, mesh, rules, batch_spec
        self._mesh_set = mesh_set
        self._convert = convert
        self._donate = (True, True, False) if donate else "none"
        self._offload = offload
        self._train = filter_jit(
            step,
            in_shardings=(rules, rules, batch_spec),
            out_shardings=(rules, rules, None),
            donate=self._donate,
            mesh=mesh,
        )
        self._offloaded: dict[Any, Any] = {}  # per structure of the optimiser state
        self._evaluate = filter_jit(step, in_shardings=(rules, batch_spec), mesh=mesh)
        ft.update_wrapper(self, step)

    def _moved(self, model: Any, opt_state: Any, batch: Any) -> Any:
        opt_state = filter_put(opt_state, memory_kind="device")
        model, opt_state, loss = self._step(model, opt_state, batch)
        return model, filter_put(opt_state, memory_kind=HOST), loss

    def _train_offloaded(self, args: tuple, kwargs: dict) -> Any:
        if len(args) < 2:
            raise TypeError(
                "A step compiled by `Plan.jit` with the optimiser state offloaded takes "
                "`model` and `opt_state` as positional arguments."
            )
        key = jax.tree.structure(args[1])
        if key not in self._offloaded:
            host = host_layout(args[1], self._mesh, self._rules)
            self._offloaded[key] = filter_jit(
                self._moved,
                in_shardings=(self._rules, host, self._batch_spec),
                out_shardings=(self._rules, host, None),
                donate=self._donate,
                mesh=self._mesh,
            )
        return self._offloaded[key]

    def _pick(self, args: tuple, kwargs: dict) -> Any:
        count = len(args) + len(kwargs)
        if count == 3:
            return self._train_offloaded(args, kwargs) if self._offload else self._train
        if count == 2:
            return self._evaluate
        name = getattr(self._step, "__name__", "step")
        raise TypeError(
            f"A step compiled by `Plan.jit` takes `(model, opt_state, batch)` (training) or "
            f"`(model, batch)` (evaluation), but `{name}` was called with {count} arguments."
        )

    def _context(self) -> Any:
        """The plan's mesh set, for a step that calls `filter_pipeline` itself (without
        `mesh=`, it runs on the mesh set); a context that does nothing otherwise."""
        return with_mesh_set(self._mesh) if self._mesh_set else contextlib.nullcontext()

    def _converted(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments with the plan's `convert` applied to each (the model and the
        optimiser state as the plan runs them), before the step traces."""
        if self._convert is None:
            return args, kwargs
        convert = self._convert
        return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._converted(args, kwargs)
        with self._context():
            return self._pick(args, kwargs)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """As `filter_jit`'s `lower`: `.compile().memory_analysis()` gives the bytes per
        device of the step as it runs."""
        args, kwargs = self._converted(args, kwargs)
        with self._context():
            return self._pick(args, kwargs).lower(*args, **kwargs)


def in_step(pipeline: Any) -> bool:
    """Whether a plan's `pipeline` is the step's own (`filter_pipeline` called in it)."""
    return isinstance(pipeline, dict) and pipeline.get(IN_STEP, False) is True


def configured(verb: str, model: Any, mesh: Any, remat: dict[str, str] | str, pipeline: Any) -> Any:
    """`model` with its `Stacked` layers set to the plan's `remat` and `pipeline` (the
    model itself when the plan chose neither, or the step pipelines by itself)."""
    if in_step(pipeline):
        pipeline = None  # the step calls `filter_pipeline` itself: no `Stacked` to set
    if not remat and pipeline is None:
        return model
    return configure(verb, model, remat=remat, pipeline=pipeline, mesh=mesh)
