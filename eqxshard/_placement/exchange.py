"""Small host data shared between the processes of a run, with a bound on the wait.

Every cross-process check eqxshard makes (the digest of the leaves a call places, the
table shown when they differ, the checksums of host data) goes through `allgather`: each
process posts its bytes to JAX's coordination service (the key-value store that
`jax.distributed.initialize` starts) and reads the others', waiting at most
`timeout()` seconds. A process that never makes the matching call (it took another
branch, or failed before reaching it) is then reported by name, instead of the run
hanging in a collective that never completes. The data collectives that follow a check
(`process_allgather` in `filter_get`, the transfers in `filter_shard`) only run once
every process has agreed, so they cannot mismatch either.

The wait is a barrier of the coordination service: if one process times out, the barrier
fails for every process, also one that comes later, which then raises at once instead
of going on alone.

Calls are matched by their order: the n-th exchange of one process meets the n-th of
every other, and the call's `verb` travels with the data, so two processes at the n-th
exchange of different verbs see it in the check's message.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import jax
import numpy as np

from .. import _compat

TIMEOUT_VAR = "EQXSHARD_SYNC_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
_PREFIX = "eqxshard/exchange"

_calls = itertools.count()
_failed: str | None = None  # the check that timed out on this process, if one did


class SyncTimeoutError(TimeoutError):
    """A cross-process check of eqxshard waited longer than `EQXSHARD_SYNC_TIMEOUT`."""


def timeout() -> float:
    """Seconds one exchange waits for the other processes: `EQXSHARD_SYNC_TIMEOUT` (default
    600)."""
    raw = os.environ.get(TIMEOUT_VAR)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{TIMEOUT_VAR}={raw!r} must be a number of seconds > 0 (the longest eqxshard "
            "waits for the other processes in a cross-process check). Unset it for the "
            f"default of {DEFAULT_TIMEOUT:g} s."
        )
    return value


def allgather(verb: str, payload: bytes) -> list[bytes]:
    """Every process's `payload`, in process order; the same list on every process.

    Each process must call it as often as the others and in the same order (eqxshard
    decides from a call's arguments, never from timing). After one timed out, every
    later call raises at once. Each process posts its payload,
    waits at a barrier of this call for the others (at most `timeout()` seconds), then
    reads all payloads in one request: a few requests per process, whatever the number
    of processes. Raises `SyncTimeoutError` naming the processes that did not come; a
    process that comes after the others gave up raises at once, as they did.
    """
    count = jax.process_count()
    if count == 1:
        return [payload]
    limit = timeout()
    client = _compat.coordination_client()
    if client is None:  # pragma: no cover - every JAX eqxshard supports has the client
        return _allgather_collective(payload)
    global _failed
    if _failed is not None:
        raise SyncTimeoutError(
            f"`{verb}` cannot check its leaves across processes: an earlier cross-process "
            f"check timed out on this process ({_failed}), so the processes' calls no longer "
            "pair up. End the run and fix that call first."
        )
    call = next(_calls)
    me = jax.process_index()
    client.key_value_set_bytes(f"{_PREFIX}/{call}/{me}", payload)
    try:
        # One barrier id for all calls: the coordination service counts its uses, so the
        # n-th wait of one process meets the n-th of the others (and keeps no state per
        # call). After a timeout the counts no longer pair up: no further wait is made.
        client.wait_at_barrier(f"{_PREFIX}/barrier", max(1, int(limit * 1000)))
    except Exception as e:  # JAX's runtime error, DEADLINE_EXCEEDED when it timed out
        if "DEADLINE_EXCEEDED" not in str(e):
            raise
        _failed = f"`{verb}`, check #{call}"
        raise SyncTimeoutError(_late(verb, call, me, count, limit, client)) from None
    rows = client.key_value_dir_get_bytes(f"{_PREFIX}/{call}/")
    by_process = {int(key.rsplit("/", 1)[1]): bytes(value) for key, value in rows}
    if call >= 2:  # every process has read call - 2: it reached barrier call - 1 after that
        client.key_value_delete(f"{_PREFIX}/{call - 2}/{me}")
    return [by_process[p] for p in range(count)]


def _late(verb: str, call: int, me: int, count: int, limit: float, client: Any) -> str:
    """The message of a timed-out exchange: who never came, or that this process is late."""
    missing = [p for p in range(count) if p != me and not _posted(client, call, p)]
    advice = (
        "Every process must make the same eqxshard calls in the same order with the same "
        "kind of tree: here some process skipped this call, called it on a tree with no "
        "arrays spanning processes, or failed before it (see its own error). A process that "
        f"is only slow needs a larger {TIMEOUT_VAR} (seconds)."
    )
    if missing:
        return (
            f"`{verb}` waited {limit:g} s for process(es) {missing} to make the same call "
            f"(eqxshard's cross-process check #{call} on process {me}), and they did not. " + advice
        )
    return (
        f"`{verb}` came to eqxshard's cross-process check #{call} on process {me} after "
        f"the other processes had stopped waiting for it ({limit:g} s). " + advice
    )


def _posted(client: Any, call: int, process: int) -> bool:
    try:
        client.key_value_try_get_bytes(f"{_PREFIX}/{call}/{process}")
    except Exception:
        return False
    return True


def _allgather_collective(payload: bytes) -> list[bytes]:  # pragma: no cover
    """The same through an XLA collective (unbounded), where JAX offers no client."""
    size = np.array([len(payload)], dtype=np.int64).view(np.uint8)
    sizes = np.asarray(_compat.process_allgather(size, tiled=False))
    lengths = [int(n) for n in np.ascontiguousarray(sizes).view(np.int64).reshape(-1)]
    padded = np.zeros(max(lengths), dtype=np.uint8)
    padded[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    rows = np.asarray(_compat.process_allgather(padded, tiled=False))
    return [row[:n].tobytes() for row, n in zip(rows, lengths, strict=True)]


def allgather_array(verb: str, values: np.ndarray) -> np.ndarray:
    """`allgather` of a small host array: shape `(process_count, *values.shape)`."""
    raw = np.ascontiguousarray(values).tobytes()
    rows = allgather(verb, raw)
    return np.stack([np.frombuffer(r, dtype=values.dtype).reshape(values.shape) for r in rows])
