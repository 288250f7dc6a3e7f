"""`auto_plan`'s caches of compiled results, and the keys they are read by.

In memory (`CACHE`): a key holds what it was made from: an unhashable leaf (a static of
the model that does not hash) is held by identity, its object kept alive by the key
(`Identity`), so that no other object can take its `id` while the entry lives and be
mistaken for it. It is emptied by `eqxshard.clear_caches` (registered with `_caches`).

On disk (`Disk`), across processes: one small JSON file per compile, named by a digest of
what determines it: the step's jaxpr on the abstract inputs (its code, the model's
structure and shapes), the inputs' structure, the candidate's mesh, rules, batch and
choices, and the JAX, jaxlib, backend and eqxshard versions. Written atomically; an entry
that cannot be read is a miss. `eqxshard.clear_caches` leaves it: delete the folder
(`default_folder()`) to empty it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import jax

from .... import _version
from ...._caches import register
from ...._step.pinned import PinnedOp
from ...._tree import is_array_like
from .collectives import Collective
from .compiled import FAST_COMPILE, Measurement

# Compiled results, per (step, shapes, mesh shape, rules, batch on that mesh): a second
# call with the same inputs compiles nothing.
CACHE: dict[Any, Measurement] = {}
register(CACHE.clear)


class Identity:
    """An unhashable object as part of a key: equal only to a key of the same object,
    which it keeps alive (so its `id` cannot be reused while the key exists)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"Identity({type(self.obj).__name__} at {id(self.obj):#x})"


def hashable(x: Any) -> Any:
    """`x` if it hashes, else `Identity(x)`."""
    try:
        hash(x)
    except TypeError:
        return Identity(x)
    return x


def shapes_key(tree: Any) -> Any:
    """A tree's structure, its array leaves' shapes and dtypes, and its other leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_array_like)
    return treedef, tuple(
        (tuple(x.shape), str(x.dtype)) if is_array_like(x) else hashable(x) for x in leaves
    )


# Where the disk cache is when `auto_plan` is not given `cache_dir=`.
ENV = "EQXSHARD_CACHE_DIR"


def default_folder() -> Path | None:
    """The disk cache's folder: `$EQXSHARD_CACHE_DIR` (empty: none), else `auto_plan`
    under `$XDG_CACHE_HOME/eqxshard` or `~/.cache/eqxshard`."""
    if ENV in os.environ:
        given = os.environ[ENV]
        return Path(given).expanduser() if given else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eqxshard" / "auto_plan"


def folder(cache_dir: Any) -> Path | None:
    """The folder of `auto_plan(..., cache_dir=)`: `None` for the default, `False` or `""`
    for none, else the path given."""
    if cache_dir is None:
        return default_folder()
    if cache_dir is False or cache_dir == "":
        return None
    if isinstance(cache_dir, str | os.PathLike) and not isinstance(cache_dir, bool):
        return Path(cache_dir).expanduser()
    raise TypeError(
        "`auto_plan` takes `cache_dir` as a folder (a str or a path), `False` for no disk "
        f"cache, or `None` for the default, but got {type(cache_dir).__name__}."
    )


# Addresses in a repr (`<function f at 0x7f...>`) differ from process to process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def stable(text: str) -> str:
    """`text` without the object addresses that would make it differ between processes."""
    return _ADDRESS.sub("", text)


def _tree_text(tree: Any) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_array_like)
    shapes = [(tuple(x.shape), str(x.dtype)) if is_array_like(x) else repr(x) for x in leaves]
    return f"{treedef} {shapes}"


def _environment() -> str:
    """What a compile's figures depend on beside the step: the versions, the backend and
    its device kind, the compile options."""
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = "unknown"
    devices = jax.devices()
    kind = devices[0].device_kind if devices else ""
    return (
        f"jax {jax.__version__} jaxlib {jaxlib} {jax.default_backend()} {kind} "
        f"eqxshard {_version.version()} {sorted(FAST_COMPILE.items())}"
    )


def _ints(collective: dict[str, Any]) -> tuple[int, int]:
    return int(collective["group_size"]), int(collective["count"])


@dataclasses.dataclass(frozen=True)
class Disk:
    """The disk cache of one search: its folder and the digest of the problem's part of
    every entry's name (the step's jaxpr text, the inputs' structure, the environment)."""

    folder: Path
    problem: str

    @classmethod
    def of(cls, where: Path, jaxpr_text: str, trees: tuple[Any, ...]) -> Disk:
        text = "\n".join([_environment(), stable(jaxpr_text), *map(stable, map(_tree_text, trees))])
        return cls(where, hashlib.sha256(text.encode()).hexdigest())

    def path(self, parts: tuple[Any, ...]) -> Path:
        """The entry of a compile whose own key is `parts` (mesh, rules, choices, batch)."""
        text = stable(f"{self.problem} {parts!r}")
        return self.folder / f"{hashlib.sha256(text.encode()).hexdigest()}.json"

    def load(self, path: Path) -> Measurement | None:
        """The measurement stored at `path`, or `None` (no entry, or one that cannot be read)."""
        try:
            data = json.loads(path.read_text())
            return Measurement(
                memory={str(k): int(v) for k, v in data["memory"].items()},
                flops=float(data["flops"]),
                collectives=tuple(
                    Collective(c["kind"], int(c["bytes"]), tuple(c["axes"]), *_ints(c))
                    for c in data["collectives"]
                ),
                pinned=tuple(
                    PinnedOp(p["source"], p["op_name"], tuple(p["shapes"])) for p in data["pinned"]
                ),
                host=int(data["host"]),
                host_temp=int(data["host_temp"]),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def store(self, path: Path, m: Measurement) -> None:
        """Writes `m` at `path` atomically (a temporary file, then `os.replace`); a folder
        that cannot be written to is left as it is (the next search compiles again)."""
        data = dataclasses.asdict(m)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f)
                os.replace(temp, path)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
        except OSError:
            return


@dataclasses.dataclass(frozen=True)
class ProblemKey:
    """The problem's part of each compile's key: `key` in memory (the step itself, the
    inputs' shapes), and where its compiles are kept on disk (`None`: not kept)."""

    key: Any
    disk: Disk | None = dataclasses.field(default=None, compare=False)
