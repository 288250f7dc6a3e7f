"""Every cache eqxshard keeps, cleared by one call.

A module that keeps a cache registers the function that empties it (`register`) when it
is imported; `eqxshard.clear_caches` calls them all (`clear_all`). This module imports
nothing of eqxshard's, so any layer may register with it."""

from __future__ import annotations

from collections.abc import Callable

_CLEARS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Records `clear` (a function of no arguments that empties one cache) and returns it,
    so it can be used as a decorator."""
    _CLEARS.append(clear)
    return clear


def clear_all() -> None:
    """Empties every registered cache."""
    for clear in list(_CLEARS):
        clear()


def clear_caches() -> None:
    """Empties every cache eqxshard keeps between calls.

    eqxshard remembers work across calls: the placement plans of trees seen before, the
    programs `filter_stream` and the Jacobian verbs compiled, the sizes `auto_plan`
    measured. Call this to free that memory, or after changing something those caches
    cannot see (e.g. environment variables or JAX flags a compiled program depends on).
    The next call of each verb then works from scratch, as the first one did. JAX's own
    caches (`jax.clear_caches`) are left alone.

    **Returns:**

    `None`.

    !!! Example

        ```python
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        eqxshard.filter_shard({"w": jnp.ones((8, 2))}, mesh, P("data"))
        eqxshard.clear_caches()  # the next call plans the placement again
        ```
    """
    clear_all()
