"""Sharding rules: say how a whole model is laid out, not leaf by leaf.

A rule is accepted anywhere a `spec` is (`filter_shard(model, mesh, rule)`, `filter_shardings`,
`describe`, `filter_init`). `_placement.resolve` calls its `spec_for(path, leaf, mesh)` on
each array leaf, with that leaf's mesh. Rules here:

- `first(a, b, ...)` or `a | b`: the first rule that matches a leaf gives its spec;
- `as_rule`: any other `spec` form (a `PartitionSpec`, a callable, a prefix tree) as one.

Other rules build on `Rule`: `path_rules`, `fsdp`, `logical`, `like` (each in its own
module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from .. import _compat
from .._placement import spec_tree
from .._placement.targets import RuleError
from .._tree import Path, dotted_path as dotted_path, pathstr, shape_str


class _NoMatch:
    def __repr__(self) -> str:
        return "NO_MATCH"


NO_MATCH: Any = _NoMatch()
"""What `Rule.match` returns for a leaf the rule has nothing to say about, so that the next
rule of a `first(...)` is asked (`None` means "leave this leaf alone")."""


class Rule:
    """A sharding rule: gives each array leaf a `PartitionSpec` from its path, shape and mesh.

    Build rules with `path_rules`, `fsdp`, `logical`, `like` and `first` (or `a | b`); pass
    one (alone or in a prefix PyTree) as the `spec` of `filter_shard`, `filter_shardings`,
    `describe`, `filter_init` or `filter_restore`.

    To write your own, subclass `Rule` and define `match(path, leaf, mesh)` returning a
    `PartitionSpec`, `None` (leave the leaf alone) or `NO_MATCH` (let the next rule of a
    `first(...)` decide). Optionally define `replicated_because(path, leaf, mesh)`
    returning why the rule leaves a leaf whole on every device (or `None`): `describe`
    sums these up below its table.
    """

    # What to do when no rule matches a leaf; the last line of that error.
    no_match_fix = "Add a rule for these leaves, or end with a catch-all such as `P()`."

    def match(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> Any:
        raise NotImplementedError

    def spec_for(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> PartitionSpec | None:
        spec = self.match(path, leaf, mesh)
        if spec is NO_MATCH:
            raise RuleError(
                "has no rule that matches these leaves:",
                (f"shape {shape_str(leaf.shape)}",),
                self.no_match_fix,
            )
        return spec

    def replicated_because(self, path: Path, leaf: Any, mesh: Mesh | AbstractMesh) -> str | None:
        """Why this rule leaves `leaf` whole on every device, for `describe`'s summary
        (e.g. "fewer than `min_size` elements"); `None` where it does not say."""
        return None

    def unused(self, seen: Sequence[tuple[Path, Any, Any]]) -> list[str]:
        """The parts of this rule that gave none of the leaves `seen` (each `(path, leaf,
        mesh)` it was asked about in one call) its spec, for a warning naming them
        (`path_rules`'s patterns); `[]` where it has no such parts."""
        return []

    def __or__(self, other: Any) -> Rule:
        return first(self, other)

    def __ror__(self, other: Any) -> Rule:
        return first(other, self)


class _Constant(Rule):
    def __init__(self, spec: PartitionSpec | None):
        self.spec = spec

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        return self.spec

    def __repr__(self) -> str:
        return _compat.spec_str(self.spec)


class _Callable(Rule):
    def __init__(self, fn: Callable[[Path, Any], Any]):
        self.fn = fn

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        return self.fn(path, leaf)

    def __repr__(self) -> str:
        return f"<callable {getattr(self.fn, '__name__', self.fn)!r}>"


class _Prefix(Rule):
    """A prefix PyTree of specs, rules and callables: each leaf gets what the entry above
    it gives (a rule or callable sees the path from where it was given); leaves outside
    the tree, none."""

    no_match_fix = (
        "Give the spec tree the structure of the model (or a prefix of it), or add a rule "
        "after it for the other leaves (`first(spec_tree, P())`)."
    )

    def __init__(self, tree: Any, verb: str):
        is_leaf = spec_tree.is_spec_form
        entries = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
        bad = [(p, x) for p, x in entries if not is_leaf(x)]
        if bad:
            rows = "\n".join(f"  {pathstr(p)}: {type(x).__name__}" for p, x in bad)
            raise TypeError(
                f"`{verb}` takes rules, `PartitionSpec`s, `None`, callables or spec trees; a spec "
                "tree must have one of these at every leaf, but got (path: type):"
                f"\n{rows}\nPut a PartitionSpec, a rule (`fsdp`, `path_rules`, `like`, ...), a "
                "callable `(path, leaf) -> PartitionSpec | None`, or `None` (leave a leaf alone) "
                "there."
            )
        self.specs = {tuple(p): as_rule(x, verb) for p, x in entries}

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        for k in range(len(path) + 1):
            if path[:k] in self.specs:
                return self.specs[path[:k]].match(path[k:], leaf, mesh)
        return NO_MATCH

    def replicated_because(self, path: Path, leaf: Any, mesh: Any) -> str | None:
        for k in range(len(path) + 1):
            if path[:k] in self.specs:
                return self.specs[path[:k]].replicated_because(path[k:], leaf, mesh)
        return None

    def unused(self, seen: Sequence[tuple[Path, Any, Any]]) -> list[str]:
        under: dict[tuple, list[tuple[Path, Any, Any]]] = {p: [] for p in self.specs}
        for path, leaf, mesh in seen:
            path = tuple(path)
            k = next((k for k in range(len(path) + 1) if path[:k] in self.specs), None)
            if k is not None:
                under[path[:k]].append((path[k:], leaf, mesh))
        return [part for p, rule in self.specs.items() for part in rule.unused(under[p])]


def as_rule(spec: Any, verb: str) -> Rule:
    """Any `spec` form as a rule: a rule, a PartitionSpec, `None`, a callable, a spec tree."""
    if isinstance(spec, Rule):
        return spec
    if spec is None or isinstance(spec, PartitionSpec):
        return _Constant(spec)
    if callable(spec) and not isinstance(spec, eqx.Module):
        return _Callable(spec)
    return _Prefix(spec, verb)


class First(Rule):
    """Rules tried in order; see `first`."""

    no_match_fix = (
        "No rule matched. Add a rule for these leaves, or end with a catch-all such as `P()` "
        "(replicated): `first(..., P())`."
    )

    def __init__(self, rules: Sequence[Rule]):
        self.rules = list(rules)

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        for rule in self.rules:
            spec = rule.match(path, leaf, mesh)
            if spec is not NO_MATCH:
                return spec
        return NO_MATCH

    def replicated_because(self, path: Path, leaf: Any, mesh: Any) -> str | None:
        for rule in self.rules:  # the rule that gave the leaf its spec says why
            if rule.match(path, leaf, mesh) is not NO_MATCH:
                return rule.replicated_because(path, leaf, mesh)
        return None

    def unused(self, seen: Sequence[tuple[Path, Any, Any]]) -> list[str]:
        decided: list[list[tuple[Path, Any, Any]]] = [[] for _ in self.rules]
        for path, leaf, mesh in seen:  # each leaf to the rule that gave its spec
            for n, rule in enumerate(self.rules):
                if rule.match(path, leaf, mesh) is not NO_MATCH:
                    decided[n].append((path, leaf, mesh))
                    break
        pairs = zip(self.rules, decided, strict=True)
        return [part for rule, mine in pairs for part in rule.unused(mine)]

    def __repr__(self) -> str:
        return " | ".join(repr(r) for r in self.rules)


def first(*rules: Any) -> First:
    """Rules composed: each leaf gets its spec from the first rule that matches it.

    `first(a, b)` is also written `a | b`. A rule matches a leaf when it has something to
    say about it: a path rule when one of its patterns matches, a spec tree when the leaf
    is under it; `fsdp`, `like`, a `PartitionSpec`, `None` and a callable match every
    leaf, so they end a chain. A leaf no rule matches is an error listing every such leaf.

    **Arguments:**

    - `*rules`: rules or any other `spec` form (a `PartitionSpec`, `None` to leave
        leaves alone, a callable `(path, leaf) -> spec`, a prefix PyTree of these and
        rules, whose rules see paths from the subtree they were given for).

    **Returns:**

    A `Rule`, to pass as a `spec`.

    **Raises:**

    - `TypeError`: if no rules are given, or a spec tree has leaves that are not specs,
        rules, callables or `None`.
    - `ValueError` (when resolved): for leaves that no rule matches.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"), axis_types=auto)
        k1, k2 = jax.random.split(jax.random.key(0))
        model = eqx.nn.Sequential([eqx.nn.Embedding(64, 16, key=k1), eqx.nn.Linear(16, 64, key=k2)])
        # The embedding split over "model", everything else fully sharded over "data":
        rules = eqxshard.path_rules([(r"layers\\.0\\.weight", P(None, "model"))])
        model = eqxshard.filter_shard(model, mesh, rules | eqxshard.fsdp("data"))
        ```
    """
    if not rules:
        raise TypeError("`first` takes at least one rule, but got none.")
    flat: list[Rule] = []
    for rule in (as_rule(r, "first") for r in rules):
        flat.extend(rule.rules if isinstance(rule, First) else [rule])
    return First(flat)
