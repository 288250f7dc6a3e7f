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
