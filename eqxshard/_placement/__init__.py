"""Placement: putting the array leaves of one PyTree where a target and spec say.

Owns `filter_shard`, `filter_replicate`, `filter_put`, `filter_get`; resolving a
target/spec into one sharding per leaf (`resolve`, `specs`; `spec_tree` reads every form
of a `spec`, prefix trees of rules and callables included); the one eager/traced switch
(`place`: `device_put` outside `jit`, a layout constraint inside); arrays committed to
other devices than a computation's, moved onto its mesh or reported (`committed`);
placement across processes (`multihost`) and the bounded cross-process checks it needs
(`exchange`); the plans of calls seen before (`cache`) and staged host-to-accelerator
transfers (`staging`).

Imports: `eqxshard._compat`, `eqxshard._tree` and this folder only.
"""
