"""What `auto_plan` returns: a `Plan` (plain data that acts) and its ranked `Candidate`s
(`candidate`)."""

from __future__ import annotations

import dataclasses
import functools as ft
import html
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from ..._compat import spec_str
from ..._experts.module import configured as configured_experts
from ..._placement.shard import filter_shard
from ..._sequence.parallel import convert
from ..._tree import format_bytes
from ..pipeline_choice import Pipeline, from_plan_argument
from ..plan import filter_init
from . import choices, use, view
from .candidate import Candidate as Candidate
from .meshes import mesh_for


@dataclasses.dataclass(frozen=True, init=False, repr=False, eq=False)
class Plan:
    """The layout `auto_plan` chose, and every candidate it weighed.

    - `mesh`: a `Mesh` over the devices asked for, or an `AbstractMesh` of the same
        shape when there are more devices than this machine has. Given as a dict of axis
        sizes (`{"data": 256, "model": 2}`, as `repr` writes it), it is built over this
        process's devices (`jax.make_mesh`'s order, Auto axes), or abstract when they are
        too few.
    - `rules`: the rule for the model and the optimiser state, usable as `spec`
        anywhere (`filter_shard`, `filter_shardings`, `filter_init`, `describe`). Its `repr`
        is Python to paste into a script and edit.
    - `batch_spec`: the `PartitionSpec` of every batch leaf (its leading dim split over
        the data axes).
    - `table`: every `Candidate`, ranked; `table[0]` is the chosen one.
    - `budget`: the budget in bytes per device.
    - `remat`: the rematerialisation policy per stacked layer, by its path: `"none"`,
        `"dots"`, `"full"` or `"offload"` (`{}`: none chosen), e.g. `{"encoder.blocks":
        "dots", "decoder.blocks": "none"}`; or one policy (`"dots"`) for every stacked
        layer.
    - `offload`: the parts held in pinned host memory between steps and moved in for
        the update: `("optimizer state",)` or `()`.
    - `pipeline`: `None`, or the pipeline chosen, an `eqxshard.Pipeline(axis,
        microbatches, repeats, in_step)`, with `in_step=True` for a step that calls
        `filter_pipeline` itself (`jit` then runs it with the mesh set; there is no
        `Stacked` to configure). A dict with those keys (what older `repr(plan)`s wrote) is
        still read, with a `DeprecationWarning`.
    - `context`: `None`, or `{"axis": "context", "strategy": "ring"}` (with
        `"heads_axis": "model"` where the heads split over a `model` axis too): the
        sequence split over that mesh axis; `apply`, `shard`, `init` and `jit` convert
        the model's (and the optimiser state's) `eqx.nn.MultiheadAttention` layers by
        `context_parallel` with these options, and `batch_spec` splits every batch
        leaf's dim 1 (the sequence) over it.
    - `experts`: `None`, `{"axis": "expert"}` or `{"axis": None}`: with an axis, each
        `eqxshard.Experts` of the model (and of the optimiser state) lays out its experts
        over that mesh axis (`apply`, `shard`, `init` and `jit` set its `axis` and
        `mesh`), the tokens dispatched to them by `moe`; `{"axis": None}` runs them
        unsplit (what `auto_plan` measured for its layouts without an expert axis, on a
        model holding `Experts`); `None` leaves a model's `Experts` as they are.

    `print(plan)` shows the table; a notebook shows it as HTML, with a chart of each
    candidate's bytes per device against the budget. `repr(plan)` is Python that builds
    an equal plan (without the table): paste it into the training script on the
    cluster. Two plans are equal when they choose the same (mesh shape, rules, batch
    spec, budget, remat, offload, pipeline, context, experts).
    """

    mesh: Mesh | AbstractMesh
    rules: Any
    batch_spec: PartitionSpec
    table: list[Candidate]
    budget: int
    remat: dict[str, str] | str
    offload: tuple[str, ...]
    pipeline: Pipeline | None
    context: dict[str, str] | None
    experts: dict[str, str | None] | None

    def __init__(
        self,
        mesh: Mesh | AbstractMesh | dict[str, int],
        rules: Any,
        batch_spec: PartitionSpec,
        table: list[Candidate] | None = None,
        budget: int = 0,
        remat: dict[str, str] | str | None = None,
        offload: tuple[str, ...] = (),
        pipeline: Pipeline | dict[str, Any] | None = None,
        context: dict[str, str] | None = None,
        experts: dict[str, str | None] | None = None,
    ):
        if isinstance(mesh, dict):
            mesh = mesh_for(mesh)
        elif not isinstance(mesh, Mesh | AbstractMesh):
            raise TypeError(
                "`Plan` takes `mesh` as a `Mesh`, an `AbstractMesh` or a dict of axis sizes "
                f"(`{{'data': 8}}`), but got {type(mesh).__name__}."
            )
        pipeline = from_plan_argument(pipeline)
        options = None if pipeline is None else pipeline.options()
        remat, offload = choices.check({} if remat is None else remat, offload, options)
        values = dict(
            mesh=mesh,
            rules=rules,
            batch_spec=batch_spec,
            table=list(table or []),
            budget=budget,
            remat=remat,
            offload=offload,
            pipeline=pipeline,
            context=choices.check_context(context),
            experts=choices.check_experts(experts),
        )
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _choice(self) -> tuple[Any, ...]:
        return (
            dict(self.mesh.shape),
            self._rules_repr(),
            spec_str(self.batch_spec),  # `P('x')` and `P(('x',))` alike, on every JAX
            self.budget,
            self.remat,
            self.offload,
            self.pipeline,
            self.context,
            self.experts,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self._choice() == other._choice()

    __hash__ = None  # type: ignore[assignment]

    @property
    def chosen(self) -> Candidate:
        """The chosen row, `table[0]`. A plan rebuilt from `repr(plan)` holds no table:
        its `chosen` is a `ValueError` saying so (`print(plan)` still shows its choices)."""
        if not self.table:
            raise ValueError(
                "This `Plan` holds no table of candidates (it was built directly, e.g. from "
                "`repr(plan)`), so it has no chosen row; its choices are its fields "
                "(`mesh`, `rules`, `batch_spec`, `remat`, `offload`, `pipeline`). Run "
                "`eqxshard.auto_plan` to get the table."
            )
        return self.table[0]

    def _concrete_mesh(self, verb: str) -> Mesh:
        if isinstance(self.mesh, Mesh):
            return self.mesh
        shape = dict(self.mesh.shape)
        raise ValueError(
            f"`Plan.{verb}` needs the devices, but this plan is for {self.mesh.size} devices "
            f"and this process has {jax.device_count()}. On the cluster, paste `repr(plan)` "
            "(its mesh is then built over the devices there), or build the mesh "
            f"`jax.make_mesh({tuple(shape.values())}, {tuple(shape)}, "
            f"axis_types=(AxisType.Auto,) * {len(shape)})` (Auto axes, as planned) and pass it "
            "with `plan.rules` to `filter_shard` / `filter_init` (and `plan.batch_spec` for the "
            "batch)."
        )

    def shard(self, model: Any, opt_state: Any = None, batch: Any = None) -> tuple[Any, Any, Any]:
        """The three inputs of a training step laid out by the plan, for a model, state
        and batch made elsewhere: `(model, opt_state, batch)`, where

        - `model` is what `plan.apply(model)` gives: its `Stacked` layers configured
            (`remat`, `pipeline`), then laid out by `plan.rules`;
        - `opt_state` is laid out by `plan.rules` (its `Stacked` parts configured like
            the model's), in pinned host memory when the plan offloads it;
        - `batch` is laid out by `plan.batch_spec`.

        Each argument may be `None`, returned as it is. To lay out only a model, use
        `apply`; to create the model and state already laid out, use `init`.

        **Raises:**

        - `ValueError`: for a plan over an `AbstractMesh`, or whose `remat`/`pipeline` do
            not match the model's stacks; `filter_shard`'s errors.
        """
        mesh = self._concrete_mesh("shard")
        if model is not None:
            model = self._laid_out("Plan.shard", model, mesh)
            opt_state = self._converted(use.configure_like(opt_state, model), mesh)
        if opt_state is not None:
            opt_state = use.place_state(opt_state, mesh, self.rules, self._offloads_state)
        batch = None if batch is None else filter_shard(batch, mesh, self.batch_spec)
        return model, opt_state, batch

    def _laid_out(self, verb: str, model: Any, mesh: Mesh) -> Any:
        """`apply`: `model` configured, then laid out by the rules."""
        return filter_shard(self._configured(verb, model, mesh), mesh, self.rules)

    def _configured(self, verb: str, model: Any, mesh: Mesh) -> Any:
        model = use.configured(verb, model, mesh, self.remat, self._pipeline_options)
        return self._converted(model, mesh)

    def _converted(self, tree: Any, mesh: Mesh, *, again: bool = True) -> Any:
        """`tree` with its `Experts` set to the plan's `experts` (if any), and its
        attention converted by the plan's `context` (if any); `again=False` leaves
        layers already converted as they are."""
        if self.experts is not None:
            axis = self.experts["axis"]
            tree = configured_experts(tree, axis=axis, mesh=None if axis is None else mesh)
        if self.context is None or tree is None:
            return tree
        return convert(tree, **self.context, causal=False, mesh=mesh, again=again)[0]

    @property
    def _pipeline_options(self) -> dict[str, Any] | None:
        """`pipeline` in the dict form `Stacked` and the planner read."""
        return None if self.pipeline is None else self.pipeline.options()

    @property
    def _offloads_state(self) -> bool:
        return "optimizer state" in self.offload

    def init(self, make_model: Callable[..., Any], optimizer: Any = None) -> Callable[..., Any]:
        """A function of `make_model`'s arguments (usually a key) returning the model, born
        sharded by `filter_init` (its `Stacked` layers configured as `apply` does), and
        with `optimizer` also its state, as `(model, opt_state)` (the state moved to
        pinned host memory when the plan offloads it). Raises `ValueError` for a plan
        over an `AbstractMesh`."""
        mesh = self._concrete_mesh("init")

        def init(*args: Any, **kwargs: Any) -> Any:
            make = lambda *a, **k: self._configured("Plan.init", make_model(*a, **k), mesh)
            model = filter_init(make, mesh, self.rules)(*args, **kwargs)
            if optimizer is None:
                return model
            opt_init = lambda m: optimizer.init(eqx.filter(m, eqx.is_array))
            state = filter_init(opt_init, mesh, self.rules)(model)
            if self._offloads_state:
                state = use.place_state(state, mesh, self.rules, True)
            return model, state

        return init

    def jit(self, step: Callable[..., Any], *, donate: bool = True) -> Any:
        """`step` compiled with the plan's layouts: `filter_jit` over `plan.mesh`, the
        model and the optimiser state laid out by `plan.rules` (in and out) and donated,
        the batch by `plan.batch_spec`. Inputs in another layout are moved first (one
        batched transfer), so the model of `plan.init` or `plan.shard` goes in as it is.
        With a `context`, each call first converts the `eqx.nn.MultiheadAttention`
        layers of the model and the optimiser state that are not converted yet, as
        `apply` does (a walk over the tree, no copy of an array; layers already
        converted, by the plan or by `context_parallel` with other options, are kept):
        a model made elsewhere goes in as it is too, and the step returns it converted.

        **Arguments:**

        - `step`: `step(model, opt_state, batch)` returning `(model, opt_state, loss)`, or
            `step(model, batch)` (an evaluation: nothing donated, outputs as XLA lays
            them out).
        - `donate`: whether the model and the optimiser state give their buffers to the
            new ones (default `True`: a training step holds one copy of each).

        **Returns:**

        The compiled step, called as `step` is, with `.lower(*args)` (as `filter_jit`'s).

        **Raises:**

        - `TypeError`: if `step` is not callable or `donate` is not a bool; when called
            with other than two or three arguments; and `filter_jit`'s errors.
        - `ValueError`: for a plan over an `AbstractMesh` (more devices than this process
            has: paste `repr(plan)` on the cluster).

        !!! Example

            ```python
            import optax

            optimizer = optax.adamw(1e-3)

            def step(model, opt_state, x):
                loss, grads = eqx.filter_value_and_grad(
                    lambda m: jnp.mean((jax.vmap(m)(x) - x) ** 2)
                )(model)
                params = eqx.filter(model, eqx.is_array)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                return eqx.apply_updates(model, updates), opt_state, loss

            make = lambda key: eqx.nn.MLP(64, 64, 256, 2, key=key)
            x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
            plan = eqxshard.auto_plan(
                step, make(jax.random.key(0)), x, devices=4, budget="1MiB", optimizer=optimizer
            )
            model, opt_state = plan.init(make, optimizer)(jax.random.key(0))
            train_step = plan.jit(step)
            model, opt_state, loss = train_step(model, opt_state, jnp.ones((32, 64)))
            ```
        """
        if not callable(step):
            raise TypeError(f"`Plan.jit` takes a callable `step`, but got {type(step).__name__}.")
        if not isinstance(donate, bool):
            raise TypeError(f"`Plan.jit` takes `donate` as a bool, but got {donate!r}.")
        mesh = self._concrete_mesh("jit")
        in_step = use.in_step(self._pipeline_options)
        convert = None
        if self.context is not None or self.experts is not None:
            convert = ft.partial(self._converted, mesh=mesh, again=False)
        return use.PlanStep(
            step, mesh, self.rules, self.batch_spec, donate, self._offloads_state, in_step, convert
        )

    def apply(self, model: Any) -> Any:
        """`model` as the plan runs it: every `eqxshard.Stacked` in it rebuilt with the
        plan's choices (the `remat` policy its path is given, and with a `pipeline`, its
        layers pipelined over the plan's mesh axis in that many microbatches, GPipe for
        `repeats=1`, circular above), its `eqx.nn.MultiheadAttention` layers converted
        by `context_parallel` with a `context`, its `Experts` set to the plan's `experts`
        (their `axis` and `mesh`, or unsplit), then its array leaves placed by
        `plan.rules` over `plan.mesh`. A plan without such choices only places the model.
        `shard` lays out the optimiser state and the batch too (its model is this one).

        **Arguments:**

        - `model`: the model the plan was made for, concrete.

        **Returns:**

        The model, configured and placed.

        **Raises:**

        - `ValueError`: for a plan over an `AbstractMesh`; for `remat` paths that are not
            `Stacked` layers of `model`, or a `pipeline` for a model without any (the
            paths found are listed); `Stacked`'s and `filter_shard`'s errors.
        """
        return self._laid_out("Plan.apply", model, self._concrete_mesh("apply"))

    def summary(self) -> str:
        if not self.table:
            return self._choices_line()
        c = self.chosen
        return (
            f"Chosen: {c.name} on {view.mesh_str(c.mesh_shape)}: "
            f"{format_bytes(c.total_bytes or 0)} per device of {format_bytes(self.budget)}, "
            f"estimated {view.seconds_str(c.time)} per step. {c.reason}"
        )

    def _choices_line(self) -> str:
        """What a plan without a table (rebuilt from its repr) says of itself."""
        more = [
            f"remat {self.remat!r}" if self.remat else "",
            f"offload {', '.join(self.offload)}" if self.offload else "",
            f"pipeline over {self.pipeline.axis!r}" if self.pipeline else "",
            f"sequence over {self.context['axis']!r}" if self.context else "",
            (
                ""
                if self.experts is None
                else f"experts over {self.experts['axis']!r}"
                if self.experts["axis"]
                else "experts unsplit"
            ),
        ]
        said = "".join(f", {m}" for m in more if m)
        return (
            f"Plan on {view.mesh_str(dict(self.mesh.shape))}: rules {self._rules_repr()}, batch "
            f"{spec_str(self.batch_spec)}, budget {format_bytes(self.budget)}{said}. "
            "(No table of candidates: this plan was built from its fields, e.g. `repr(plan)`.)"
        )

    def __str__(self) -> str:
        if not self.table:
            return self.summary()
        return view.text(self.table, self.summary())

    def __repr__(self) -> str:
        return (
            f"Plan(mesh={dict(self.mesh.shape)!r}, rules={self._rules_repr()}, "
            f"batch_spec={spec_str(self.batch_spec)}, budget={self.budget!r}, "
            f"remat={self.remat!r}, offload={self.offload!r}, pipeline={self.pipeline!r}"
            + (f", context={self.context!r}" if self.context is not None else "")
            + (f", experts={self.experts!r})" if self.experts is not None else ")")
        )

    def _rules_repr(self) -> str:
        """`rules` as Python: a bare `PartitionSpec` as `P(...)` (its own repr differs by
        JAX version), anything else by its repr."""
        if isinstance(self.rules, PartitionSpec):
            return spec_str(self.rules)
        return repr(self.rules)

    def _repr_html_(self) -> str:
        if not self.table:
            return f"<div><p>{html.escape(self.summary())}</p></div>"
        return view.to_html(self.table, self.budget, self.summary())
