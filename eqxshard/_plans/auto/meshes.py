"""The mesh of a plan: its axis sizes over this process's devices, or an `AbstractMesh` of
that shape when the plan is for more devices than this process has."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh


def mesh_for(shape: dict[str, int], devices: Sequence[Any] | None = None) -> Mesh | AbstractMesh:
    """A mesh with Auto axes `shape` over the first devices of `devices` (default: all of
    this process's), in the order `jax.make_mesh` gives them; an `AbstractMesh` when
    there are too few."""
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(shape.values())
    types = (AxisType.Auto,) * len(shape)
    if n <= len(devices):
        return jax.make_mesh(
            tuple(shape.values()), tuple(shape), axis_types=types, devices=devices[:n]
        )
    return AbstractMesh(tuple(shape.values()), tuple(shape), axis_types=types)
