"""`Pipeline`: the pipeline a `Plan` chose (stage axis, microbatches, schedule), as a small
record that `repr(plan)` writes and `Plan(..., pipeline=...)` reads back."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

# The keys of the dict `Plan.pipeline` was before it was a `Pipeline`.
_KEYS = ("axis", "microbatches", "repeats")
_IN_STEP = "in_step"


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The pipeline of a `Plan`: its `Stacked` layers (or the step's own
    `filter_pipeline` calls) run over the mesh axis `axis`.

    - `axis`: the mesh axis the stages are laid out over.
    - `microbatches`: how many pieces each batch is cut into.
    - `repeats`: how many chunks of layers each stage holds: `1` is the GPipe schedule,
        more the circular one (`schedule` says which).
    - `in_step`: `True` for a step that calls `filter_pipeline` itself (`Plan.jit` then
        runs it with the plan's mesh set; there is no `Stacked` to configure).

    `repr` is Python that builds an equal `Pipeline` (as `repr(plan)` writes it).

    **Raises:**

    - `TypeError`: if `axis` is not a str, `microbatches` or `repeats` is not an int, or
        `in_step` is not a bool.
    - `ValueError`: if `microbatches` or `repeats` is below 1.
    """

    axis: str
    microbatches: int
    repeats: int = 1
    in_step: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str):
            raise TypeError(f"`Pipeline` takes `axis` as a mesh axis name, but got {self.axis!r}.")
        for name in ("microbatches", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"`Pipeline` takes `{name}` as an int, but got {value!r}.")
            if value < 1:
                raise ValueError(f"`Pipeline` takes `{name}` of 1 or more, but got {value}.")
        if not isinstance(self.in_step, bool):
            raise TypeError(f"`Pipeline` takes `in_step` as a bool, but got {self.in_step!r}.")

    @property
    def schedule(self) -> str:
        """`"gpipe"` (`repeats=1`) or `"circular"`, as `filter_pipeline(schedule=...)` names
        it."""
        return "gpipe" if self.repeats == 1 else "circular"

    def options(self) -> dict[str, Any]:
        """The dict form the planner and `Stacked` read: `{"axis", "microbatches",
        "repeats"}`, with `"in_step": True` for a step that pipelines by itself."""
        options: dict[str, Any] = {k: getattr(self, k) for k in _KEYS}
        return options | ({_IN_STEP: True} if self.in_step else {})

    def __getitem__(self, key: str) -> Any:
        warnings.warn(
            f"`plan.pipeline[{key!r}]`: `Plan.pipeline` is an `eqxshard.Pipeline`; read "
            f"`plan.pipeline.{key}` instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.options().get(key, False) if key == _IN_STEP else self.options()[key]


def of_options(options: dict[str, Any] | None) -> Pipeline | None:
    """The `Pipeline` of the planner's dict form (`None` for none)."""
    if options is None:
        return None
    in_step = options.get(_IN_STEP, False)
    return Pipeline(**{k: options[k] for k in _KEYS}, in_step=in_step)


def from_plan_argument(pipeline: Any) -> Pipeline | None:
    """`Plan`'s `pipeline` argument as a `Pipeline`: a dict (the form older `repr(plan)`s
    wrote) is converted, with a `DeprecationWarning`; raises for any other value."""
    if pipeline is None or isinstance(pipeline, Pipeline):
        return pipeline
    if isinstance(pipeline, dict):
        warnings.warn(
            "`Plan(pipeline={...})`: give the pipeline as `Pipeline(axis=..., "
            "microbatches=..., repeats=...)` (what `repr(plan)` writes now); a dict is read "
            "as one for now.",
            DeprecationWarning,
            stacklevel=3,
        )
        keys = set(pipeline) - {_IN_STEP}
        if keys == set(_KEYS) and pipeline.get(_IN_STEP, True) is True:
            return of_options(pipeline)
    error = ValueError if isinstance(pipeline, dict) else TypeError
    raise error(
        "`Plan` takes `pipeline` as None or an `eqxshard.Pipeline(axis, microbatches, "
        "repeats, in_step=False)` (e.g. `Pipeline(axis='stage', microbatches=8)`), but got "
        f"{pipeline!r}."
    )
