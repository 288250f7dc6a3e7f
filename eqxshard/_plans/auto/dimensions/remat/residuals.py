"""What a remat policy keeps and recomputes on each of a model's stacks, read from the
step's jaxpr (traced, nothing compiled).

A stack's forward `scan` stacks up what its layers keep for the backward pass (its
residuals): their bytes, split by memory space, are what the stack holds on the device
and, under `"offload"`, in host memory (the compiled program on CPU counts both as
device memory: its own figures cannot tell them apart). The step's matmul flops, every
scan's length counted, say what a policy recomputes: over those of the step without
remat, the share of flops it adds. Each setting of the stacks is traced once, when first
asked. The model's own setting (each `eqxshard.Stacked`'s `remat`) is the baseline the
search's layouts without remat were compiled with: a policy that keeps no fewer bytes on
the device than it, on any stack, saves nothing and is not compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh

from ..... import _compat
from ....._pipeline.stacked.configure import configure, configure_like, layers, stacks
from ....._tree import format_bytes, is_array_like
from ...trace.flops import jaxpr_matmul_flops, subjaxprs

Remat = tuple[tuple[str, str], ...]  # `Layout.remat`: (path, policy) pairs; () is the model's own


@dataclasses.dataclass(frozen=True)
class Residuals:
    """One setting of the stacks, traced: bytes each stack keeps for the backward pass on
    the device and in host memory (`None` where a stack's forward scan was not found:
    `missing` names those stacks), and the step's matmul flops."""

    device: dict[str, int] | None
    host: dict[str, int] | None
    flops: float
    missing: tuple[str, ...] = ()


def _bytes(aval: Any) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


def _forward_scans(jaxpr: Any, out: list[tuple[int, Counter, int, int]]) -> bool:
    """Appends `(length, scanned input types, device bytes, host bytes of its stacked
    outputs)` of every forward `scan` in `jaxpr` (nested calls included, scan bodies
    not); False where this JAX's scan equations cannot be read."""
    host = _compat.memory_space("pinned_host")
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            if eqn.params.get("reverse", False):
                continue
            counts = _compat.scan_counts(eqn)
            if counts is None:
                return False
            consts, carries = counts
            xs = Counter(
                (tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars[consts + carries :]
            )
            ys = eqn.outvars[carries:]
            away = sum(_bytes(v.aval) for v in ys if _compat.traced_memory_space(v) == host)
            near = sum(_bytes(v.aval) for v in ys) - away
            out.append((int(eqn.params["length"]), xs, near, away))
            continue
        for inner in subjaxprs(eqn.params):
            if not _forward_scans(inner, out):
                return False
    return True


def residuals(step: Any, args: tuple, remat: Remat | str) -> Residuals:
    """`step` on `args` (the model first; its optimiser state second when there are three)
    with the model's stacks set to `remat` (a policy for every stack, or `(path, policy)`
    pairs: the others keep their own), traced."""
    model = args[0]
    found = stacks(model)
    if remat or isinstance(remat, str):
        one = Mesh(jax.devices()[:1], ("data",))  # no pipeline: any mesh
        setting = remat if isinstance(remat, str) else dict(remat)
        model = configure("auto_plan", model, remat=setting, pipeline=None, mesh=one)
    rest = list(args[1:])
    if len(args) == 3:
        rest[0] = configure_like(args[1], model)
    jaxpr = eqx.filter_make_jaxpr(step)(model, *rest)[0].jaxpr
    flops = jaxpr_matmul_flops(jaxpr, loops=True)
    scans: list[tuple[int, Counter, int, int]] = []
    if not _forward_scans(jaxpr, scans):
        return Residuals(None, None, flops, tuple(found))
    used: set[int] = set()
    device, host, missing = {}, {}, []
    for path, stack in found.items():
        leaves = [x for x in jax.tree.leaves(stack.blocks) if is_array_like(x)]
        want = Counter((tuple(x.shape), str(x.dtype)) for x in leaves)
        count = layers(stack)
        match = next(
            (
                k
                for k, (length, xs, _, _) in enumerate(scans)
                if k not in used and length == count and not want - xs
            ),
            None,
        )
        if match is None:
            missing.append(path)
            continue
        used.add(match)
        device[path], host[path] = scans[match][2], scans[match][3]
    if missing:
        return Residuals(None, None, flops, tuple(missing))
    return Residuals(device, host, flops)


def _paths(paths: Any) -> str:
    return ", ".join(f"`{p}`" if p else "the model" for p in paths)


class RematTrace:
    """The step's stacks under each setting asked for, traced once each: what a policy
    saves on the device against the model's own setting, what it keeps in host memory,
    and the flops it adds."""

    def __init__(self, step: Any, args: tuple, context: Any = contextlib.nullcontext):
        """`context()`: what the step is traced in (a step that pipelines by itself needs
        its stage axis set)."""
        self._step, self._args, self._context = step, args, context
        self._known: dict[Remat | str, Residuals] = {}
        self.own = {p: s.remat for p, s in stacks(args[0]).items()}

    def at(self, remat: Remat | str) -> Residuals:
        """The step traced with the stacks set to `remat` (`()`: the model's own setting)."""
        if remat == () and len(set(self.own.values())) == 1:
            remat = next(iter(self.own.values()))  # one policy on every stack: traced once
        if remat not in self._known:
            with self._context():
                self._known[remat] = residuals(self._step, self._args, remat)
        return self._known[remat]

    def __call__(self, policy: str) -> dict[str, int] | None:
        """The bytes `policy` on every stack saves on the device, per stack, against the
        model's own setting (none below zero); `None` where a stack's scan is not found."""
        own, left = self.at(()).device, self.at(policy).device
        if own is None or left is None:
            return None
        return {p: max(own[p] - left[p], 0) for p in own}

    def missing(self) -> tuple[str, ...]:
        """The stacks whose forward scan the step's jaxpr does not show."""
        return self.at(()).missing

    def saving_on(self, policy: str) -> list[str] | None:
        """The stacks on which `policy` keeps fewer bytes on the device than their own
        setting does; `None` where a stack's scan is not found."""
        own, left = self.at(()).device, self.at(policy).device
        if own is None or left is None:
            return None
        return [p for p in own if left[p] < own[p]]

    def saves_nothing(self, policy: str) -> str:
        """Why `policy` saves nothing on the device against the model's own setting, on
        any stack (the row of a variant not compiled), or `""` where it saves some, or
        where that is not known."""
        if self.saving_on(policy) != []:
            return ""
        own, left = self.at(()).device or {}, self.at(policy).device or {}
        mine = sorted({f"remat={q!r}" for q in self.own.values()})
        return (
            f"not compiled: dominated, remat {policy} keeps {format_bytes(sum(left.values()))} "
            f"for the backward pass on the device where {_paths(self.own)}'s own "
            f"{', '.join(mine)} keeps {format_bytes(sum(own.values()))} (whole batch, by the "
            "step's jaxpr): it saves nothing; the rows without remat are that setting"
        )

    def host_bytes(self, remat: Remat) -> int:
        """Bytes (whole batch) `remat` keeps in host memory for the backward pass; 0 where
        not known."""
        host = self.at(remat).host
        return sum(host.values()) if host else 0

    def recomputed(self, remat: Remat | str, against: Remat | str = "none") -> float:
        """The step's matmul flops with `remat` over those with `against` (default: no
        remat on any stack)."""
        base = self.at(against).flops
        return self.at(remat).flops / base if base else 1.0
