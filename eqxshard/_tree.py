"""PyTree plumbing shared by the verbs: leaf paths, prefix trees and error tables."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar, overload

import equinox as eqx
import jax

Path = tuple[Any, ...]

# A verb that returns its input's structure is typed `(tree: T, ...) -> T`, so that
# `filter_shard(model, mesh)` keeps `model`'s type for pyright and mypy users.
T = TypeVar("T")
# The parameters of a wrapped function, kept by verbs that return a function like it.
Params = ParamSpec("Params")


def is_array_like(x: Any) -> bool:
    """An array leaf of a concrete or abstract tree (`jax.ShapeDtypeStruct` included)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def dotted_path(path: Path) -> str:
    """A leaf's key path in the one form eqxshard writes and matches: `layers.0.weight`.

    Attribute names (`GetAttrKey`), sequence indices (`SequenceKey`) and dict keys
    (`DictKey`, written with `str`) joined by dots; the whole tree (a leaf at the root)
    is the empty string. Errors, `describe`, `auto_plan`'s tables and checkpoints name
    leaves in this form, and `path_rules` matches it, so a path copied from any of them
    is a pattern that matches that leaf.

    **Arguments:**

    - `path`: a key path, as from `jax.tree_util.tree_flatten_with_path`.

    **Returns:**

    The path as a string, e.g. `dotted_path((GetAttrKey("layers"), SequenceKey(0),
    GetAttrKey("weight"))) == "layers.0.weight"`.
    """
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return ".".join(parts)


def pathstr(path: Path, root: str = "") -> str:
    """A leaf path as errors and tables print it: `dotted_path`'s form after `root` (a
    name for the tree, e.g. `"args"` gives `args.0.weight`); the whole tree is `root`, or
    `<root>` without one."""
    return ".".join(part for part in (root, dotted_path(path)) if part) or "<root>"


_UNBUILT: Any = object()


class Flat:
    """A PyTree flattened once: every leaf, which leaves are arrays, and their paths.

    This is `eqx.partition(tree, eqx.is_array)` and `eqx.combine` in one pass, keeping
    the leaf paths that error messages need. Non-array leaves are kept as the very same
    objects and put back untouched. `is_array` picks the array leaves (plans over abstract
    trees also count `jax.ShapeDtypeStruct` leaves).
    """

    def __init__(self, tree: Any, is_array: Callable[[Any], bool] = eqx.is_array):
        self.leaves: list[Any]
        self.leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        self.is_array: list[bool] = [is_array(x) for x in self.leaves]
        self._tree = tree
        self._paths: list[Path] | None = None

    @classmethod
    def of_leaves(cls, leaves: list[Any], treedef: Any, is_array: list[bool]) -> Flat:
        """A `Flat` from a flattening already made (`leaves`, `treedef`) and which leaves
        are arrays: for a caller that flattened the tree itself. The tree is rebuilt only
        if the paths are asked for."""
        flat = cls.__new__(cls)
        flat.leaves, flat.treedef, flat.is_array = leaves, treedef, is_array
        flat._tree, flat._paths = _UNBUILT, None
        return flat

    @property
    def paths(self) -> list[Path]:
        """Each leaf's key path, in the order of `leaves`.

        Found on first use only (error messages, callable specs, prefix trees): flattening
        with paths costs more than flattening, and placing a model needs no paths.
        """
        if self._paths is None:
            if self._tree is _UNBUILT:
                self._tree = jax.tree_util.tree_unflatten(self.treedef, self.leaves)
            with_path, _ = jax.tree_util.tree_flatten_with_path(self._tree)
            self._paths = [p for p, _ in with_path]
        return self._paths

    @property
    def array_indices(self) -> list[int]:
        return [i for i, a in enumerate(self.is_array) if a]

    def rebuild(self, replaced: dict[int, Any]) -> Any:
        leaves = [replaced.get(i, x) for i, x in enumerate(self.leaves)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def broadcast_prefix(
    prefix: Any,
    tree: Any,
    *,
    is_leaf: Callable[[Any], bool],
    argname: str,
    verb: str,
) -> tuple[list[Any], list[Path], list[Path]]:
    """Gives each leaf of `tree` the leaf of `prefix` above it.

    `prefix` is a PyTree whose structure is a prefix of `tree`'s; its leaves are those
    for which `is_leaf` holds (`None` included). Returns the per-leaf values of `prefix`
    in `tree`'s flattening order, and the paths of prefix leaves that sit exactly on one
    leaf of `tree` (used to report values given for non-array leaves), and for each leaf
    of `tree` the path in `prefix` of the value it got.
    """
    pieces: list[tuple[Path, Any, int]] = []
    on_leaf: list[Path] = []

    def visit(path: Path, value: Any, subtree: Any) -> None:
        leaves = jax.tree_util.tree_leaves(subtree)
        pieces.append((tuple(path), value, len(leaves)))
        if len(leaves) == 1 and leaves[0] is subtree:
            on_leaf.append(path)

    try:
        jax.tree_util.tree_map_with_path(visit, prefix, tree, is_leaf=is_leaf)
    except ValueError as e:
        detail = str(e).replace("tree_map_with_path tree", f"`{argname}`")
        raise ValueError(
            f"`{verb}` got a `{argname}` whose structure is not a prefix of `tree`.\n"
            f"{detail}\n"
            f"Give `{argname}` the structure of `tree` (or of a prefix of it), with `None` "
            "for subtrees to leave alone."
        ) from None
    values = [value for _, value, count in pieces for _ in range(count)]
    prefixes = [path for path, _, count in pieces for _ in range(count)]
    return values, on_leaf, prefixes


# How many failing leaves an error lists before "... and N more": enough to see the
# pattern, few enough that the fix below them stays on the screen.
ROWS_SHOWN = 10


def leaf_table(rows: Sequence[tuple[str, ...]], shown: int = ROWS_SHOWN) -> str:
    """Aligns rows of (path, detail, ...) columns, two spaces apart and indented: the
    first `shown` of them, then a line counting the rest (`... and 93 more`)."""
    kept = list(rows[:shown])
    widths = [max(len(row[c]) for row in kept) for c in range(len(kept[0]))]
    lines = []
    for row in kept:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        lines.append("  " + "  ".join(cells).rstrip())
    if len(rows) > shown:
        lines.append(f"  ... and {len(rows) - shown} more")
    return "\n".join(lines)


def leaf_error(header: str, rows: Sequence[tuple[str, ...]], fix: str) -> str:
    """An error message: what went wrong, the failing leaves (the first `ROWS_SHOWN` and a
    count of the rest), and how to fix it."""
    return f"{header}\n{leaf_table(rows)}\n{fix}"


def did_you_mean(name: Any, choices: Sequence[str]) -> str:
    """`" Did you mean 'data'?"` for the choice closest to a mistyped `name`, or `""` when
    none is close (`difflib.get_close_matches`)."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class FallbackWarning(UserWarning):
    """A request that ran differently than asked, while the result stays correct: a
    `Stacked` with a pipeline `axis` the mesh lacks (run as the plain scan), a
    `filter_pipeline` batch whose microbatches do not split over the data axes (run
    replicated over them). Each is a warning, not an error, because the result is right;
    its message says what ran instead and the fix.

    Filter it as any warning, e.g. `warnings.simplefilter("error", eqxshard.FallbackWarning)`
    to make each an error, or `"ignore"` once it is meant.
    """


def shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def format_bytes(n: int, *, round_up: bool = False, sep: str = " ") -> str:
    """Bytes in binary units: `512 B`, `1.5 KiB`, `2.0 GiB` (`sep` between the number and
    the unit; `round_up`: the tenth above, never less than `n`)."""
    if n < 1024:
        return f"{n}{sep}B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            shown = math.ceil(size * 10) / 10 if round_up else size
            return f"{shown:.1f}{sep}{unit}"
    raise AssertionError("unreachable")


def device_name(device: Any) -> str:
    """A device as tables name it (`cpu:3`); an int is a position of an abstract mesh."""
    if isinstance(device, int):  # a position of an abstract mesh
        return f"device {device}"
    return f"{device.platform}:{device.id}"


# A verb's options, after its `fun`.
Options = ParamSpec("Options")


class KeepsSignature(Protocol[Options]):
    """The type of a verb `verb(fun, **options)` that returns a function with `fun`'s
    signature, and without `fun` a decorator that does (`fun_optional(keeps_signature=True)`).
    """

    @overload
    def __call__(
        self, fun: Callable[Params, T], /, *args: Options.args, **kwargs: Options.kwargs
    ) -> Callable[Params, T]: ...

    @overload
    def __call__(
        self, fun: None = None, /, *args: Options.args, **kwargs: Options.kwargs
    ) -> Callable[[Callable[Params, T]], Callable[Params, T]]: ...


class ReturnsFunction(Protocol[Options]):
    """The type of a verb `verb(fun, **options)` that returns a function, and without
    `fun` a decorator that does (`fun_optional()`).
    """

    @overload
    def __call__(
        self, fun: Callable[..., Any], /, *args: Options.args, **kwargs: Options.kwargs
    ) -> Callable[..., Any]: ...

    @overload
    def __call__(
        self, fun: None = None, /, *args: Options.args, **kwargs: Options.kwargs
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


@overload
def fun_optional(
    check: Callable[..., object] | None = None, *, keeps_signature: Literal[True]
) -> Callable[[Callable[Concatenate[Any, Options], Any]], KeepsSignature[Options]]: ...


@overload
def fun_optional(
    check: Callable[..., object] | None = None, *, keeps_signature: Literal[False] = False
) -> Callable[[Callable[Concatenate[Any, Options], Any]], ReturnsFunction[Options]]: ...


def fun_optional(
    check: Callable[..., object] | None = None, *, keeps_signature: bool = False
) -> Callable[[Any], Any]:
    """Lets a verb `verb(fun, **options)` also be called without `fun`, as a decorator
    factory: `verb(**options)` returns `functools.partial(verb, **options)`, so that
    `@verb(**options)` decorates `fun`.

    `check`, if given, is called with every option of the verb (defaults filled in)
    before anything else, with or without `fun`: a bad option is reported where it is
    written, not only once the decorator is applied. A call that does not fit the verb's
    signature raises the `TypeError` Python raises for it.

    With `keeps_signature=True` the verb is typed as `KeepsSignature` (it returns a
    function with `fun`'s signature, as `filter_map` and `filter_jit` do), else as
    `ReturnsFunction`.
    """

    def decorate(verb: Any) -> Any:
        signature = inspect.signature(verb)

        @functools.wraps(verb)
        def verb_or_decorator(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                verb(*args, **kwargs)  # raises Python's own error for this call
                raise
            bound.apply_defaults()
            options = dict(bound.arguments)
            fun = options.pop("fun")
            if check is not None:
                check(**options)
            if fun is None:
                return functools.partial(verb_or_decorator, **options)
            return verb(*args, **kwargs)

        return verb_or_decorator

    return decorate


def leading_dim(tree: Any) -> tuple[int | None, list[tuple[str, str]]]:
    """The leading dim most array leaves of `tree` share (abstract leaves too), and a row
    `(path, "shape ...")` for each array leaf that does not have it: a stack's size and its
    misfits, for the verbs that take stacked layers or experts.

    `(None, [])` if `tree` has no array leaf; `(None, rows)` of every array leaf if none of
    them has a dim. The most common dim wins; on a tie, the first leaf's.
    """
    leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_array_like(x)]
    counts: dict[int, int] = {}
    for _, x in leaves:
        if x.ndim:
            counts[x.shape[0]] = counts.get(x.shape[0], 0) + 1
    n = max(counts, key=lambda d: counts[d]) if counts else None
    rows = [
        (pathstr(p), f"shape {shape_str(x.shape)}")
        for p, x in leaves
        if not x.ndim or x.shape[0] != n
    ]
    return n, rows
