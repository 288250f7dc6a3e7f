"""`filter_jit`: `eqx.filter_jit` with `in_shardings`, `out_shardings` and per-leaf
donation (how a call runs is in `call.py`)."""

from __future__ import annotations

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from .._tree import Params, T, leaf_error, pathstr
from . import donate as _donate, layouts as _layouts
from .call import _Config, _JitWrapper, _names


def _check_layouts(value: Any, argname: str) -> None:
    entries = jax.tree_util.tree_flatten_with_path(value, is_leaf=_layouts.is_layout_leaf)[0]
    bad = [
        (pathstr(p), f"{type(x).__name__} {x!r}")
        for p, x in entries
        if not _layouts.is_layout_leaf(x)
    ]
    if bad:
        raise TypeError(
            leaf_error(
                f"`filter_jit` takes `{argname}` as a layout or a prefix tree of them, but "
                "this tree has other leaves:",
                bad,
                "A layout is a Sharding, a Device, a Mesh (replicated), a PartitionSpec, a rule "
                "(`fsdp`, `path_rules`, `like`, ...), a callable `(path, leaf) -> PartitionSpec "
                "| None`, or `None` (leave alone).",
            )
        )


@overload
def filter_jit(
    fun: None = None,
    *,
    donate: Any = "none",
    in_shardings: Any = None,
    out_shardings: Any = None,
    mesh: Any = None,
    move_inputs: bool = True,
) -> Callable[[Callable[Params, T]], Callable[Params, T]]: ...


@overload
def filter_jit(
    fun: Callable[Params, T],
    *,
    donate: Any = "none",
    in_shardings: Any = None,
    out_shardings: Any = None,
    mesh: Any = None,
    move_inputs: bool = True,
) -> Callable[Params, T]: ...


def filter_jit(
    fun: Any = None,
    *,
    donate: Any = "none",
    in_shardings: Any = None,
    out_shardings: Any = None,
    mesh: Any = None,
    move_inputs: bool = True,
) -> Any:
    """`eqx.filter_jit` that also lays out the call's inputs and outputs and donates
    chosen leaves: the training step around a sharded model.

    As in `eqx.filter_jit`, every JAX and NumPy array leaf of the arguments (and of
    `fun` itself, for a bound method or a callable `eqx.Module`) is traced and every
    other leaf is held static: static leaves and the tree structure are the cache key
    (so they must be hashable), and a call retraces exactly when `eqx.filter_jit`'s
    would. It works on functions, methods (decorate them in the class body) and bound
    modules, inside another `jit`, `grad` or `vmap`, and has `.lower(*args)`.

    Beyond it: the program compiled is the one `jax.jit(f, in_shardings=...,
    out_shardings=..., donate_argnums=...)` written by hand compiles, with the array
    leaves in their flattening order (no arguments reordered by donation, equinox
    #1077), from layouts written in eqxshard's forms.

    **Arguments:**

    - `fun`: the function to compile. `filter_jit(**options)` without it returns a
        decorator.
    - `donate`: which array leaves give their buffers to the outputs. One of:
        - `"none"` (default), `"all"`, `"all-except-first"` (not those of the first
            argument), `"warn"`, `"warn-except-first"`: as in `eqx.filter_jit` ("all"
            forms also donate the arrays of `fun` itself and hide JAX's warning about
            donated buffers it could not use; the "warn" forms show it). As there, the
            module of `filter_jit(model.method, donate="all")` or of a callable module
            is deleted by the first call, and so is the `self` of a method decorated in
            the class body (its first argument): keep `self` with `"all-except-first"`,
            and the arrays of `fun` with a tree over the arguments (below);
        - a filter `leaf -> bool`, called on each array leaf (of `fun` too): `True`
            donates it;
        - a prefix tree of bools over the positional arguments, e.g. `(True, False)` to
            donate the whole first argument and keep the second, or
            `({"params": True, "opt_state": True, "stats": False}, False)`. Leaves of
            `fun` and of `**kwargs` are kept.
        JAX's warning for donated buffers it could not reuse is shown for the filter
        and tree forms.
    - `in_shardings`: the layout of the inputs. `None` (default): as they come. Else one
        layout for every array leaf, or a tuple with one entry per positional argument
        (after binding keywords to their parameters), each a prefix tree of that
        argument. (The arrays of `fun` itself, a bound module's, are left as they are.)
        A layout is any form `filter_shard` takes as a `target` or a `spec`:
        - a `jax.sharding.Sharding` (e.g. from `filter_shardings`, whose trees fit as they
            are) or a `jax.Device`;
        - a `Mesh`: replicated on it;
        - a `PartitionSpec`, or a rule (`fsdp`, `path_rules`, `logical`, `like(params)`,
            `first`), or a callable `(path, leaf) -> PartitionSpec | None`: over `mesh`.
            A rule sees paths from where it was given (`path_rules` under the first
            argument matches `layers.0.weight`, not `0.layers.0.weight`);
        - `None`: leave that subtree alone.
    - `out_shardings`: the layout of the outputs, in the same forms, as a prefix tree of
        the output (e.g. `(P(), like(params))` for `(loss, opt_state)`). Non-array
        outputs are returned as they are.
    - `mesh`: the mesh that `PartitionSpec`s and rules in `in_shardings` and
        `out_shardings` lay leaves out over. `None` (default) is the mesh set by
        `jax.set_mesh`. A mesh with Explicit axes is in context while `fun` is traced
        (where none is set), as JAX's ops on such axes need it.
    - `move_inputs`: `True` (default): committed inputs not laid out as `in_shardings`
        asks are moved before the call, all in one batched `jax.device_put`, the path
        `filter_shard` takes (inside an outer `jit`, a layout constraint); inputs laid out
        already are not touched. `False`: such inputs are an error naming each leaf,
        its layout and the one asked for (to catch a step fed data in the wrong layout
        instead of paying for the move every step). NumPy and uncommitted inputs are
        placed by `jit` itself either way, as `jax.jit` places them.

    **Returns:**

    The compiled version of `fun`, called as `fun` is. Its `.lower(*args)` returns an
    object with `.as_text()`, `.lowered` (JAX's `Lowered`) and `.compile()`, whose result
    is called with the same arguments and has `.memory_analysis()`.

    **Raises:**

    - `TypeError`: if `fun` is not callable; for a `donate`, `in_shardings`,
        `out_shardings`, `mesh` or `move_inputs` of the wrong type (naming each bad leaf
        of a tree); when called, for static leaves that are not hashable (naming them),
        a `donate` filter that returns a non-bool, or arguments laid out by
        `in_shardings` with a dtype JAX has no arrays of (NumPy strings, objects),
        naming each.
    - `ValueError`: for a `donate` string that is none of the five; when called with
        arrays an earlier call donated (naming each, with how to keep them); for a
        `donate`, `in_shardings` or `out_shardings` tree that is not a prefix of the
        arguments or output; for specs or rules with no `mesh` and none set; the
        errors of `filter_shard` about each layout (axes the mesh lacks, dims that do not
        divide, ...), naming the argument (`in_shardings` or `out_shardings`) and every
        failing leaf; with `move_inputs=False`, for inputs in another layout.
    - JAX's `ShardingTypeError` from tracing `fun` (an op whose output layout JAX cannot
        infer on Explicit mesh axes, e.g. an `eqx.nn.Embedding` lookup of a row-split
        batch) is raised as it is, with a note saying to build the mesh with Auto axes or
        to give the op `out_sharding=`.

    !!! Example

        ```python
        import optax
        from jax.sharding import PartitionSpec as P

        # Auto axes: XLA gathers the fsdp-split weights where the step needs them.
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        make = lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key)
        model = eqxshard.filter_init(make, mesh, eqxshard.fsdp("data"))(jax.random.key(0))
        optimiser = optax.adamw(1e-3)
        params = eqx.filter(model, eqx.is_array)
        opt_state = eqxshard.filter_init(optimiser.init, mesh, eqxshard.like(params))(params)

        @eqxshard.filter_jit(
            donate=(True, True, False),  # the model and the state, not the batch
            in_shardings=(None, None, P("data")),
            out_shardings=(None, eqxshard.like(params), P()),
            mesh=mesh,
        )
        def step(model, opt_state, x):
            loss, grads = eqx.filter_value_and_grad(
                lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
            )(model)
            params = eqx.filter(model, eqx.is_array)
            updates, opt_state = optimiser.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, loss

        x = jnp.ones((8 * jax.device_count(), 64))
        model, opt_state, loss = step(model, opt_state, x)
        ```
    """
    if fun is None:
        return ft.partial(
            filter_jit,
            donate=donate,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            mesh=mesh,
            move_inputs=move_inputs,
        )
    if not callable(fun):
        raise TypeError(f"`filter_jit` takes a callable `fun`, but got {type(fun).__name__}.")
    _donate.check(donate)
    _check_layouts(in_shardings, "in_shardings")
    _check_layouts(out_shardings, "out_shardings")
    if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"`filter_jit` takes `mesh` as a `jax.sharding.Mesh` or None, but got "
            f"{type(mesh).__name__}. Pass the mesh the specs and rules of `in_shardings`/"
            "`out_shardings` refer to."
        )
    if not isinstance(move_inputs, (bool, np.bool_)):
        raise TypeError(
            f"`filter_jit` takes `move_inputs` as a bool, but got {move_inputs!r} of type "
            f"{type(move_inputs).__name__}."
        )
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        signature = None
    config = _Config(donate, in_shardings, out_shardings, mesh, bool(move_inputs))
    wrapper = _JitWrapper(fn=_names(fun)[0], _fun=fun, _signature=signature, _config=config)
    return eqx.module_update_wrapper(wrapper)
