"""The compiled programs (and chosen chunk sizes) the Jacobian verbs of one function and
options share, so that `filter_hessian(f, batch_size=3)(x)` written out at every call (as
`jax.hessian(f)(x)` is) compiles once per input signature, not at every call (jax#7621),
without keeping the function, or the arrays it closes over, alive: a function equal only
to itself is keyed by a weak reference (its entries go when it does), and the programs
reach it through a `Slot` that holds it only while they run."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .._caches import register
from .budget import AutoBatchSize
from .programs import Programs

# By (verb, mode, the function's key, options), least recently used first.
SHARED: OrderedDict[Any, tuple[Programs, AutoBatchSize | None, Slot | None]] = OrderedDict()
_SHARED_SIZE = 64
register(SHARED.clear)


class Slot:
    """Where the shared programs find the function: set for the length of a call (a trace
    reads it), empty otherwise. Hashed and compared by identity, one per entry."""

    def __init__(self) -> None:
        self.fun: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fun(*args, **kwargs)


def _forget(ref: weakref.ref) -> None:
    """Drops the entries of a function that is gone (a weak reference's callback)."""
    for key in [k for k in SHARED if _holds(k, ref)]:
        del SHARED[key]


def _holds(key: Any, ref: weakref.ref) -> bool:
    return key is ref or (isinstance(key, tuple) and any(_holds(k, ref) for k in key))


def _fun_key(fun: Any) -> Any:
    """What stands for `fun` in a key: a weak reference for a function equal only to
    itself (a closure, a partial), the key of the function a verb differentiates for
    that verb (the inner Jacobian of `filter_hessian`), else `fun` itself (an equal
    object, such as a module without arrays, may stand for it). A `TypeError` if `fun`
    cannot be hashed (a module holding arrays)."""
    key = getattr(fun, "shared_key", None)
    if key is not None:
        return key(_fun_key)
    hash(fun)
    if type(fun).__eq__ is object.__eq__:
        try:
            return weakref.ref(fun, _forget)
        except TypeError:  # no weak references (a builtin): it holds no arrays
            pass
    return fun


def shared(
    key: tuple, run: Callable[..., Any]
) -> tuple[Programs, AutoBatchSize | None, Slot | None]:
    """The programs, chunk sizes and function slot shared by the verbs of one function and
    options; for a function that cannot be hashed (a module holding arrays, whose arrays
    its programs take as inputs), new programs and chunk sizes, and no slot."""
    name, rev, fun, has_aux, batch_size, memory_budget, mesh, axes = key
    try:
        key = (name, rev, _fun_key(fun), has_aux, batch_size, memory_budget, mesh, axes)
        found = SHARED.get(key)
        hashable = True
    except TypeError:
        found, hashable = None, False
    if found is None:
        auto = AutoBatchSize(name, memory_budget) if batch_size == "auto" else None
        found = (Programs(run), auto, Slot() if hashable else None)
        if hashable:
            SHARED[key] = found
            while len(SHARED) > _SHARED_SIZE:
                SHARED.popitem(last=False)
    else:
        SHARED.move_to_end(key)
    return found
