"""The scale phase: figures for meshes over `compile_limit`.

- `phase`: `scale`, the phase (each dimension's layouts left over the limit).
- `extrapolate`: a smaller mesh to compile, and the figures scaled from it.
"""
