"""A plan's choices beyond the mesh and the rules: rematerialisation per stacked layer,
what lives in host memory, and the pipeline; their allowed values, checked."""

from __future__ import annotations

from typing import Any

REMAT_POLICIES = ("none", "dots", "full", "offload")
# The parts of a step that can live in pinned host memory between steps.
OFFLOADABLE = ("optimizer state",)
PIPELINE_KEYS = ("axis", "microbatches", "repeats")


def check(remat: Any, offload: Any, pipeline: Any) -> tuple[dict[str, str], tuple[str, ...]]:
    """`remat` and `offload` in their stored forms; raises for any bad value."""
    if not isinstance(remat, dict) or not all(isinstance(k, str) for k in remat):
        raise TypeError(
            "`Plan` takes `remat` as a dict {path of a stacked layer: policy}, e.g. "
            f"`{{'blocks': 'dots'}}`, but got {remat!r}."
        )
    bad = {k: v for k, v in remat.items() if v not in REMAT_POLICIES}
    if bad:
        raise ValueError(
            f"`Plan` got `remat` policies {bad!r}; each is one of {', '.join(REMAT_POLICIES)}."
        )
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
        if not isinstance(pipeline, dict) or set(pipeline) != set(PIPELINE_KEYS):
            raise ValueError(
                "`Plan` takes `pipeline` as None or a dict with the keys "
                f"{', '.join(PIPELINE_KEYS)} (e.g. `{{'axis': 'stage', 'microbatches': 8, "
                f"'repeats': 1}}`), but got {pipeline!r}."
            )
    return dict(remat), tuple(dict.fromkeys(offload))
