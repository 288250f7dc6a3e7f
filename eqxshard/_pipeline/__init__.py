"""Pipelines: a stack of layers laid out over a mesh axis and run stage by stage, or as one
scan.

Owns `filter_pipeline` (`pipeline`), its per-stage program (`schedule`: the GPipe and
circular loops, and regrouping a contiguously split stack into the chunks each stage
runs), the layer and stage-major orders a stack is stored in (`order`), its argument
checks (`checks`), the per-layer `remat` policies (`remat`) shared by everything here,
`Stacked` (`stacked`: a module holding a stack of blocks, run by the plain scan of `scan`
or the pipeline; `convert`: stacking a list of blocks; `configure`: a model's stacks found
by path and rebuilt with a plan's remat and pipeline choices; `stage_major`: a circular
stack built without a mesh stored stage-major by `filter_init` and `Plan.apply`; `keys`: a
key per layer) and
the batching rule that lets a pipelined stack see the whole batch under `jax.vmap`
(`batching`), and the record of `filter_pipeline` calls a traced step makes (`watch`, how
`auto_plan` finds a step that pipelines by itself). The MPMD form, each stage its own
program on its own sub-mesh, is `pipeline_value_and_grad` (`value_and_grad`): the order of
its forwards and backwards, 1F1B or GPipe (`ticks`), the stages' sub-meshes and a stack's
pieces on them (`submeshes`), and the driver running the stages' programs (`mpmd`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._mapping`,
`eqxshard._shard_map` and this folder; never `_plans` or anything above (`_plans` sits
above it, so that rules and `auto_plan` can know about pipelines).
"""
