"""Ops a compiled step runs on one device, whose results XLA then replicates on every
device: host callbacks (`eqx.error_if`, `jax.pure_callback`, `io_callback`) in a step
over several devices.

XLA pins a host callback to device 0 ("maximal" sharding). Where its result feeds work
laid out over the mesh, the partitioner cannot split it from one device and replicates
it first ("Involuntary full rematerialization", on stderr only); the work that follows
may then run replicated too. The compiled HLO keeps the callback, its result's shape
and the JAX op that made it, which is what is read here.
"""

from __future__ import annotations

import dataclasses
import re

# A custom call to one of JAX's Python callbacks (CPU or GPU, FFI or not).
_CALLBACK = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s+custom-call\(.*"
    r'custom_call_target="(?P<target>[\w.]*python[\w.]*callback[\w.]*)"'
)
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class PinnedOp:
    """One op XLA runs on one device of a step over several.

    - `source`: what made it, in the user's words (`eqx.error_if`, `jax.pure_callback`).
    - `op_name`: JAX's name of the op in the step (its transformations and function).
    - `shapes`: the shapes of its array results (what XLA replicates), e.g. `s32[64]`.
    """

    source: str
    op_name: str
    shapes: tuple[str, ...]


def _source(op_name: str) -> str:
    if "error_if" in op_name:
        return "`eqx.error_if`"
    if "io_callback" in op_name:
        return "`jax.experimental.io_callback`"
    if "pure_callback" in op_name:
        return "`jax.pure_callback`"
    return "a host callback"


def pinned_ops(hlo_text: str) -> list[PinnedOp]:
    """The host callbacks with array results of a compiled step over several devices
    (none for a step on one device), one per JAX op, in the order of the HLO."""
    found = _PARTITIONS.search(hlo_text)
    if found is None or int(found.group(1)) <= 1:
        return []
    out: dict[str, PinnedOp] = {}
    for line in hlo_text.splitlines():
        match = _CALLBACK.match(line)
        if match is None:
            continue
        shapes = tuple(
            f"{m.group('dtype')}[{m.group('dims')}]"
            for m in _ARRAY.finditer(match.group("shape"))
            if m.group("dims")  # scalars cost nothing to replicate
        )
        if not shapes:
            continue
        name = _OP_NAME.search(line)
        op_name = name.group("name") if name else match.group("target")
        if op_name not in out:
            out[op_name] = PinnedOp(_source(op_name), op_name, shapes)
    return list(out.values())


FIX = (
    "move the check out of the step (check the batch before the call), or, for "
    "`eqx.error_if`, set `EQX_ON_ERROR=nan` (a failed check then gives NaNs, not an error)"
)


def verdict(pinned: list[PinnedOp]) -> str:
    """What `auto_plan` appends to a candidate's verdict when its step has pinned ops."""
    ops = ", ".join(f"{p.source} on {' '.join(p.shapes)}" for p in pinned[:3])
    return (
        f"XLA runs {ops} on one device and replicates the result on every device "
        '("Involuntary full rematerialization" on stderr), so these layouts may not split '
        f"the work: {FIX}"
    )
