"""`filter_jit`: `eqx.filter_jit` with `in_shardings`, `out_shardings` and per-leaf
donation, the wrapper it returns, and how a call of it runs.

A call flattens `(fun, args, kwargs)` once: array leaves are traced, the rest (with the
tree structure) is held static and is the cache key, as in `eqx.filter_jit`. Each key
has its entry (`entry.py`): one `jax.jit` with the resolved `in_shardings`,
`out_shardings` and `donate_argnums` over the array leaves in their flattening order,
resolved once per input signature where layouts or a `donate` filter depend on shapes.
A call like one seen before only flattens, splits the leaves, looks its entry up, checks
that laid-out inputs are still the very layouts last found right, calls the `jax.jit` and
rebuilds the output. A `ShardingTypeError` raised while tracing on Explicit mesh axes
gets a note saying what to change (`explained`).
"""

from __future__ import annotations

import contextlib
import functools as ft
import inspect
import operator
import os
import warnings
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from .. import _compat
from .._caches import register
from .._compat import equinox_runtime_error, is_tracer
from .._tree import Flat, fun_optional
from . import donate as _donate, layouts as _layouts
from .entry import Entry, build, lay_out, output
from .leaves import Split, hashable_key

# Per static part of a call (with the configuration): its entry, or its entries by
# input signature.
SITES: dict[Any, dict[Any, Any]] = {}
register(SITES.clear)


@fun_optional(keeps_signature=True)
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

        optimiser = optax.adamw(1e-3)
        # Auto axes: XLA gathers the fsdp-split weights where the step needs them.
        mesh = jax.make_mesh(
            (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
        )
        mlp = eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0))
        model = eqxshard.filter_shard(mlp, mesh, eqxshard.fsdp("data"))
        params = eqx.filter(model, eqx.is_array)
        opt_state = eqxshard.filter_shard(optimiser.init(params), mesh, eqxshard.like(params))

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
    if not callable(fun):
        raise TypeError(f"`filter_jit` takes a callable `fun`, but got {type(fun).__name__}.")
    _donate.check(donate)
    _layouts.check_layouts(in_shardings, "in_shardings")
    _layouts.check_layouts(out_shardings, "out_shardings")
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
    config = Config(donate, in_shardings, out_shardings, mesh, bool(move_inputs))
    wrapper = JitWrapper(fn=names(fun)[0], fun=fun, signature=signature, config=config)
    return eqx.module_update_wrapper(wrapper)


class JitWrapper(eqx.Module):
    """What `filter_jit(fun)` returns: a PyTree holding `fun` (so a bound module's arrays
    are leaves, traced at each call), called as `fun` is.

    - `fn`: the name of `fun`, for a readable repr only.
    - `fun`: the function compiled.
    - `signature`: `fun`'s, to bind keywords to their parameters (`None` if it has none).
    - `config`: the `filter_jit` options, a `Config`.
    """

    fn: str
    fun: Any
    signature: inspect.Signature | None = eqx.field(static=True, repr=False)
    config: Any = eqx.field(static=True, repr=False)

    @property
    def __wrapped__(self) -> Any:
        return self.fun

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        with explained(self.config, args, kwargs):
            return _call(self, args, kwargs, lower=False)

    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """The `jax.stages.Lowered` of this call, wrapped so that `.compile()` returns a
        callable taking the same arguments."""
        with explained(self.config, args, kwargs):
            return _call(self, args, kwargs, lower=True)

    def __get__(self, instance: Any, owner: Any) -> Any:
        if instance is None:
            return self
        return eqx.Partial(self, instance)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`args` and `kwargs` with keywords bound to their parameters, as `fun` reads
        them (as they are where `fun` has no signature)."""
        if self.signature is None:
            return args, kwargs
        bound = self.signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs


class Config:
    """The `filter_jit` arguments, compared by value where they can be (so that two
    wrappers of one function share their traces, as in `eqx.filter_jit`).

    `key` is what calls are cached under: the arguments themselves where they hash, else
    a token of this configuration alone (held by the cache entries keyed by it, so it is
    never the token of another, as an `id` of a configuration gone could be).
    `per_signature`: whether layouts (and a `donate` filter) are resolved per input
    signature."""

    def __init__(self, donate, in_shardings, out_shardings, mesh, move_inputs):
        self.donate, self.in_shardings, self.out_shardings = donate, in_shardings, out_shardings
        self.mesh, self.move_inputs = mesh, move_inputs
        # Layouts (and a `donate` filter) are resolved per input signature.
        self.per_signature = (
            in_shardings is not None
            or out_shardings is not None
            or (callable(donate) and not isinstance(donate, (str, eqx.Module)))
        )
        parts = (donate, in_shardings, out_shardings, mesh, move_inputs)
        leaves, treedef = jax.tree_util.tree_flatten(parts, is_leaf=_layouts.is_layout_leaf)
        self.key: Any = (treedef, tuple(leaves))
        try:
            hash(self.key)
        except TypeError:
            self.key = object()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _call(wrapper: JitWrapper, args: tuple, kwargs: dict, *, lower: bool) -> Any:
    args, kwargs = wrapper.bind(args, kwargs)
    try:
        entry, dynamic = entry_of(wrapper, args, kwargs)
        runs = entry.runs_of(dynamic)
        if lower:
            return Lowered(entry.jitted.lower(*runs), wrapper, entry)
        return output(run(entry, runs))
    except (RuntimeError, ValueError) as e:  # a deleted input: say which and why
        error = _donate.deleted_inputs(wrapper.fun, args, kwargs)
        if error is None:
            raise
        raise error from e


def run(entry: Entry, runs: list[list[Any]]) -> Any:
    """Calls the entry's `jax.jit` and waits for it, as `eqx.filter_jit` does, so that a
    runtime error (`eqx.error_if`) is raised here, with Equinox's message."""
    # Equinox finds the user's frames for `eqx.error_if` messages by this local's name.
    __equinox_jit_id__ = os.urandom(16)
    try:
        if entry.suppress:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                out = entry.jitted(*runs)
        else:
            out = entry.jitted(*runs)
        # (Only JAX arrays: a float0 output is a NumPy-like array with nothing to wait on.)
        first = next((x for x in out[0] if isinstance(x, jax.Array) and not is_tracer(x)), None)
        if first is not None:
            first.block_until_ready()
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        error = equinox_runtime_error(e, __equinox_jit_id__)
        if error is None:
            raise
        raise error from None
    return out


_LAST: Any = object()  # a site's key for the avals of its last call, and their entry


def _lookup(site: dict, split: Split) -> tuple[Entry | None, Any, list | None]:
    """The entry for the call's input signature, the signature, and the avals to remember
    as the last call's. JAX shares the abstract value of arrays alike, so a call with the
    very avals of the last one is found by identity, without hashing them."""
    if split.host:
        signature = split.signature()
        return site.get(signature), signature, None
    avals = [x.aval for x in split.dynamic]
    last = site.get(_LAST)
    if last is not None and len(last[0]) == len(avals) and all(map(operator.is_, avals, last[0])):
        return last[1], None, None
    signature = tuple(avals)
    return site.get(signature), signature, avals


def entry_of(wrapper: JitWrapper, args: tuple, kwargs: dict) -> tuple[Entry, list[Any]]:
    """The entry of this call (built on first sight) and its array leaves, laid out."""
    config: Config = wrapper.config
    tree = (wrapper.fun, args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    split = Split(leaves)
    key = (config.key, treedef, split.static)
    flat = lambda: Flat.of_leaves(leaves, treedef, split.is_array)
    try:
        site = SITES.get(key)
    except TypeError:
        hashable_key(key, flat())  # raises, naming the unhashable static leaves
        raise
    if site is None:
        site = SITES[key] = {}
    entry, signature, avals = (
        _lookup(site, split) if config.per_signature else (site.get(None), None, None)
    )
    if entry is None:
        fun = wrapper.fun
        entry, dynamic = build(config, fun, key, flat(), args, kwargs, names(fun))
        site[signature] = entry
        if avals is not None:
            site[_LAST] = (avals, entry)
        return entry, dynamic
    if avals is not None:
        site[_LAST] = (avals, entry)
    return entry, lay_out(entry, config, split.dynamic, split.traced, flat)


def names(fun: Any) -> tuple[str, str]:
    """The `__name__` and `__qualname__` of the function under `fun`'s wrappers and
    partials (its type's, for a callable object): what the traced function is named."""
    while True:
        if hasattr(fun, "__wrapped__"):
            fun = fun.__wrapped__
        elif isinstance(fun, ft.partial):
            fun = fun.func
        else:
            break
    try:
        return fun.__name__, fun.__qualname__
    except AttributeError:
        return type(fun).__name__, type(fun).__qualname__


class Lowered:
    """A lowered `filter_jit` call: `as_text()`, `compile()`, and `lowered` (JAX's); the
    `wrapper` lowered and the `entry` of the call (its layouts)."""

    def __init__(self, lowered: Any, wrapper: JitWrapper, entry: Entry):
        self.lowered, self.wrapper, self.entry = lowered, wrapper, entry

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self.lowered.compile(*args, **kwargs), self.wrapper, self.entry)


class Compiled:
    """A compiled `filter_jit` call: call it with the arguments `lower` was given (arrays
    of the same shapes); `compiled` is JAX's (`memory_analysis()`, `as_text()`)."""

    def __init__(self, compiled: Any, wrapper: JitWrapper, entry: Entry):
        self.compiled, self.wrapper, self.entry = compiled, wrapper, entry

    def as_text(self) -> str:
        return self.compiled.as_text()

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.wrapper.bind(args, kwargs)
        tree = (self.wrapper.fun, args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        split = Split(leaves)
        flat = lambda: Flat.of_leaves(leaves, treedef, split.is_array)
        # Laid out as for a call.
        dynamic = lay_out(self.entry, self.wrapper.config, split.dynamic, split.traced, flat)
        return output(self.compiled(*self.entry.runs_of(dynamic)))


def _explicit_axes(config: Any, args: tuple, kwargs: dict) -> list[str]:
    """The Explicit axes of the meshes this call runs on: `filter_jit`'s `mesh`, the one
    set by `jax.set_mesh`, and those its array arguments are laid out over."""
    meshes = [getattr(config, "mesh", None), _compat.ambient_mesh()]
    for x in jax.tree_util.tree_leaves((args, kwargs)):
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if isinstance(sharding, NamedSharding):
            meshes.append(sharding.mesh)
    axes: list[str] = []
    for mesh in meshes:
        if mesh is None or not hasattr(mesh, "axis_names"):
            continue
        for name, kind in _compat.axis_type_map(mesh).items():
            if kind == AxisType.Explicit and name not in axes:
                axes.append(name)
    return axes


def note(axes: list[str]) -> str:
    """The note added to a `ShardingTypeError` raised on a mesh with the Explicit `axes`."""
    return (
        f"eqxshard: this step runs on a mesh with Explicit axes ({', '.join(map(repr, axes))}). "
        "On Explicit axes JAX must know the layout of every op's output, and it cannot infer "
        "this op's (in Equinox models, e.g. an `eqx.nn.Embedding` lookup of a row-split batch, "
        "or a convolution with split weights). Most Equinox models are written for Auto axes: "
        "build the mesh with them, `jax.make_mesh(shape, names, "
        "axis_types=(jax.sharding.AxisType.Auto,) * len(shape))`, or give this op its output "
        "layout with `out_sharding=`, as the message above says."
    )


@contextlib.contextmanager
def explained(config: Any, args: tuple, kwargs: dict) -> Iterator[None]:
    """Adds `note` to a `ShardingTypeError` raised inside, when the call's meshes have
    Explicit axes; the error, its message and its traceback are otherwise unchanged."""
    try:
        yield
    except Exception as e:
        if _compat.is_sharding_type_error(e):
            axes = _explicit_axes(config, args, kwargs)
            if axes and not any("eqxshard: this step" in n for n in getattr(e, "__notes__", ())):
                e.add_note(note(axes))
        raise
