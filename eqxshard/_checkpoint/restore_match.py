"""Which leaves `filter_restore` reads: `like` against the checkpoint's metadata.

By default both must hold the same leaves with the same shapes and dtypes (one error
lists every difference). `cast=True` reads a leaf saved in another dtype into `like`'s;
`strict=False` restores what matches and keeps the rest: leaves only the checkpoint has
are not read (a part of a saved tree), and leaves of `like` the checkpoint lacks or holds
in another shape keep `like`'s own value (a model that changed since the save).

A `Stacked` of `like` whose leaves the checkpoint holds as a list of blocks (a model saved
before its `for block in self.blocks` loop became `Stacked.from_layers(blocks)`) is read
from those blocks and stacked (`stacked_from_list`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

from .. import _compat
from .._pipeline.stacked.stacked import is_stacked
from .._tree import Flat, dotted_path, leaf_error, pathstr, shape_str


def stored(leaf: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of what `filter_save` writes for a leaf (key data for PRNG keys)."""
    if _compat.is_prng_key(leaf):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)


def _describe(shape: Any, dtype: Any) -> str:
    return f"{shape_str(tuple(shape))} {np.dtype(dtype).name}"


def match(
    where: str,
    flat: Flat,
    names: dict[str, int],
    saved: Any,
    *,
    strict: bool,
    cast: bool,
    hint: str = "",
) -> tuple[dict[str, int], list[int]]:
    """The leaves to read (name -> index in `flat`) and those that keep `like`'s value.

    Raises one error listing every difference that `strict` and `cast` do not allow (with
    `hint` after its fix).
    """
    rows: list[tuple[str, ...]] = []
    read: dict[str, int] = {}
    kept: list[tuple[int, str]] = []
    for name, i in names.items():
        want = stored(flat.leaves[i])
        asked = _describe(want.shape, want.dtype)
        if name not in saved:
            rows.append((name, f"in `like` as {asked}", "not in the checkpoint"))
            kept.append((i, "not in the checkpoint"))
            continue
        have = saved[name]
        held = _describe(have.shape, have.dtype)
        if tuple(have.shape) != tuple(want.shape):
            rows.append((name, f"in `like` as {asked}", f"in the checkpoint as {held}"))
            kept.append((i, f"saved as {held}, asked as {asked}"))
        elif np.dtype(have.dtype) != np.dtype(want.dtype) and not cast:
            rows.append((name, f"in `like` as {asked}", f"in the checkpoint as {held}"))
            kept.append((i, f"saved as {held}, asked as {asked}"))
        else:
            read[name] = i
    extra = [n for n in saved if n not in names]
    if strict:
        rows += [
            (
                n,
                "not in `like`",
                f"in the checkpoint as {_describe(saved[n].shape, saved[n].dtype)}",
            )
            for n in extra
        ]
        if rows:
            order = ""
            if any(".stage_major_" in r[0] or r[0].startswith("stage_major_") for r in rows):
                order = (
                    " A `Stacked` stored stage-major (`stage_major_SxR` in its leaves' names: "
                    "S stages x `repeats=R`) restores only into a `Stacked` stored the same "
                    "way: build `like`'s stack with the saved one's stage count and `repeats` "
                    "(or with neither, for one saved in layer order), then change it through "
                    "`Stacked.from_layers(stack.to_layers(), ...)`."
                )
            raise ValueError(
                leaf_error(
                    f"`filter_restore`: {where} does not match `like` (leaves by dotted path; "
                    "PRNG keys as their key data):",
                    rows,
                    "Build `like` as the saved tree was built (the same model class and "
                    "configuration). To restore every leaf that matches and keep `like`'s own "
                    "value for the others (a new model, initialised and placed), or to read a "
                    "part of the saved tree, pass `strict=False`; to read leaves saved in "
                    "another dtype into `like`'s dtype, pass `cast=True`." + order + hint,
                )
            )
        return read, []
    abstract = [
        (pathstr(flat.paths[i]), why)
        for i, why in kept
        if not isinstance(flat.leaves[i], (jax.Array, np.ndarray, np.generic))
    ]
    if abstract:
        raise ValueError(
            leaf_error(
                f"`filter_restore` (with `strict=False`): {where} has no value for these leaves "
                "of `like`, and `like` holds none either (they are abstract):",
                abstract,
                "Pass a `like` with arrays at these leaves (e.g. a newly initialised model), "
                "whose values are then kept.",
            )
        )
    if kept:
        rows_kept = [(pathstr(flat.paths[i]), why) for i, why in kept]
        warnings.warn(
            leaf_error(
                f"`filter_restore` (with `strict=False`) kept `like`'s own value for these "
                f"leaves, which {where} does not hold as asked:",
                rows_kept,
                "They are laid out as asked but not restored; pass `strict=True` to make this "
                "an error.",
            ),
            stacklevel=3,
        )
    return read, [i for i, _ in kept]


@dataclasses.dataclass(frozen=True)
class Stacking:
    """A leaf of a `Stacked` of `like` read from a checkpoint of the list form: the saved
    blocks' leaves (`blocks.0.w`, `blocks.1.w`, ..., in layer order), stacked along a new
    leading dim, then stored stage-major for `order` (stages, repeats) if not `None`."""

    pieces: tuple[str, ...]
    order: tuple[int, int] | None


def stacked_from_list(
    flat: Flat, names: dict[str, int], saved: Any, like: Any, *, cast: bool
) -> dict[str, Stacking]:
    """The leaves of `like`'s `Stacked`s (`blocks.blocks.w`, shape `(n, ...)`) that the
    checkpoint lacks but holds as a list of `n` blocks (`blocks.0.w` ... `blocks.{n-1}.w`,
    each of shape `(...)` and `like`'s dtype, or any with `cast`): a model saved with
    `self.blocks = [Block(...), ...]` restores into one with `Stacked.from_layers(...)`
    at `blocks`. Keyed by the stacked leaf's name in `names`."""
    found = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_stacked)[0]
    stacks = [(dotted_path(p), s) for p, s in found if is_stacked(s)]
    out: dict[str, Stacking] = {}
    for name, i in names.items():
        leaf = flat.leaves[i]
        if name in saved or _compat.is_prng_key(leaf) or not getattr(leaf, "ndim", 0):
            continue
        for where, stack in stacks:
            order = None if stack.stages is None else (stack.stages, stack.repeats)
            # A stage-major stack's leaves carry its order after its path (`store._name`).
            tag = "" if order is None else f"stage_major_{order[0]}x{order[1]}"
            prefix = ".".join(part for part in (where, tag, "blocks") if part)
            if name != prefix and not name.startswith(prefix + "."):
                continue
            rest = name[len(prefix) :]
            pieces = tuple(
                f"{where}.{k}{rest}" if where else f"{k}{rest}" for k in range(leaf.shape[0])
            )
            if all(
                p in saved
                and tuple(saved[p].shape) == tuple(leaf.shape[1:])
                and (cast or np.dtype(saved[p].dtype) == np.dtype(leaf.dtype))
                for p in pieces
            ):
                out[name] = Stacking(pieces, order)
            break
    return out


def list_hint(like: Any, saved: Any) -> str:
    """For an error: where `like` has a `Stacked` and the checkpoint a list of blocks at
    the same path (`blocks.0.…`) that `stacked_from_list` could not stack, how it would."""
    found = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_stacked)[0]
    for path, stack in found:
        if not is_stacked(stack):
            continue
        where = dotted_path(path)
        first = f"{where}.0." if where else "0."
        if any(name.startswith(first) for name in saved):
            return (
                f" `like` has an `eqxshard.Stacked` at {where or 'its root'} where the "
                f"checkpoint holds a list of blocks (`{first}…`): they restore into it when "
                "the checkpoint holds every layer of the stack, each leaf of one layer's "
                "shape and dtype. Build `like` from the saved model's blocks: "
                f"`eqx.tree_at(lambda m: m.{where or '...'}, model, "
                f"eqxshard.Stacked.from_layers(model.{where or '...'}))` (see "
                "docs/pipelines.md)."
            )
    return ""
