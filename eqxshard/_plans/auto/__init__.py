"""`auto_plan`: choosing a layout for the user, measured rather than guessed.

Owns the verb (`search`) and its arguments (`arguments`); the candidate layouts
(`candidates`: mesh factorisations crossed with DP, FSDP, TP and FSDP x TP, tensor-parallel
roles found from the model's structure and shapes); measuring each compiled step
(`measure`: memory by part; `collectives`: bytes moved, read from the HLO; `flops`;
`pinned`: ops XLA runs on one device and replicates, e.g. `eqx.error_if`),
compiled here, in a subprocess with more CPU devices (`compile_remote`, `compile_worker`)
or scaled from a smaller mesh (`extrapolate`); the alpha-beta link model (`links`); the
ranking (`rank`), the result (`result`: `Plan`, `Candidate`), its table and picture
(`view`) and the cache of measured steps (`cache`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, the rest of
`eqxshard._plans` and this folder.
"""
