"""Rematerialising some of a model's stacks, not all: those whose saved activations are
largest first, as few as make a layout fit.

A model with several `eqxshard.Stacked` layers (a wide encoder's and a narrow decoder's,
say) need not rematerialise all of them: each stack left alone recomputes nothing. What
each stack saves for the backward pass is read from the step's jaxpr (traced, nothing
compiled): the stacked outputs of its forward `scan` (its residuals), with every stack
without remat and with the policy; their difference is what the policy saves on that
stack. When the layout compiled with the policy on every stack fits, the bytes that
compile saved (against the layout without remat) are shared out in those proportions,
and the fewest stacks, largest saving first, whose share covers the layout's excess over
the budget with a tenth to spare are rematerialised alone, the others given `"none"`:
one more compile, which the table shows as its own row. Where a stack's forward scan
cannot be found in the jaxpr, no mix is tried.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh

from ... import _compat
from ..._pipeline.configure import configure, configure_like, layers, stacks
from ..._tree import is_array_like
from .candidate import Candidate
from .candidates import Layout
from .flops import _subjaxprs

# The share of the excess over budget a mix must save by arithmetic before it is compiled.
HEADROOM = 1.1
# "offload" keeps on the device what "full" does (the matmul outputs go to the host).
_TRACED_AS = {"dots": "dots", "full": "full", "offload": "full"}


def _bytes(aval: Any) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


def _forward_scans(jaxpr: Any, out: list[tuple[int, Counter, int]]) -> bool:
    """Appends `(length, scanned input types, bytes of stacked outputs)` of every forward
    `scan` in `jaxpr` (nested calls included, scan bodies not); False where this JAX's
    scan equations cannot be read."""
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
            ys = sum(_bytes(v.aval) for v in eqn.outvars[carries:])
            out.append((int(eqn.params["length"]), xs, ys))
            continue
        for inner in _subjaxprs(eqn.params):
            if not _forward_scans(inner, out):
                return False
    return True


def saved_bytes(step: Any, args: tuple, policy: str) -> dict[str, int] | None:
    """Bytes each stack of `args[0]` (the model; `args[1]` its optimiser state when there
    are three) keeps for the backward pass of `step` with every stack's remat `policy`, by
    the stacked outputs of its forward scan; `None` where a stack's scan is not found."""
    model = args[0]
    found = stacks(model)
    remat = {p: policy for p in found}
    one = Mesh(jax.devices()[:1], ("data",))  # no pipeline: any mesh
    configured = configure("auto_plan", model, remat=remat, pipeline=None, mesh=one)
    rest = list(args[1:])
    if len(args) == 3:
        rest[0] = configure_like(args[1], configured)
    jaxpr = eqx.filter_make_jaxpr(step)(configured, *rest)[0].jaxpr
    scans: list[tuple[int, Counter, int]] = []
    if not _forward_scans(jaxpr, scans):
        return None
    used: set[int] = set()
    out = {}
    for path, stack in found.items():
        leaves = [x for x in jax.tree.leaves(stack.blocks) if is_array_like(x)]
        want = Counter((tuple(x.shape), str(x.dtype)) for x in leaves)
        count = layers(stack)
        match = next(
            (
                k
                for k, (length, xs, _) in enumerate(scans)
                if k not in used and length == count and not want - xs
            ),
            None,
        )
        if match is None:
            return None
        used.add(match)
        out[path] = scans[match][2]
    return out


class Savings:
    """What a policy saves on each stack of a step's model, by arithmetic (traced once per
    policy, when first asked)."""

    def __init__(self, step: Any, args: tuple):
        self._step, self._args = step, args
        self._known: dict[str, dict[str, int] | None] = {}

    def __call__(self, policy: str) -> dict[str, int] | None:
        traced = _TRACED_AS.get(policy)
        if traced is None:
            return None
        if "none" not in self._known:
            self._known["none"] = saved_bytes(self._step, self._args, "none")
        if traced not in self._known:
            self._known[traced] = saved_bytes(self._step, self._args, traced)
        kept, left = self._known["none"], self._known[traced]
        if kept is None or left is None:
            return None
        return {p: max(kept[p] - left[p], 0) for p in kept}


def mix(
    base: Layout,
    without: Candidate,
    every: Candidate,
    policy: str,
    saving: dict[str, int] | None,
    budget: int,
) -> Layout | None:
    """The variant of `base` rematerialising only the stacks with the largest `saving`
    that together cover its excess over `budget` (`without`: its row without remat;
    `every`: its compiled row with `policy` on every stack), or `None` where every stack
    is needed, `every` does not fit, or the shares are not known."""
    if saving is None or len(saving) < 2 or not every.fits:
        return None
    total = sum(saving.values())
    compiled = (without.total_bytes or 0) - (every.total_bytes or 0)
    excess = (without.total_bytes or 0) - budget
    if total <= 0 or compiled <= 0 or excess <= 0:
        return None
    chosen: list[str] = []
    covered = 0.0
    for path in sorted(saving, key=lambda p: -saving[p]):
        chosen.append(path)
        covered += compiled * saving[path] / total
        if covered >= HEADROOM * excess:
            break
    if len(chosen) == len(saving):
        return None
    remat = tuple((p, policy if p in chosen else "none") for p in saving)
    on = ", ".join(chosen)
    return dataclasses.replace(base, name=f"{base.name} + remat {policy} on {on}", remat=remat)
