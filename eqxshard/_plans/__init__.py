"""Plans: layouts of whole models chosen by rules, seen before anything is placed.

Owns the rules (`rules`: `Rule`, `first`; `path_rules`; `fsdp`; `logical`; `like`;
`stages`, for pipelines), applying them to a tree or its shapes (`plan`: `filter_shardings`,
`filter_init`), the per-device table (`describe`, drawn by `describe_view`, read stage by
stage in `by_stage`), and `auto_plan`, which chooses a layout by compiling and measuring
candidates (the folder `auto`), with the `Pipeline` a plan chose (`pipeline_choice`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._caches`, `eqxshard._placement`,
`eqxshard._mapping`, `eqxshard._shard_map`, `eqxshard._step` (`Plan.jit` is `filter_jit`),
`eqxshard._pipeline` and this folder.
"""
