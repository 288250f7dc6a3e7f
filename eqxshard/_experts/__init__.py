"""Expert parallelism: a mixture-of-experts layer's experts laid out over a mesh axis,
each token's activations sent to its experts' devices and back.

- `moe`: the verb, `moe(expert, experts, x, indices, weights)`, one cached program per
    signature around a `jax.shard_map`.
- `dispatch`: what each device runs inside it (pack per destination, `all_to_all`, the
    local experts, `all_to_all` back, combine), dropless or with GShard's capacity.
- `checks`: the arguments checked before anything runs, read into a `Problem`.
- `unsplit`: the experts of an `Experts(axis=None)`, every expert on every token, no
    mesh (what `auto_plan` weighs on meshes without an expert axis).
- `module`: `Experts`, the Equinox module holding a layer's experts, and `configured`
    (every `Experts` of a tree set to an axis and mesh: `Plan.apply`, `auto_plan`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._caches` and this folder. It sits
on layer 3 beside `_pipeline` (siblings, neither importing the other), below `_plans`
(layer 4): `_plans/experts.py` (the `experts`
rule) and `auto_plan`'s expert dimension read `Experts` from here, and an `Experts` runs
inside a `Stacked` without either importing the other.
"""
