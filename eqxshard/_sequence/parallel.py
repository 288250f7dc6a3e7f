"""`context_parallel`: a model's `eqx.nn.MultiheadAttention` layers swapped for ones that
compute the same with the sequence split over a mesh axis."""

from __future__ import annotations

import dataclasses
import functools as ft
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from .. import _compat
from . import checks
from .attention import context_attention

VERB = "context_parallel"


class ContextParallelAttention(eqx.nn.MultiheadAttention):
    """`eqx.nn.MultiheadAttention` whose softmax(qk)v core is `context_attention`: the same
    fields (so the same leaf paths and parameters) and the same call, the sequence split
    over the mesh axis `axis`. Made by `context_parallel`; see there."""

    axis: str = eqx.field(static=True)
    strategy: str = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    mesh: Mesh | AbstractMesh | None = eqx.field(static=True)
    heads_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        attention: eqx.nn.MultiheadAttention,
        *,
        axis: str,
        strategy: str,
        causal: bool,
        mesh: Mesh | AbstractMesh | None,
        heads_axis: str | None = None,
    ):
        for field in dataclasses.fields(eqx.nn.MultiheadAttention):
            setattr(self, field.name, getattr(attention, field.name))
        self.axis = axis
        self.strategy = strategy
        self.causal = causal
        self.mesh = mesh
        self.heads_axis = heads_axis

    def __call__(
        self,
        query: Any,
        key_: Any,
        value: Any,
        mask: Any = None,
        *,
        key: Any = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: Any = None,
    ) -> Any:
        """As `eqx.nn.MultiheadAttention.__call__` (one example: `query` of shape
        `(T, query_size)`; batch it with `jax.vmap`), computed by `context_attention`.

        Differences: a query whose `mask` row is all `False` gets 0 (the original averages
        every value); a mask per head takes the `"ring"` or `"all_gather"` strategy;
        dropout on the attention weights keeps each with the same probability and scales
        it the same way, but draws other bits from `key` than the original does.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "MultiheadAttention()(deterministic=...) is deprecated "
                "in favour of MultiheadAttention()(inference=...)",
                stacklevel=2,
            )
        dropout_p = self._dropout_p(inference, key)
        for name, x in (("query", query), ("key_", key_), ("value", value)):
            if jnp.ndim(x) != 2:
                raise ValueError(
                    f"`{VERB}`'s attention takes one example: `{name}` must have shape "
                    f"(sequence, channels), got shape {jnp.shape(x)}. Call the model per "
                    f"example under `jax.vmap`, as for `eqx.nn.MultiheadAttention`."
                )
        if key_.shape[0] != value.shape[0]:
            raise ValueError("key and value must both be sequences of equal length.")
        q = self._project(self.query_proj, query)
        k = self._project(self.key_proj, key_)
        v = self._project(self.value_proj, value)
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
        dropout = {"dropout_p": dropout_p, "dropout_key": key} if dropout_p > 0 else {}
        attend = ft.partial(
            context_attention,
            causal=self.causal,
            mesh=self.mesh,
            axis=self.axis,
            strategy=self.strategy,
            **dropout,
        )
        if mask is not None and jnp.ndim(mask) == 3:  # one mask per head: heads lead
            if self.strategy == "all_to_all":
                raise ValueError(
                    f"`{VERB}(strategy='all_to_all')` splits the heads, and cannot take a mask "
                    f"per head (`mask` of shape {jnp.shape(mask)}). Pass a mask of shape "
                    f"(T, S) shared by the heads, or convert with `strategy='ring'`."
                )
            heads = [jnp.moveaxis(x, 1, 0)[:, :, None, :] for x in (q, k, v)]
            out = attend(*heads, mask=mask)  # the heads a batch dim: none to split
            out = jnp.moveaxis(out[:, :, 0, :], 0, 1)
        else:
            out = attend(q, k, v, mask=mask, heads_axis=self.heads_axis)
        return jax.vmap(self.output_proj)(out.reshape(query.shape[0], -1))

    def _dropout_p(self, inference: bool | None, key: Any) -> float:
        """The probability of dropping an attention weight in this call (0 in inference
        mode); an active dropout without a `key` is an error, as in the original."""
        inference = self.dropout.inference if inference is None else inference
        if inference or not self.dropout.p:
            return 0.0
        if key is None:
            raise ValueError(
                f"`{VERB}`'s attention drops attention weights at random (dropout_p="
                f"{self.dropout.p}, inference=False) and needs a `key`. Call it with "
                "`key=jax.random.key(...)`, or with `inference=True` "
                "(`eqx.nn.inference_mode(model)`)."
            )
        return float(self.dropout.p)


def _is_attention(x: Any) -> bool:
    return isinstance(x, eqx.nn.MultiheadAttention)


def convert(
    tree: Any,
    *,
    axis: str,
    strategy: str,
    causal: bool,
    mesh: Mesh | AbstractMesh | None,
    heads_axis: str | None = None,
    again: bool = True,
) -> tuple[Any, int]:
    """`tree` with each `eqx.nn.MultiheadAttention` converted (options unchecked), and how
    many were: `context_parallel` without its checks and warning, for a plan that
    converts a model and its optimiser state. `again=False` leaves layers already
    converted as they are (and does not count them)."""
    found = 0

    def one(x: Any) -> Any:
        nonlocal found
        if not _is_attention(x) or (not again and isinstance(x, ContextParallelAttention)):
            return x
        found += 1
        return ContextParallelAttention(
            x, axis=axis, strategy=strategy, causal=causal, mesh=mesh, heads_axis=heads_axis
        )

    return jax.tree_util.tree_map(one, tree, is_leaf=_is_attention), found


def context_parallel(
    model: Any,
    *,
    axis: str = "context",
    strategy: str = "ring",
    causal: bool = False,
    mesh: Mesh | AbstractMesh | None = None,
    heads_axis: str | None = None,
) -> Any:
    """`model` with every `eqx.nn.MultiheadAttention` in it replaced by one that computes
    the same with the sequence split over the mesh axis `axis` (context parallelism), by
    `context_attention`.

    The replacement is a subclass of `eqx.nn.MultiheadAttention` with the same fields and
    the same call: the model's leaf paths and parameters are unchanged, so sharding rules,
    checkpoints and a plan's layouts carry over, and the model is called as before (per
    example, under `jax.vmap`; inside `lax.scan` over stacked layers; with a `mask` of
    shape `(T, S)` or `(num_heads, T, S)`; with `process_heads`, e.g. rotary embeddings,
    applied before the attention as the original does). An optimiser state made from the
    original model holds its modules too: make it from the converted model, or convert it
    with `context_parallel` as well. Everything outside the attention (projections, MLPs,
    norms) works token by token and keeps the sequence split the compiler gives it; lay
    the inputs out with their sequence dim over `axis` (`P("data", "context")` for
    `(batch, T)` tokens).

    Differences from the original, each by `context_attention`: a query whose mask row
    is all `False` gets 0 (the original averages every value); scores are computed in
    float32; a `mask` per head `(num_heads, T, S)` takes the `"ring"` or `"all_gather"`
    strategy (`"all_to_all"` splits the heads: an error). Dropout on the attention
    weights (`dropout_p > 0`, called with a `key` and not in inference mode) drops each
    weight with the same probability and scales the kept ones by `1/(1 - dropout_p)`,
    as the original does, but draws its bits otherwise (per block of the split sequence,
    from `key`): the same `key` gives the same output each call, not the original's
    output. In inference mode (or with `dropout_p=0`) the outputs are the original's.

    **Arguments:**

    - `model`: any PyTree (an `eqx.Module`), holding `eqx.nn.MultiheadAttention` layers
        anywhere (stacked layers included). Layers already converted are converted again
        with these options.
    - `axis`: the mesh axis to split the sequence over. Default `"context"`.
    - `strategy`: `"ring"` (default), `"all_gather"` or `"all_to_all"`, as in
        `context_attention`.
    - `causal`: `False` (default): each layer attends as its `mask` says. `True`: every
        converted layer is causal as well (a query sees keys at or before it, and what
        its `mask` allows): the ring then balances the work over devices and skips the
        masked half, which a causal `mask` passed by the model does not get.
    - `mesh`: the mesh whose axis `axis` splits the sequence. `None` (default): the mesh
        set by `jax.set_mesh` when the model is called.
    - `heads_axis`: `None` (default), or a second mesh axis the heads are split over
        (tensor parallelism, the projections' weights split over it by their output
        dim): each device then attends its heads of its part of the sequence (see
        `context_attention`). The heads must divide over it.

    **Returns:**

    A PyTree of `model`'s structure, each `eqx.nn.MultiheadAttention` replaced.

    **Raises:**

    - `ValueError`: if `strategy` is unknown, or `axis` is not an axis of `mesh` (or of
        the mesh set by `jax.set_mesh` when `mesh` is `None`). When a converted layer is
        called: if its dropout is active and it gets no `key`, its inputs are batched
        (call it per example), or it gets a mask per head with `"all_to_all"`; and
        `context_attention`'s errors (a sequence length not divisible by the axis size,
        and the like).
    - `TypeError`: if `axis` or `heads_axis` is not a string, `causal` not a bool, or
        `mesh` not a mesh.

    **Warns:**

    - `UserWarning`: if `model` holds no `eqx.nn.MultiheadAttention` (it is returned
        unchanged).

    !!! Example

        ```python
        import equinox as eqx
        import jax
        import eqxshard

        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((jax.device_count(),), ("context",), axis_types=auto)
        attention = eqx.nn.MultiheadAttention(4, 32, key=jax.random.key(0))
        split = eqxshard.context_parallel(attention, mesh=mesh)
        x = jax.random.normal(jax.random.key(1), (64, 32))  # (T, channels)
        out = eqx.filter_jit(split)(x, x, x)  # what attention(x, x, x) gives
        ```
    """
    _check(axis=axis, strategy=strategy, causal=causal, mesh=mesh)
    if heads_axis is not None and not isinstance(heads_axis, str):
        raise TypeError(
            f"`{VERB}(heads_axis=...)` must be a mesh axis name (a string) or `None`, got "
            f"{type(heads_axis).__name__}."
        )
    out, found = convert(
        model, axis=axis, strategy=strategy, causal=causal, mesh=mesh, heads_axis=heads_axis
    )
    if not found:
        warnings.warn(
            f"`{VERB}` found no `eqx.nn.MultiheadAttention` in the model "
            f"({type(model).__name__}) and returned it unchanged. Attention written by "
            f"hand can call `eqxshard.context_attention(query, key, value, axis="
            f"{axis!r})` in place of its softmax(qk)v.",
            stacklevel=2,
        )
    return out


def _check(*, axis: Any, strategy: Any, causal: Any, mesh: Any) -> None:
    if not isinstance(axis, str):
        raise TypeError(
            f"`{VERB}(axis=...)` must be a mesh axis name (a string), got "
            f"{type(axis).__name__}. Pass e.g. `axis='context'`."
        )
    if strategy not in checks.STRATEGIES:
        raise ValueError(
            f"`{VERB}(strategy=...)` must be one of {', '.join(map(repr, checks.STRATEGIES))}"
            f", got {strategy!r}. `'ring'` suits long sequences, `'all_gather'` short ones."
        )
    if not isinstance(causal, bool):
        raise TypeError(f"`{VERB}(causal=...)` must be a bool, got {type(causal).__name__}.")
    if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"`{VERB}(mesh=...)` must be a `jax.sharding.Mesh` or `AbstractMesh`, got "
            f"{type(mesh).__name__}. Build one with `jax.make_mesh(shape, names)`."
        )
    where = mesh if mesh is not None else _compat.ambient_mesh()
    if where is not None and axis not in where.axis_names:
        given = "given" if mesh is not None else "set by `jax.set_mesh`"
        raise ValueError(
            f"`{VERB}(axis={axis!r})` is not an axis of the mesh {given} (axes "
            f"{tuple(where.axis_names)}). Pass `axis=` one of them, or build the mesh with "
            f"a {axis!r} axis: `jax.make_mesh((data, context), ('data', {axis!r}))`."
        )
