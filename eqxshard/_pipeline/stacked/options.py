"""`Stacked`'s pipeline options read when it is built: checked (all of them or none, of
the right types), and the stage count a circular stack is stored stage-major for."""

from __future__ import annotations

from typing import Any

from jax.sharding import AbstractMesh, Mesh

from ... import _compat


def check_options(axis: Any, microbatches: Any, repeats: Any, mesh: Any) -> None:
    """`Stacked`'s pipeline configuration: all or nothing, of the right types."""
    if axis is None:
        given = [n for n, v in (("microbatches", microbatches), ("mesh", mesh)) if v is not None]
        if given or repeats != 1:
            names = ", ".join(f"`{n}`" for n in given + (["repeats"] if repeats != 1 else []))
            raise ValueError(
                f"`Stacked` got {names} without `axis`; they configure the pipeline, which "
                'runs only over a mesh axis. Pass `axis="stage"` (the mesh axis to pipeline '
                "over) as well, or leave them out for the plain scan."
            )
        return
    if not isinstance(axis, str):
        raise TypeError(f"`Stacked` got `axis={axis!r}`; expected a mesh axis name (a str).")
    for name, value in (("microbatches", microbatches), ("repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TypeError(
                f"`Stacked` got `{name}={value!r}` with `axis={axis!r}`; expected a "
                f"positive int. A pipeline cuts each batch into `microbatches` pieces "
                f"(at least the number of stages keeps the bubble small)."
            )
    if mesh is not None and not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"`Stacked` got `mesh` of type {type(mesh).__name__}; expected a "
            "`jax.sharding.Mesh` (or `None`, for the mesh set by `jax.set_mesh`)."
        )


def stored_stages(axis: str | None, repeats: int, mesh: Any) -> int | None:
    """The stage count a circular stack is stored stage-major for: the size of `axis` in
    `mesh` (or the mesh set now); `None` (layer order) for GPipe or an unknown count."""
    if axis is None or repeats == 1:
        return None
    mesh = mesh if mesh is not None else _compat.ambient_mesh()
    if mesh is None or axis not in mesh.axis_names:
        return None
    stages = dict(mesh.shape)[axis]
    return stages if stages > 1 else None
