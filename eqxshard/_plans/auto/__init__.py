"""`auto_plan`: choosing a layout for the user, measured rather than guessed.

`search.auto_plan` runs the search as its phases, in this order (`search.PHASES`), each
passing the next a named record:

- `trace/`: the arguments checked and the step traced (`phase.trace` -> `Traced`):
  `arguments` (devices, budget, options, the step's trace), `problem` (the inputs as
  shapes), `own_pipeline` (a step that calls `filter_pipeline` itself), `flops` (matmul
  flops from the jaxpr, scans counted).
- `dimensions/`: the parallelism dimensions, each one module behind `base.Dimension`,
  registered in `registry.DIMENSIONS`; `propose` (each one's layouts -> `Proposal`) and
  `refine` (variants of measured layouts) are phases. `data_fsdp_tensor` (the mesh
  factorisations and rule families; `tensor_parallel`: the TP rule from the model's
  shapes), `stage/` (a pipeline's stage axis), `offload` (optimiser state in host
  memory), `remat/` (remat policies for `Stacked` layers), `context` (the sequence split
  over a `context` axis), `experts` (a model's `Experts` split over an `expert` axis).
- `measure/`: each layout compiled and read (`phase.measure` -> `Search`): `jobs` (laid
  out, compiled here or in a subprocess: `compile_remote`, `compile_worker`), `compiled`
  (the step as compiled, its `Measurement`), `collectives` and `host_memory` (read from
  the HLO), `batch_proxies` (batches drawn through two compiles), `cache`.
- `scale/`: layouts over `compile_limit`, from a smaller mesh (`phase.scale`;
  `extrapolate`: the mesh arithmetic).
- `rank/`: the rows ranked into a `Plan` (`phase.rank`): `row` (a row from a compile, by
  the alpha-beta model), `table` (ranking, reasons, the error when nothing fits),
  `topology` (which link each axis gets).

Beside them, what a plan is: `result` (`Plan`), `candidate` (a row of its table), `layout`
(a candidate layout, the record every phase passes), `links` (`Link`, `LINKS`, the
alpha-beta model), `choices` (a plan's remat, offload and pipeline fields), `meshes` (its
mesh), `use` (`Plan.jit`, `Plan.apply`), `view` (its table and picture).

Imports: `eqxshard._compat`, `eqxshard._tree`, `eqxshard._caches`, `eqxshard._placement`,
`eqxshard._step` (`Plan.jit` is `filter_jit`), `eqxshard._pipeline` (`Stacked`, configured by
a plan; `watch`), the rest of `eqxshard._plans` and this folder.
"""
