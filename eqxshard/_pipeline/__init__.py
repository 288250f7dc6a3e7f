"""Pipelines: a stack of layers laid out over a mesh axis and run stage by stage, or as one
scan. Three parts, by how they run, and what two or more of them share:

- `spmd/`: `filter_pipeline`, one jitted program in which every stage runs the same code
    (GPipe and circular schedules).
- `mpmd/`: `pipeline_value_and_grad`, each stage its own programs on its own sub-mesh,
    driven from Python in the 1F1B or GPipe order.
- `stacked/`: `Stacked`, the module holding a layer stack (the plain scan, or
    `filter_pipeline`'s schedules, also under `jax.vmap`), its options, conversion from a
    list of blocks, per-layer keys, and its configuration by a plan.
- `checks`: the argument checks `filter_pipeline` and `pipeline_value_and_grad` share.
- `remat`: the per-layer remat policies all three use.
- `bubble`: the share of its time a stage idles (`bubble_fraction`), for the checks and
    for `auto_plan`'s estimates.
- `watch`: the record of the pipeline calls a traced step makes (how `auto_plan` finds a
    step that pipelines by itself).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._mapping`,
`eqxshard._shard_map` and this folder; never `_plans` or anything above (`_plans` sits
above it, so that rules and `auto_plan` can know about pipelines). Inside it: the shared
modules (`checks`, `remat`, `bubble`, `watch`) import no sub-folder; `spmd/` and `mpmd/`
import the shared modules, not each other or `stacked/`; `stacked/` imports the shared
modules and `spmd/` (its pipeline is `filter_pipeline`'s), never `mpmd/`.
"""
