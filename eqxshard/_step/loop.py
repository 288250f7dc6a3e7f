"""`StepLoop`: many calls of one `filter_jit` step, its carried state kept flat.

A step `step(*state, *batch) -> (*state, *aux)` called in a loop flattens the whole state
(a model, an optimiser state) at every call and rebuilds it from the outputs, which is
most of what a call costs on a model of many small leaves. `StepLoop` flattens the state
once, keeps its array leaves as the outputs hand them back, and runs the very `jax.jit`
(and layouts, and donation) that `filter_jit` would, flattening only the batch. The
state becomes PyTrees again only when `state` is read.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from .._tree import Flat, is_array_like
from .entry import Entry, lay_out, output
from .jit import Config, JitWrapper, entry_of, explained, filter_jit, run
from .leaves import UNSET, Split

_DEFAULT = Config("none", None, None, None, True)  # `filter_jit()`'s options


class _Found:
    """What a loop call of one batch structure and signature reuses: the entry, the
    call's tree structure (for errors), and how the outputs split into state and aux."""

    def __init__(self, entry: Entry, treedef: Any, static: tuple, aux: Any, n_state: int | None):
        self.entry, self.treedef, self.static = entry, treedef, static
        self.is_array = [x is UNSET for x in static]
        self.aux_def, self.aux_static = aux
        # The number of the outputs' array leaves that are the next state; `None` when
        # the outputs' state differs from the state in structure, static leaves, shapes
        # or dtypes (then it is flattened again after the call).
        self.n_state: int | None = n_state

    def leaves(self, dynamic: list[Any]) -> list[Any]:
        it = iter(dynamic)
        return [next(it) if s is UNSET else s for s in self.static]


class StepLoop:
    """Runs a training step many times, keeping its state (the model, the optimiser
    state) flat between calls: each call flattens only the batch, so it costs about what
    `jax.jit` on pre-flattened leaves costs, where `filter_jit` flattens and rebuilds the
    whole model at every call.

    The step is any `filter_jit` step (or a function, then compiled by `filter_jit` with
    its defaults) whose first arguments are the state and which returns a tuple that
    starts with the new state, in the same order: `step(model, opt_state, x) -> (model,
    opt_state, loss)`. Each call runs the very program `filter_jit` runs, with its
    `in_shardings`, `out_shardings`, `donate`, `move_inputs` and errors (`eqx.error_if`
    included); only the Python around it is skipped.

    **Arguments:**

    - `step`: the step: a `filter_jit`-compiled function, or a function (then compiled by
        `filter_jit()`). A method decorated with `filter_jit` in the class body, bound
        (`model.step`, or `filter_jit(model.step)` with no options), runs its own
        `filter_jit` with the module as its first argument, held as it is.
    - `*state`: the initial state: the first arguments of `step`, in order (a model, an
        optimiser state, a key, ...).
    - `carry`: how many of the state arguments the step's first outputs replace. `None`
        (default): all of them (a training step). Fewer: the rest are held as they are
        and passed at every call (`carry=0` for an evaluation step `eval_step(model, x)`,
        whose whole output is then returned).

    **Returns:**

    A callable `loop(*batch)`: it runs `step(*state, *batch)`, keeps the first `carry`
    outputs as the new state, and returns the outputs after them (the one output itself
    if there is one, a tuple of several, `None` if none; with `carry=0` the output as it
    is). `loop.state` is
    the current state as PyTrees, a tuple like `state`: read it when it is needed (a
    checkpoint, an evaluation, the end), not at every step. With `donate`, a call donates
    the state's buffers as `filter_jit` does, so trees read from `loop.state` before a
    call are deleted by it; read `loop.state` again after.

    **Raises:**

    - `TypeError`: if `step` is not callable, if no state is given, for a `carry` that is
        not an int, or (at the first call) if `step` returns something other than a tuple
        or list that starts with the new state; every error `filter_jit` raises for the
        call `step(*state, *batch)`.
    - `ValueError`: for a `carry` below 0 or above the number of state arguments; if the
        state or a batch is traced: a `StepLoop` runs outside `jit` (inside one, call the
        step itself).

    !!! Example

        ```python
        import optax

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
        model = eqx.nn.MLP(4, 4, 32, 2, key=jax.random.key(0))
        optimiser = optax.sgd(1e-2)
        opt_state = optimiser.init(eqx.filter(model, eqx.is_array))

        @eqxshard.filter_jit(
            donate=(True, True, False), in_shardings=(None, None, P("data")), mesh=mesh
        )
        def step(model, opt_state, x):
            loss_fn = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            updates, opt_state = optimiser.update(grads, opt_state)
            return eqx.apply_updates(model, updates), opt_state, loss

        loop = eqxshard.StepLoop(step, model, opt_state)
        for _ in range(3):
            loss = loop(jnp.ones((8 * jax.device_count(), 4)))
        model, opt_state = loop.state
        ```
    """

    def __init__(self, step: Any, *state: Any, carry: int | None = None):
        if not callable(step):
            raise TypeError(
                f"`StepLoop` takes a callable `step`, but got {type(step).__name__}. Pass the "
                "training step (a function, or one compiled by `eqxshard.filter_jit`)."
            )
        if not state:
            raise TypeError(
                "`StepLoop` takes the initial state after `step` (`StepLoop(step, model, "
                "opt_state)`), but got none. Pass the arguments of `step` that stay with the "
                "loop (those its outputs replace, and those held as they are)."
            )
        carry = len(state) if carry is None else carry
        if isinstance(carry, bool) or not isinstance(carry, int):
            raise TypeError(
                f"`StepLoop` takes `carry` as an int (how many of the state arguments the "
                f"step's first outputs replace), but got {type(carry).__name__} {carry!r}."
            )
        if not 0 <= carry <= len(state):
            raise ValueError(
                f"`StepLoop(carry={carry})` must be between 0 (every state argument held as "
                f"it is) and the {len(state)} state arguments given (all replaced by the "
                "step's first outputs)."
            )
        # A method decorated in the class body, bound (`model.step`, an `eqx.Partial` of
        # the wrapper and the module), perhaps given to `filter_jit()` again: its own
        # wrapper runs, with the module as its first argument, not a `jit` around it.
        self._bound: tuple = ()
        inner = _bound_wrapper(step)
        if inner is not None:
            step, self._bound = inner
        compiled: Any = step if isinstance(step, JitWrapper) else filter_jit(step)
        self._step: JitWrapper = compiled
        self._n = carry
        self._found: dict[Any, _Found] = {}
        fixed = (self._step.fun, self._bound)
        self._fun_dynamic = Split(jax.tree_util.tree_leaves(fixed)).dynamic
        self._set_state(tuple(state))

    def _set_state(self, state: tuple) -> None:
        leaves, self._state_def = jax.tree_util.tree_flatten(state)
        split = Split(leaves)
        _not_traced(split)
        self._state_static, self._state_dynamic = split.static, split.dynamic
        # The carried part (the first `carry` arguments): what the outputs must match.
        leaves, self._carried_def = jax.tree_util.tree_flatten(state[: self._n])
        carried = Split(leaves)
        self._carried_static, self._carried_dynamic = carried.static, carried.dynamic
        self._token = object()  # calls of another state structure or signature miss

    @property
    def state(self) -> tuple:
        """The current state, as PyTrees: a tuple with one entry per state argument."""
        it = iter(self._state_dynamic)
        leaves = [next(it) if s is UNSET else s for s in self._state_static]
        return jax.tree_util.tree_unflatten(self._state_def, leaves)

    def __call__(self, *batch: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        split = Split(leaves)
        _not_traced(split)
        per_signature = self._step.config.per_signature
        key = (self._token, treedef, split.static, split.signature() if per_signature else None)
        try:
            found = self._found.get(key)
        except TypeError:  # unhashable static leaves: `filter_jit` names them
            found = None
        if found is None:
            found, dynamic = self._build(batch)
            self._found[key] = found
        else:
            dynamic = self._fun_dynamic + self._state_dynamic + split.dynamic
            rebuild = lambda: Flat.of_leaves(found.leaves(dynamic), found.treedef, found.is_array)
            dynamic = lay_out(found.entry, self._step.config, dynamic, False, rebuild)
        out = run(found.entry, found.entry.runs_of(dynamic))
        n = self._n
        if found.n_state is None:
            whole = output(out)
            self._set_state((*whole[:n], *self.state[n:]))
            aux = tuple(whole[n:])
        else:
            arrays = out[0]
            if n:
                held = self._state_dynamic[len(self._carried_dynamic) :]
                self._carried_dynamic = arrays[: found.n_state]
                self._state_dynamic = self._carried_dynamic + held
            it = iter(arrays[found.n_state :])
            aux_leaves = [next(it) if s is UNSET else s for s in found.aux_static]
            aux = jax.tree_util.tree_unflatten(found.aux_def, aux_leaves)
        if not n:
            return aux
        return aux[0] if len(aux) == 1 else (aux or None)

    def _build(self, batch: tuple) -> tuple[_Found, list[Any]]:
        """The first call of a batch structure and signature: `filter_jit`'s own entry,
        and how the step's outputs split into the next state and the rest."""
        step, n = self._step, self._n
        args, kwargs = step.bind((*self._bound, *self.state, *batch), {})
        with explained(step.config, args, kwargs):
            entry, dynamic = entry_of(step, args, kwargs)
            abstract = output(entry.jitted.trace(*entry.runs_of(dynamic)).out_info)
        leaves, treedef = jax.tree_util.tree_flatten((step.fun, args, kwargs))
        static = Split(leaves).static
        if not n:  # nothing carried: the output is returned as it is
            aux_leaves, aux_def = jax.tree_util.tree_flatten(abstract)
            aux_static = tuple(UNSET if is_array_like(x) else x for x in aux_leaves)
            return _Found(entry, treedef, static, (aux_def, aux_static), 0), dynamic
        if not isinstance(abstract, (tuple, list)) or len(abstract) < n:
            raise TypeError(
                f"`StepLoop` needs `step` to return a tuple that starts with the new state "
                f"({n} entries), but it returns {_what(abstract)}. Return "
                "`(*state, *other_outputs)`, e.g. `return model, opt_state, loss`."
            )
        state_leaves, state_def = jax.tree_util.tree_flatten(tuple(abstract[:n]))
        arrays = [x for x in state_leaves if is_array_like(x)]
        same = state_def == self._carried_def and len(arrays) == len(self._carried_dynamic)
        if same:
            rest = tuple(UNSET if is_array_like(x) else x for x in state_leaves)
            same = rest == self._carried_static and all(
                _same_type(a, x) for a, x in zip(arrays, self._carried_dynamic, strict=True)
            )
        aux_leaves, aux_def = jax.tree_util.tree_flatten(tuple(abstract[n:]))
        aux_static = tuple(UNSET if is_array_like(x) else x for x in aux_leaves)
        n_state = len(arrays) if same else None
        return _Found(entry, treedef, static, (aux_def, aux_static), n_state), dynamic


def _bound_wrapper(step: Any) -> tuple[JitWrapper, tuple] | None:
    """The `filter_jit` wrapper of a bound method decorated in the class body and the
    arguments bound to it (the module): from `model.step`, or from `filter_jit(model.step)`
    with no options (whose `jit` would only wrap the inner one)."""
    if isinstance(step, JitWrapper) and step.config == _DEFAULT:
        step = step.fun
    if isinstance(step, eqx.Partial) and isinstance(step.func, JitWrapper) and not step.keywords:
        return step.func, tuple(step.args)
    return None


def _same_type(abstract: Any, x: Any) -> bool:
    return (
        abstract.shape == x.shape
        and abstract.dtype == x.dtype
        and bool(getattr(abstract, "weak_type", False)) == bool(getattr(x, "weak_type", False))
    )


def _not_traced(split: Split) -> None:
    if split.traced:
        raise ValueError(
            "`StepLoop` runs steps outside `jit`, but got traced arrays (a call inside "
            "`jax.jit`, `vmap` or `grad`). Inside a transformation, call the step itself."
        )


def _what(x: Any) -> str:
    if is_array_like(x):
        return "an array"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"
