"""`filter_shard_map`: `jax.shard_map` for PyTrees with non-array leaves.

- `shard_map`: the verb, `filter_shard_map`.
- `specs`: `in_specs`/`out_specs` read into one spec per leaf and checked.
- `axes`: the mesh axes the function is mapped over (`axis_names`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder;
never `_mapping` (a sibling) or anything above.
"""
