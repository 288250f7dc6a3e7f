"""`auto_plan`: choosing a layout for the user, measured rather than guessed.

Owns the verb (`search`) and its arguments (`arguments`); the candidate layouts
(`candidates`: mesh factorisations crossed with DP, FSDP, TP and FSDP x TP, tensor-parallel
roles found from the model's structure and shapes; `offload`: the same layouts with the
optimiser state in pinned host memory, where only that fits; `stages`: a `stage` axis over
the model's `Stacked` layers and its schedules; `stages_step`: the meshes with the stage
axis of a step that calls `filter_pipeline` itself, found by `_pipeline.watch`; `remat`:
remat policies for layouts over budget by their activations); placing and measuring them
(`jobs`; `measure`: memory by part; `host_memory`: what stays in host memory;
`collectives`: bytes moved, read from the HLO; `flops`; the ops XLA runs on one device
and replicates, e.g. `eqx.error_if`, read by `eqxshard._step.pinned`), compiled here, in
a subprocess with more CPU devices or alongside this process (`compile_remote`,
`compile_worker`), scaled from a smaller mesh (`extrapolate`) or drawn through the
compiles of two smaller batches on it (`batch_proxies`); the alpha-beta link model
(`links`) and which axes cross nodes (`topology`); the ranking (`rank`), the pipeline
stages and remat choices (`stages`, `remat`), the result (`result`: `Plan`; `candidate`:
a row of its table; `choices`: its remat, offload and pipeline fields; `meshes`: its
mesh), using it (`use`: `Plan.jit`, `Plan.apply`), its table and picture (`view`) and the
cache of measured steps
(`cache`).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._placement`, `eqxshard._step`
(`Plan.jit` is `filter_jit`), `eqxshard._pipeline` (`Stacked`, configured by a plan; `watch`), the
rest of `eqxshard._plans` and this folder.
"""
