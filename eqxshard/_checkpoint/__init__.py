"""Checkpoints: sharded saves and restores through orbax.

Owns `filter_save` and `latest_step` (`save`), `AsyncSave` (`async_save`: waiting for a
save, at exit too, and cleaning up after a failed one) and `filter_restore` (`restore`,
which lays the restored tree out by a plan; `restore_match` decides which leaves it
reads). `store` is the orbax side they share (arguments checked, orbax's manager, the
steps on disk and whether each is complete, the names leaves are saved under); `loops`
has orbax's event loops drained before they close.

Imports: everything below it (`_compat`, `_tree`, `_placement`, `_mapping`, `_shard_map`,
`_pipeline`, `_plans`, `_step`) and this folder; never `_processes`.
"""
