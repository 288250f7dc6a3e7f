"""Plans: layouts of whole models chosen by rules, seen before anything is placed.

Owns the rules (`rules`: `path_rules`, `first`; `fsdp`; `logical`; `like`), applying them
to a tree or its shapes (`plan`: `filter_plan`, `filter_init`), the per-device table
(`describe`, drawn by `describe_view`), and `auto_plan`, which chooses a layout: its
candidates (`candidates`), each compiled and measured (`measure`, `collectives`, in a
subprocess for more devices than here: `compile_remote`, `compile_worker`; scaled from
a smaller mesh beyond: `extrapolate`), timed (`links`, `flops`), ranked
(`auto_plan_rank`) and shown (`auto_plan_types`, `auto_plan_view`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._mapping`,
`eqxshard._shard_map` and this folder.
"""
