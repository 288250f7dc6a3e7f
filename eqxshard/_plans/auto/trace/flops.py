"""How much `cost_analysis()` undercounts a step's flops because of its loops.

XLA's cost analysis counts the body of a `while` loop once, however many times it runs,
so a step whose layers are scanned (`jax.lax.scan` over stacked blocks) reports a
fraction of its flops. This reads the step's jaxpr, counts its matmul flops with and
without each scan's length, and returns the ratio: `cost_analysis()` flops times it are
the step's.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx


def subjaxprs(params: dict[str, Any]) -> list[Any]:
    """The jaxprs inside an equation's `params` (a scan's body, a call's jaxpr, a cond's
    branches)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def jaxpr_matmul_flops(jaxpr: Any, loops: bool) -> float:
    """The matmul flops of `jaxpr`; with `loops`, each scan's body counted its length times."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)
        times = eqn.params.get("length", 1) if loops and eqn.primitive.name == "scan" else 1
        for inner in subjaxprs(eqn.params):
            total += times * jaxpr_matmul_flops(inner, loops)
    return total


def loop_ratio(jaxpr: Any) -> float:
    """The step's matmul flops over those `cost_analysis()` sees (1.0 without scans), from
    its `jaxpr`."""
    once = jaxpr_matmul_flops(jaxpr, loops=False)
    return jaxpr_matmul_flops(jaxpr, loops=True) / once if once else 1.0


def matmul_flops(jaxpr: Any) -> float:
    """The step's matmul flops over the whole batch, every scan's length counted, from its
    `jaxpr`: what a pipeline's stages share out (the time model of
    `dimensions/stage/schedule.py`)."""
    return jaxpr_matmul_flops(jaxpr, loops=True)


def step_jaxpr(step: Any, *args: Any) -> Any:
    """The step's jaxpr (a `ClosedJaxpr`) on `args`."""
    return eqx.filter_make_jaxpr(step)(*args)[0]
