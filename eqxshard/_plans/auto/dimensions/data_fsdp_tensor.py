"""The data, fsdp and tensor layouts: every mesh shape (data x fsdp x model) crossed with
the rule families built from eqxshard's own rules (data parallel, FSDP, tensor parallel
(`tensor_parallel`) and FSDP x TP), and the user's rules."""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

from ...fsdp import fsdp
from ...rules import as_rule
from ..layout import Layout
from ..trace.phase import Traced
from .base import Dimension, Proposal
from .tensor_parallel import tensor_parallel_roles, tensor_parallel_rule

AXES = ("data", "fsdp", "model")


def factorisations(n: int) -> list[tuple[int, int, int]]:
    """Every (data, fsdp, model) with product `n`."""
    out = []
    for d in range(1, n + 1):
        if n % d:
            continue
        for f in range(1, n // d + 1):
            if (n // d) % f == 0:
                out.append((d, f, n // d // f))
    return out


def mesh_shape(sizes: tuple[int, int, int]) -> dict[str, int]:
    """Axis name -> size, size-1 axes dropped (one `data` axis of size 1 for one device)."""
    shape = {a: s for a, s in zip(AXES, sizes, strict=True) if s > 1}
    return shape or {"data": 1}


def family(shape: dict[str, int]) -> str:
    names = {"data": "DP", "fsdp": "FSDP", "model": "TP"}
    return " x ".join(names[a] for a in AXES if shape.get(a, 1) > 1) or "DP"


def layouts(model: Any, n: int, user_rules: list[Any]) -> list[Layout]:
    """Every candidate layout for `n` devices: built-in families, then the user's rules."""
    roles = tensor_parallel_roles(model)
    out = []
    for sizes in factorisations(n):
        shape = mesh_shape(sizes)
        name = family(shape)
        if "model" in shape:
            built = tensor_parallel_rule(model, roles, shape)
            if built is not None:  # else no matmul weight splits over this many devices
                rule, skipped = built
                note = (
                    f"{len(skipped)} weights left whole (not divisible by {shape['model']})"
                    if skipped
                    else ""
                )
                out.append(Layout(name, shape, rule, note))
        elif "fsdp" in shape:
            out.append(Layout(name, shape, fsdp("fsdp")))
        else:
            out.append(Layout(name, shape, as_rule(P(), "auto_plan")))  # repr: P()
        for k, rule in enumerate(user_rules):
            out.append(Layout(f"rules[{k}]", shape, rule))
    return out


class DataFsdpTensor(Dimension):
    """The `data`, `fsdp` and `model` axes: every factorisation of the devices, with the
    built-in rule families and the user's rules (none for a step that pipelines by itself:
    only meshes with its stage axis can run it)."""

    name = "data_fsdp_tensor"

    def propose(self, traced: Traced) -> Proposal:
        if traced.own is not None:
            return Proposal()
        model = traced.problem.model
        return Proposal(layouts=tuple(layouts(model, traced.devices, list(traced.rules))))
