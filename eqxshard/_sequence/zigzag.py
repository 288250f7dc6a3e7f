"""The load-balanced ("zig-zag") layout of a causal ring.

With causal attention the plain split leaves device `i` work on `i + 1` of the `C` key
blocks, so the last device does all `C` while the first does one. Cut the sequence into
`2C` chunks instead, and let device `i` hold chunks `i` and `2C-1-i` (one early, one
late): then at every ring step but the first, exactly half of each device's queries x
keys is unmasked (all its queries against the visiting early chunk, or its late chunk
against both visiting chunks), so every device does the same work and the masked half is
skipped. The caller's layout stays the plain split: device `d` holds chunks `2d` and
`2d+1`; two `ppermute`s (the even chunks, then the odd ones) move each chunk to its
owner, and two more move the output back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _owner(chunk: int, size: int) -> int:
    return chunk if chunk < size else 2 * size - 1 - chunk


def _moves(size: int, parity: int) -> list[tuple[int, int]]:
    """Where each device's even (`parity` 0) or odd chunk goes: a permutation."""
    return [(d, _owner(2 * d + parity, size)) for d in range(size)]


def to_zigzag(x: Any, *, axis: str, size: int, dim: int = 1) -> Any:
    """A device's plain block of the sequence (dim `dim`) as its zig-zag block."""
    first, second = jnp.split(x, 2, axis=dim)
    even = jax.lax.ppermute(first, axis, _moves(size, 0))
    odd = jax.lax.ppermute(second, axis, _moves(size, 1))
    mine_even = jax.lax.axis_index(axis) % 2 == 0  # chunk i is even where i is
    early = jnp.where(mine_even, even, odd)
    late = jnp.where(mine_even, odd, even)
    return jnp.concatenate([early, late], axis=dim)


def from_zigzag(x: Any, *, axis: str, size: int, dim: int = 1) -> Any:
    """A device's zig-zag block of the sequence back as its plain block."""
    early, late = jnp.split(x, 2, axis=dim)
    mine_even = jax.lax.axis_index(axis) % 2 == 0
    even = jnp.where(mine_even, early, late)
    odd = jnp.where(mine_even, late, early)
    first = jax.lax.ppermute(even, axis, [(b, a) for a, b in _moves(size, 0)])
    second = jax.lax.ppermute(odd, axis, [(b, a) for a, b in _moves(size, 1)])
    return jnp.concatenate([first, second], axis=dim)


def positions(device: Any, length: int, *, size: int, zigzag: bool) -> Any:
    """The sequence positions of the `length` rows `device` holds."""
    if not zigzag:
        return device * length + jnp.arange(length)
    half = length // 2
    early = device * half + jnp.arange(half)
    late = (2 * size - 1 - device) * half + jnp.arange(half)
    return jnp.concatenate([early, late])
