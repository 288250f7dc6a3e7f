"""`batch_size="auto"`: the largest chunk whose compiled temporaries fit a memory budget."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._compat import batched_leaves, is_tracer
from .programs import static_key

# Without `memory_budget=`, this fraction of the device's `bytes_limit` is the budget: the
# rest is left for the inputs, the outputs and whatever else lives on the device.
DEFAULT_FRACTION = 0.5


def check_memory_budget(memory_budget: Any, batch_size: Any, name: str) -> None:
    """Raises if `memory_budget` is not `None` or a positive int, or is given without "auto"."""
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float | np.number):
        raise TypeError(
            f"`{name}(memory_budget=...)` must be `None` or a number of bytes per device, "
            f"got {memory_budget!r} of type {type(memory_budget).__name__}. "
            "Pass e.g. `memory_budget=2**30` for 1 GiB."
        )
    if not 0 < memory_budget < math.inf:
        raise ValueError(
            f"`{name}(memory_budget=...)` must be a finite number > 0 of bytes, got "
            f"{memory_budget}. "
            "Pass e.g. `memory_budget=2**30` for 1 GiB."
        )
    if batch_size != "auto":
        raise ValueError(
            f'`{name}(memory_budget={memory_budget})` is only used with `batch_size="auto"`, '
            f'but `batch_size={batch_size!r}`. Pass `batch_size="auto"`, or drop '
            "`memory_budget`."
        )


def resolve_budget(memory_budget: int | float | None, name: str) -> int:
    """The budget in bytes per device: `memory_budget`, or a fraction of the device memory."""
    if memory_budget is not None:
        return int(memory_budget)
    device = jax.devices()[0]
    stats = device.memory_stats()
    limit = None if stats is None else stats.get("bytes_limit")
    if not limit:
        raise ValueError(
            f'`{name}(batch_size="auto")` needs a memory budget, but JAX does not report '
            f"how much memory a {device.platform!r} device has (`device.memory_stats()` is "
            f"{stats!r}). Pass `memory_budget=` in bytes per device, e.g. "
            "`memory_budget=2**30`."
        )
    return int(limit * DEFAULT_FRACTION)


def temp_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Bytes of temporaries per device of `jax.jit(fn)(*args)`, from `memory_analysis()`."""
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    if analysis is None:
        raise ValueError(
            '`batch_size="auto"` needs `compiled.memory_analysis()`, which this backend '
            f"({jax.default_backend()!r}) does not provide. Pass an int `batch_size`."
        )
    return int(analysis.temp_size_in_bytes)


def _abstract(x: Any) -> Any:
    """A `ShapeDtypeStruct` standing in for an array leaf, keeping a mesh layout (a leaf
    on one device is left free to move, as `jit` moves it)."""
    sharding = None if is_tracer(x) or not isinstance(x, jax.Array) else x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        sharding = None
    # NumPy's float64 is float32 to JAX without x64: canonical, as `jit` would make it.
    # (PRNG keys and other extended dtypes are canonical already.)
    extended = jnp.issubdtype(x.dtype, jax.dtypes.extended)
    dtype = x.dtype if extended else jax.dtypes.canonicalize_dtype(x.dtype)
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)


class AutoBatchSize:
    """Finds and caches, per input shapes and statics, the largest fitting chunk size."""

    def __init__(self, name: str, memory_budget: int | float | None):
        self.name = name
        self.memory_budget = memory_budget
        self.cache: dict[Hashable, int] = {}

    def __call__(
        self,
        run: Callable[[int, Any], Any],
        args: Any,
        n: int | Callable[[], int],
        step: int = 1,
    ) -> int:
        """The largest `k` (a multiple of `step`, at most `n` rounded up to `step`) such that
        `run(k, args)` compiles to temporaries within the budget. Under `jax.vmap` the
        program measured is the vmapped one (what `jit(vmap(...))` compiles). `n` may be a
        function, called only when the arguments' shapes and statics are new (it must be
        determined by them).
        """
        dynamic, static = eqx.partition(args, eqx.is_array)
        leaves, treedef = jtu.tree_flatten(dynamic)
        static_leaves, static_def = jtu.tree_flatten(static)
        budget = resolve_budget(self.memory_budget, self.name)
        batched = batched_leaves(leaves)
        vals, dims = batched if batched is not None else (leaves, (None,) * len(leaves))
        key = (
            treedef,
            static_def,
            tuple(static_key(s) for s in static_leaves),
            tuple(
                (x.shape, x.dtype, static_key(getattr(_abstract(x), "sharding", None)))
                for x in vals
            ),
            dims,
            None if callable(n) else n,
            step,
            budget,
        )
        if key not in self.cache:
            abstract = [_abstract(x) for x in vals]

            def measure(k: int) -> int:
                def program(*ls: Any) -> Any:
                    out = run(k, eqx.combine(jtu.tree_unflatten(treedef, ls), static))
                    return eqx.filter(out, eqx.is_array)  # `jit` returns arrays only

                if batched is not None:
                    program = jax.vmap(program, in_axes=dims)
                return temp_bytes(program, *abstract)

            rows = n() if callable(n) else n
            self.cache[key] = largest_fitting(measure, rows, budget, step, self.name)
        return self.cache[key]


def largest_fitting(
    measure: Callable[[int], int], n: int, budget: int, step: int, name: str
) -> int:
    """Binary search for the largest multiple `k` of `step` in `[step, ceil(n/step)*step]`
    with `measure(k) <= budget`, taking `measure` to grow with `k`.
    """
    top = max(1, -(-n // step))
    measure = functools.cache(measure)
    if measure(top * step) <= budget:
        return top * step
    smallest = measure(step)
    if smallest > budget:
        raise ValueError(
            f'`{name}(batch_size="auto")`: even the smallest chunk ({step} at a time) needs '
            f"{smallest:,} bytes of temporaries per device, more than "
            f"`memory_budget={budget:,}`. Raise `memory_budget` to at least {smallest:,}, "
            "or shrink the inputs (or shard them over more devices)."
        )
    lo, hi = 1, top  # measure(lo * step) fits; measure(hi * step) does not
    # Temporaries are mostly affine in `k`: try the interpolated answer and its neighbour
    # first (two compilations when the guess is right), then bisect what is left.
    guess = 1 + int((budget - smallest) / max(measure(top * step) - smallest, 1) * (top - 1))
    if lo < guess < hi:
        if measure(guess * step) <= budget:
            lo = guess
            if guess + 1 < hi and measure((guess + 1) * step) > budget:
                hi = guess + 1
        else:
            hi = guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(mid * step) <= budget:
            lo = mid
        else:
            hi = mid
    return lo * step
