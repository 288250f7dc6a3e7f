"""`filter_get`: array leaves to host NumPy, also for arrays that span other hosts."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _compat
from .._tree import Flat, T, leaf_error, pathstr
from . import multihost


def filter_get(tree: T) -> T:
    """Brings every array leaf of `tree` to the host as a NumPy array.

    Each leaf comes back whole: for an array sharded across devices, or across the
    devices of several processes (hosts), every process gets the full global value.
    Addressable arrays are fetched with one batched `jax.device_get`; arrays that span
    other processes with one `process_allgather` (a collective: every process must call
    `filter_get` on the same tree; a tree whose arrays spanning processes differ between
    processes raises on every process, before the gather, and a process that does not
    make the call at all, or makes it on a tree with no arrays spanning processes, is
    reported by the others after `EQXSHARD_SYNC_TIMEOUT` seconds, default 600, instead
    of a hang). Non-array leaves (NumPy string arrays included) are returned unchanged.

    PRNG key arrays (`jax.random.key`) have no NumPy form; they come back as key arrays
    on this process's default device, holding the full global value.

    **Arguments:**

    - `tree`: any PyTree.

    **Returns:**

    A PyTree with the structure of `tree`, its arrays as `numpy.ndarray`.

    **Raises:**

    - `TypeError`: if a leaf is traced (`filter_get` inside `jax.jit`, `vmap` or `grad`):
        there is no value to fetch while tracing.
    - `ValueError`: with several processes, if the arrays that span processes differ
        between them (paths, shapes or dtypes), naming them with what each process passed.
    - `TimeoutError`: with several processes, if some process did not call `filter_get`
        on arrays spanning processes within `EQXSHARD_SYNC_TIMEOUT` seconds (naming it).

    !!! Example

        ```python
        import jax
        import jax.numpy as jnp
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        x = eqxshard.filter_shard({"x": jnp.arange(8.0), "name": "x"}, mesh)
        host = eqxshard.filter_get(x)  # {"x": numpy array, "name": "x"}
        ```
    """
    flat = Flat(tree)
    arrays = flat.array_indices
    traced = [pathstr(flat.paths[i]) for i in arrays if _compat.is_tracer(flat.leaves[i])]
    if traced:
        raise TypeError(
            leaf_error(
                "`filter_get` cannot fetch traced leaves (it was called inside `jit`, `vmap`, "
                "`grad` or `eval_shape`):",
                [(p,) for p in traced],
                "Call `filter_get` outside the transformation, on its outputs.",
            )
        )
    keys = [i for i in arrays if _compat.is_prng_key(flat.leaves[i])]
    values = {
        i: jax.random.key_data(flat.leaves[i]) if i in keys else flat.leaves[i] for i in arrays
    }
    remote = [i for i in arrays if not _addressable(values[i])]
    remote_set = set(remote)
    local = [i for i in arrays if i not in remote_set]
    out: dict[int, Any] = {}
    if remote:
        # Every process gathers the same arrays, or none gathers: one bounded exchange of a
        # digest of these leaves first, so that different trees raise rather than mismatch.
        chosen = set(remote)
        multihost.check_same_leaves(
            "filter_get",
            [multihost.leaf_entry(flat.paths[i], values[i]) for i in remote],
            {
                pathstr(p): "an array on this process only"
                for i, p in enumerate(flat.paths)
                if i not in chosen
            },
            process_local=False,
        )
        gathered = _compat.process_allgather([values[i] for i in remote], tiled=True)
        out.update((i, np.asarray(g)) for i, g in zip(remote, gathered, strict=True))
    if local:
        fetched = jax.device_get([values[i] for i in local])
        out.update((i, np.asarray(g)) for i, g in zip(local, fetched, strict=True))
    for i in keys:
        out[i] = jax.random.wrap_key_data(out[i], impl=jax.random.key_impl(flat.leaves[i]))
    return flat.rebuild(out)


def _addressable(x: Any) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable
