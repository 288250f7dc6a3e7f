"""The pipeline dimension: a stage axis.

- `dimension`: `Stage`, the dimension.
- `schedule`: stage meshes over the model's `Stacked` layers, their schedule chosen by
  arithmetic (bubble, permutes), and a pipeline's compute time.
- `tensor_parallel`: the rule of a stage mesh with a `model` axis.
- `in_step`: the meshes with the stage axis of a step that pipelines by itself.
- `scaled`: stage meshes over `compile_limit`, weighed by a floor before compiling.
"""
