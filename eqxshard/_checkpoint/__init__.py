"""Checkpoints: sharded saves and restores through orbax.

Owns `filter_save`, `latest_step` and `AsyncSave` (`save`, `async_save`) and
`filter_restore` (`restore`, which lays the restored tree out by a plan).

Imports: everything below it (`_compat`, `_tree`, `_placement`, `_mapping`, `_shard_map`,
`_pipeline`, `_plans`, `_step`) and this folder; never `_processes`.
"""
