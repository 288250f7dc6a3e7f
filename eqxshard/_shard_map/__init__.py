"""`filter_shard_map`: `jax.shard_map` for PyTrees with non-array leaves.

Owns the verb (`shard_map`) and its per-leaf in/out spec checks (`specs`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement` and this folder;
never `_mapping` (a sibling) or anything above.
"""
