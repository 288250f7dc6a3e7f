"""A plan's choices beyond the mesh and the rules: rematerialisation per stacked layer (or
one policy for all), what lives in host memory, and the pipeline; their allowed values,
checked."""

from __future__ import annotations

from typing import Any

REMAT_POLICIES = ("none", "dots", "full", "offload")
# The memory kind (`jax.sharding.Sharding.with_memory_kind`) offloaded parts live in.
HOST_MEMORY_KIND = "pinned_host"
# The parts of a step that can live in pinned host memory between steps.
OFFLOADABLE = ("optimizer state",)
PIPELINE_KEYS = ("axis", "microbatches", "repeats")
# With `"in_step": True` the step calls `filter_pipeline` itself: nothing to configure.
IN_STEP = "in_step"


def check(remat: Any, offload: Any, pipeline: Any) -> tuple[dict[str, str] | str, tuple[str, ...]]:
    """`remat` and `offload` in their stored forms; raises for any bad value."""
    if isinstance(remat, str):
        if remat not in REMAT_POLICIES:
            raise ValueError(
                f"`Plan` got `remat={remat!r}`; a policy for every stacked layer is one of "
                f"{', '.join(REMAT_POLICIES)} (or give a dict {{path: policy}})."
            )
        return remat, _offload(offload, pipeline)
    if not isinstance(remat, dict) or not all(isinstance(k, str) for k in remat):
        raise TypeError(
            "`Plan` takes `remat` as a dict {path of a stacked layer: policy}, e.g. "
            f"`{{'blocks': 'dots'}}`, or one policy for every stacked layer (`'dots'`), but "
            f"got {remat!r}."
        )
    bad = {k: v for k, v in remat.items() if v not in REMAT_POLICIES}
    if bad:
        raise ValueError(
            f"`Plan` got `remat` policies {bad!r}; each is one of {', '.join(REMAT_POLICIES)}."
        )
    return dict(remat), _offload(offload, pipeline)


def _offload(offload: Any, pipeline: Any) -> tuple[str, ...]:
    """`offload` as stored (`pipeline` checked too); raises for any bad value."""
    if isinstance(offload, str) or not isinstance(offload, tuple | list):
        raise TypeError(
            "`Plan` takes `offload` as a tuple of parts held in host memory, e.g. "
            f"`('optimizer state',)`, or `()`, but got {offload!r}."
        )
    unknown = [p for p in offload if p not in OFFLOADABLE]
    if unknown:
        raise ValueError(
            f"`Plan` got `offload` parts {unknown!r}; the parts that can live in host "
            f"memory are {', '.join(repr(p) for p in OFFLOADABLE)}."
        )
    if pipeline is not None:
        keys = set(pipeline) - {IN_STEP} if isinstance(pipeline, dict) else None
        if keys != set(PIPELINE_KEYS) or pipeline.get(IN_STEP, True) is not True:
            raise ValueError(
                "`Plan` takes `pipeline` as None or a dict with the keys "
                f"{', '.join(PIPELINE_KEYS)} (e.g. `{{'axis': 'stage', 'microbatches': 8, "
                f"'repeats': 1}}`), and `'{IN_STEP}': True` for a step that calls "
                f"`filter_pipeline` itself, but got {pipeline!r}."
            )
    return tuple(dict.fromkeys(offload))


CONTEXT_STRATEGIES = ("ring", "all_gather", "all_to_all")


def check_context(context: Any) -> dict[str, str] | None:
    """A plan's `context` as stored; raises for any bad value."""
    if context is None:
        return None
    good = (
        isinstance(context, dict)
        and set(context) - {"heads_axis"} == {"axis", "strategy"}
        and isinstance(context["axis"], str)
        and isinstance(context.get("heads_axis", ""), str)
        and context["strategy"] in CONTEXT_STRATEGIES
    )
    if not good:
        raise ValueError(
            "`Plan` takes `context` as None or a dict {'axis': mesh axis name, 'strategy': "
            f"one of {', '.join(map(repr, CONTEXT_STRATEGIES))}}}, and 'heads_axis': the axis "
            "the heads are split over, where they are (e.g. `{'axis': 'context', "
            f"'strategy': 'ring'}}`), but got {context!r}."
        )
    return dict(context)


def check_experts(experts: Any) -> dict[str, str | None] | None:
    """A plan's `experts` as stored; raises for any bad value."""
    if experts is None:
        return None
    good = isinstance(experts, dict) and set(experts) == {"axis"}
    if not (good and (experts["axis"] is None or isinstance(experts["axis"], str))):
        raise ValueError(
            "`Plan` takes `experts` as None (the model's `Experts` left as they are) or a "
            "dict {'axis': mesh axis name, or None to run them unsplit} (e.g. "
            f"`{{'axis': 'expert'}}`), but got {experts!r}."
        )
    return dict(experts)
