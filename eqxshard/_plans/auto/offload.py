"""Optimiser state in pinned host memory: when `auto_plan` tries it, what it costs.

A layout with the state offloaded keeps it in `pinned_host` memory between steps; the
step moves it to the device for the update and back (`filter_put` inside `jit`), so it
crosses the `host` link twice per step. It saves the state's bytes in device memory, so
it is tried only for a layout that does not fit without it and would with the state's
bytes gone: a layout that fits already is faster without (no host traffic), and one
still over budget without the state cannot fit with it. Backends without pinned host
memory, and JAX versions that cannot move memory kinds inside `jit`, are not offered it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ... import _compat
from . import links as links_
from .candidates import Layout
from .measure import HOST
from .view import seconds_str

# What the table calls a layout with the state in host memory.
SUFFIX = " + offload"


def supported(devices: list[Any]) -> bool:
    """Whether the devices have pinned host memory and JAX can move to it inside `jit`."""
    if not devices or not _compat.memory_kinds_in_jit():
        return False
    try:
        kinds = {m.kind for m in devices[0].addressable_memories()}
    except (AttributeError, RuntimeError):
        return False
    return HOST in kinds


def could_fit(total: int | None, state: int, budget: int) -> bool:
    """Whether a layout of `total` bytes per device (None: not known) that is over budget
    fits with its optimiser state's `state` bytes moved to host memory."""
    return total is not None and total > budget and total - state <= budget


def dominated(floor: float, best: float) -> str:
    """Why an offload variant is not compiled: it cannot beat a layout that fits."""
    return (
        f"not compiled: dominated, at least {seconds_str(floor)} per step with the optimiser "
        f"state's trips over PCIe, slower than {seconds_str(best)} of a layout that fits"
    )


def variant(layout: Layout) -> Layout:
    return dataclasses.replace(layout, name=layout.name + SUFFIX, offload=True)


def seconds(state: int, links: dict[str, links_.Link]) -> float:
    """The state's trips to the device and back over the `host` link, per step."""
    link = links.get("host", links_.LINKS["host"])
    return 2 * (link.latency + state / link.bandwidth)
