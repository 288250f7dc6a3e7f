"""Tensor parallelism inside a pipeline stage: the rule of a `stage x model` (or `stage x
data x model`, `stage x fsdp x model`) mesh, for a model with tensor-parallel weights.

Each stack's leaves are split over `stage` on their layer dim (the `stages` rule), and
each layer's matmul weights over `model` as on the mesh without stages
(`dimensions/tensor_parallel.py`: in-projections on their output dim, out-projections on
their input dim, and over `fsdp` on their other dim when the mesh has one); the leaves
outside the stacks (embedding, head) are laid out as on that mesh. A mesh where `model`
splits no weight of a stack is left out: a stage there would hold its layers whole on
every device of `model`.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

from ....rules import Rule, first
from ....stages import stages as stages_rule
from ..tensor_parallel import Role, spec_patterns, tensor_parallel_specs, with_rest


def _inside(text: str, stacks: list[str]) -> bool:
    return any(not p or text == p or text.startswith(p + ".") for p in stacks)


def _per_layer(spec: P | None) -> P | None:
    return None if spec is None else P(*tuple(spec)[1:])


def rule(
    model: Any,
    roles: dict[str, Role],
    stacks: list[str],
    stack_pattern: str,
    axis: str,
    shape: dict[str, int],
) -> tuple[Rule, list[str]] | None:
    """The rule of a stage mesh whose other axes are `shape` (with `model`), and the
    weights left whole (their dim does not divide); None when `model` splits no weight
    of the stacks at `stacks` (dotted paths of stacks or of their leaves, matched as
    `stack_pattern`)."""
    specs, skipped, every = tensor_parallel_specs(model, roles, shape)
    layer = {t: _per_layer(s) for t, s in specs.items() if _inside(t, stacks)}
    if not layer:
        return None
    layer_every = {t: _per_layer(s) for t, s in every.items() if _inside(t, stacks)}
    rest = {t: s for t, s in specs.items() if not _inside(t, stacks)}
    rest_every = {t: s for t, s in every.items() if not _inside(t, stacks)}
    inner = with_rest(spec_patterns(layer, layer_every), shape)  # type: ignore[arg-type]
    outer = with_rest(spec_patterns(rest, rest_every), shape)
    return first(stages_rule(axis, path=stack_pattern, inner=inner), outer), skipped
