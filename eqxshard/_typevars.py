"""Type variables of the public signatures: a verb that returns its input's structure is
typed `(tree: T, ...) -> T`, so `filter_shard(model, mesh)` keeps `model`'s type for
pyright and mypy users."""

from typing import TypeVar

T = TypeVar("T")
