"""`filter_stream`: `filter_map` for inputs on the host that do not fit on the devices.

Its jitted chunk step is compiled once per kind of input and kept (`compiled_step`); the
moves between host and devices are in `stream_host.py`.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import tqdm
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._compat import is_tracer
from .._tree import fun_optional, pathstr
from . import chunks
from .stream_host import NAME, check_dtypes, host_chunk, output_to_host, rows_from_host


def _aval(x: Any) -> tuple[Any, ...]:
    """What `jax.jit` compiles for: shape, dtype, weak type and sharding."""
    return (
        x.shape,
        x.dtype,
        getattr(x, "weak_type", False),
        getattr(x, "sharding", None),
    )


def _hashable(tree: Any) -> tuple[Any, ...]:
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


Step = tuple[Callable[..., Any], list[chunks.Trace]]


def compiled_step(
    cache: dict[Any, Step],
    fun: Callable[..., Any],
    args_def: Any,
    static: list[Any],
    idx: list[int],
    const_idx: list[int],
    out_axes: Any,
    chunk: list[Any],
    consts: list[Any],
) -> Step:
    """The jitted chunk step, cached as `eqx.filter_jit` does: keyed by the non-array
    leaves (hashed) and the shapes, dtypes and shardings of the arrays. Unhashable
    non-array leaves get a fresh step (compiled on each call)."""
    key = (
        args_def,
        tuple((type(x), x) for x in static),
        tuple(idx),
        tuple(const_idx),
        _hashable(out_axes),
        tuple(_aval(x) for x in chunk),
        tuple(_aval(x) for x in consts),
    )
    try:
        hit = cache.get(key)
    except Exception:  # unhashable, or `==` that does not return a bool
        key, hit = None, None
    if hit is not None:
        return hit
    traces: list[chunks.Trace] = []

    @jax.jit
    def step(chunk: list[Any], consts: list[Any]) -> Any:
        full = list(static)
        for i, c in zip(const_idx, consts, strict=True):
            full[i] = c
        return chunks.vmapped_body(fun, args_def, full, idx, out_axes, traces, NAME)(chunk)

    if key is not None:
        cache[key] = (step, traces)
    return step, traces


def _run(
    fun: Callable[..., Any],
    batch_size: int,
    in_axes: Any,
    out_axes: Any,
    mesh: Mesh | None,
    progress: bool,
    desc: str | None,
    cache: dict[Any, Step],
    args: tuple[Any, ...],
) -> Any:
    flat, args_def = jtu.tree_flatten_with_path(args)
    paths = [pathstr(p, "args") for p, _ in flat]
    leaves = [x for _, x in flat]
    traced = [p for p, x in zip(paths, leaves, strict=True) if is_tracer(x)]
    if traced:
        raise TypeError(
            f"`{NAME}` moves data between host and devices, so it runs outside `jax.jit` "
            f"(and `grad`, `vmap`, ...), but these arguments are traced: {', '.join(traced)}. "
            "Inside a transformation use `eqxshard.filter_map` instead."
        )
    check_dtypes(NAME, paths, leaves)
    in_axes = chunks.named_in_axes(fun, in_axes, args, NAME)
    resolved = chunks.resolve_axes(args, in_axes, "in_axes", NAME)
    ax = {i: a for i, a in enumerate(resolved) if a is not None}
    if not ax:
        raise ValueError(
            f"`{NAME}` found nothing to stream: `in_axes` maps no argument. Give the inputs "
            "to stream an int axis (the default `eqx.if_array(0)` maps every array)."
        )
    n = chunks.check_mapped_leaves(paths, leaves, ax, NAME, host=True)
    idx = list(ax)
    streamed = [leaves[i] if ax[i] == 0 else np.moveaxis(leaves[i], ax[i], 0) for i in idx]
    if isinstance(mesh, Mesh):
        if batch_size % mesh.size:
            raise ValueError(
                f"`{NAME}(batch_size={batch_size})` must be a multiple of the {mesh.size} "
                f"devices of `mesh` {dict(mesh.shape)}, to split each chunk evenly. Pass "
                f"batch_size={-(-batch_size // mesh.size) * mesh.size}, for example."
            )
        rows = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
        broadcast = NamedSharding(mesh, PartitionSpec())
    elif mesh is None:
        rows = broadcast = None
    else:
        raise TypeError(
            f"`{NAME}(mesh=...)` must be a `jax.sharding.Mesh` or `None`, "
            f"got {type(mesh).__name__}."
        )

    # Broadcast arrays go to the devices once; `fun`'s other leaves are static: hashed into
    # the cache key of the compiled step and closed over (the streamed data never is).
    const_idx = [i for i, x in enumerate(leaves) if i not in ax and eqx.is_array(x)]
    consts = [leaves[i] for i in const_idx]
    if broadcast is not None or not all(isinstance(x, jax.Array) for x in consts):
        consts = jax.device_put(consts, broadcast)  # (JAX arrays stay where they are)
    static = [None if i in ax or i in const_idx else x for i, x in enumerate(leaves)]

    def put(j: int) -> list[Any]:
        start, stop = j * batch_size, min(n, (j + 1) * batch_size)
        if rows is not None and not rows.is_fully_addressable:
            # A mesh over several processes: each reads and fills only its own devices'
            # rows (`device_put` would compare the whole chunk across processes).
            return [rows_from_host(x, start, stop, batch_size, rows) for x in streamed]
        return jax.device_put([host_chunk(x, start, stop, batch_size) for x in streamed], rows)

    def compiled(chunk: list[Any]) -> Step:
        return compiled_step(cache, fun, args_def, static, idx, const_idx, out_axes, chunk, consts)

    num_chunks = -(-n // batch_size)
    if num_chunks == 0:
        empty = [host_chunk(x, 0, 0, 0) for x in streamed]
        step, traces = compiled(empty)
        mapped_out, unmapped_out = jax.device_get(step(empty, consts))
        mapped_out = [np.asarray(y) for y in mapped_out]
    else:
        mapped_out, unmapped_out = None, []
        # `tqdm.auto` (a widget in Jupyter) warns on import in a kernel without ipywidgets:
        # import it only when a bar is shown. `disable=None`: no bar unless on a terminal.
        bar_class = _auto_tqdm() if progress else tqdm.tqdm
        bar = bar_class(
            total=n, unit="row", disable=None if progress else True, desc=_label(fun, desc)
        )
        with bar:
            pending = put(0)
            step, traces = compiled(pending)
            for j in range(num_chunks):
                result = step(pending, consts)  # runs asynchronously...
                pending = put(j + 1) if j + 1 < num_chunks else None  # ...while this copies
                # Blocks until chunk `j` is done. (`np.asarray` per leaf: measured faster
                # than `jax.device_get` on the whole result.)
                ys, unmapped = ([output_to_host(y) for y in part] for part in result)
                del result
                if mapped_out is None:
                    mapped_out = [np.empty((n, *y.shape[1:]), y.dtype) for y in ys]
                    unmapped_out = unmapped
                start, stop = j * batch_size, min(n, (j + 1) * batch_size)
                for out, y in zip(mapped_out, ys, strict=True):
                    out[start:stop] = y[: stop - start]
                bar.update(stop - start)
        assert mapped_out is not None
    return traces[0].output(mapped_out, [np.asarray(u) for u in unmapped_out], np.moveaxis)


def _check_batch_size(*, batch_size: Any, **_: Any) -> None:
    """Checks `filter_stream`'s `batch_size`, with or without `fun`."""
    chunks.check_batch_size(batch_size, NAME, allow_none=False)


@fun_optional(check=_check_batch_size)
def filter_stream(
    fun: Callable[..., Any] | None = None,
    *,
    batch_size: int,
    in_axes: Any = chunks.IF_ARRAY_0,
    out_axes: Any = chunks.IF_ARRAY_0,
    mesh: Mesh | None = None,
    progress: bool = True,
    desc: str | None = None,
) -> Any:
    """Maps `fun` over inputs that live on the host, `batch_size` rows at a time, for
    data larger than the devices' memory. Results come back to the host as NumPy arrays.

    The companion of [`eqxshard.filter_map`][], which maps data already on the devices.
    Each call of the returned function:

    - sends the mapped inputs to the devices one chunk of `batch_size` rows at a time,
        sharded over `mesh` if one is given, and copies chunk `j + 1` while chunk `j`
        computes, so at most two input chunks (and one output chunk) are on the devices;
    - sends the broadcast (`in_axes=None`) arrays, e.g. a model, once (replicated on
        `mesh` if one is given);
    - compiles `fun` once: the last, shorter chunk is **padded** by repeating its last
        row, and the padded rows are dropped from the results;
    - writes the results into preallocated NumPy arrays, with a `tqdm` progress bar.

    The compiled program is cached across calls of the returned function, as
    `eqx.filter_jit` does: keyed by the non-array leaves of the arguments (hashed) and the
    shapes, dtypes and shardings of the chunks and the broadcast arrays. A later call with
    new data of the same kind compiles nothing. (Arguments with unhashable non-array
    leaves are compiled afresh on each call.) Keep the returned function to reuse it.

    It runs outside `jax.jit`. Results equal `eqx.filter_vmap(fun, in_axes=in_axes,
    out_axes=out_axes)(*args)`, copied to the host.

    With a `mesh` over several processes, call it on every process with the same data
    (e.g. the same h5py file opened on each): each process reads only the rows of each
    chunk that its own devices hold (no chunk is read whole, compared or gathered
    across hosts), and every process gets all the results.

    **Arguments:**

    - `fun`: the function to map, called as `fun(*args)`. Leave it out to use
        `filter_stream(batch_size=...)` as a decorator.
    - `batch_size`: rows per chunk, an int `>= 1`; with a `mesh`, a multiple of
        `mesh.size`.
    - `in_axes`: which inputs to stream, a prefix PyTree of the arguments tuple (or, as
        for `eqx.filter_vmap`, a dict keyed by argument name, e.g. `dict(model=None)`;
        arguments it does not name get `eqx.if_array(0)`) with
        - `0`: stream its rows. Any object with `len(x)` (or `x.shape`) and `x[i:j]` slicing
            works: NumPy arrays and `np.memmap`, `h5py`/`zarr` datasets, JAX arrays;
        - another int: stream along that axis (NumPy and JAX arrays only);
        - `None`: broadcast it to every row;
        - a callable `leaf -> int | None`; the default `eqx.if_array(0)` streams every
            array and broadcasts everything else. Other indexables need an explicit `0`.
    - `out_axes`: where the mapped axis goes in each output, as for `filter_map`.
        (There is no `axis_name`: a stream always runs in chunks, where a collective over
        the mapped axis cannot see every row. Use `filter_map` or reduce the results.)
    - `mesh`: a `jax.sharding.Mesh`: split each chunk's rows over all its devices.
        `None`: use the default device.
    - `progress`: `True`: show a `tqdm` progress bar when standard error is a terminal
        (nothing is written to log files or pipes); `False`: never.
    - `desc`: the progress bar's label. `None` uses `fun.__name__`, or `"filter_stream"`
        for a lambda or a callable without a name.

    **Returns:**

    The streaming function (or, with `fun` left out, a decorator that makes it). It
    returns `fun`'s output PyTree with NumPy arrays in place of arrays.

    **Raises:**

    - `TypeError`: if `fun` is not callable; if `batch_size` is not an int; if `mesh` is
        not a `Mesh`; if `desc` is not a string; if a mapped leaf cannot be sliced into
        rows; if an array argument has a dtype JAX has no arrays of (NumPy strings,
        objects), naming each; if any argument is a tracer (use `filter_map` inside
        `jit`); if keyword arguments are passed to the streaming function; as
        `filter_map` for `in_axes`/`out_axes` holding other things than `None`, ints and
        callables.
    - `ValueError`: if `batch_size <= 0` or is not a multiple of `mesh.size`; if no input
        is mapped; if an `in_axes` axis is out of range or mapped inputs have different
        numbers of rows, listing every such leaf; if a dict `in_axes` names no argument;
        as `filter_map` for `out_axes` (not a prefix, out of range, or `None` on an
        output that varies with the rows, naming the output's path).

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import numpy as np
        import eqxshard

        model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(0))
        data = np.random.default_rng(0).normal(size=(10_000, 8)).astype(np.float32)

        predict = eqxshard.filter_stream(
            lambda model, x: model(x), batch_size=1024, in_axes=(None, 0), progress=False
        )
        values = predict(model, data)  # np.ndarray of shape (10000, 1)
        ```
    """
    if not callable(fun):
        raise TypeError(f"`{NAME}(fun)` must be callable, got {type(fun).__name__}.")
    if desc is not None and not isinstance(desc, str):
        raise TypeError(f"`{NAME}(desc=...)` must be a string or `None`, got {desc!r}.")
    cache: dict[Any, Step] = {}

    @ft.wraps(fun)
    def streamed(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"a function wrapped by `{NAME}` takes positional arguments only, got "
                f"keyword arguments {sorted(kwargs)}. Pass them positionally."
            )
        return _run(fun, int(batch_size), in_axes, out_axes, mesh, progress, desc, cache, args)

    return streamed


def _label(fun: Callable[..., Any], desc: str | None) -> str:
    """The progress bar's label: `desc`, else `fun`'s name, else `"filter_stream"`."""
    if desc is not None:
        return desc
    name = getattr(fun, "__name__", None)
    return name if isinstance(name, str) and name.isidentifier() else NAME


def _auto_tqdm() -> type[tqdm.tqdm]:
    from tqdm.auto import tqdm as auto_tqdm

    return auto_tqdm
