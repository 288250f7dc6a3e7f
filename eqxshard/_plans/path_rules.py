"""`path_rules([(pattern, spec), ...])`: a rule of regular expressions over each leaf's
dotted path."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from .. import _compat
from .._tree import Path
from .rules import NO_MATCH, Rule, dotted_path


class PathRules(Rule):
    """Regular expressions over leaf paths; see `path_rules`."""

    def __init__(self, rules: Sequence[tuple[str | re.Pattern, PartitionSpec | None]]):
        self.rules: list[tuple[re.Pattern, PartitionSpec | None]] = []
        problems = []
        for n, item in enumerate(rules):
            if not (isinstance(item, tuple) and len(item) == 2):
                problems.append(f"  rule {n}: {item!r} is not a (pattern, spec) pair")
                continue
            pattern, spec = item
            if not (spec is None or isinstance(spec, PartitionSpec)):
                problems.append(f"  rule {n}: spec {spec!r} is not a PartitionSpec or None")
                continue
            try:
                self.rules.append((re.compile(_from_keystr(pattern)), spec))
            except (re.error, TypeError) as e:
                problems.append(f"  rule {n}: pattern {pattern!r} is not a regular expression: {e}")
        if problems:
            raise TypeError(
                "`path_rules` takes a list of (pattern, spec) pairs: a regular expression "
                "and a PartitionSpec (or `None` to leave matching leaves alone), but got:\n"
                + "\n".join(problems)
                + "\nFor example: path_rules([(r'.*\\.weight', P(None, 'model')), (r'.*', P())])."
            )
        patterns = ", ".join(repr(p.pattern) for p, _ in self.rules) or "none"
        self.no_match_fix = (
            f"Patterns tried, in order: {patterns}. Each must match a whole dotted path "
            "(`re.fullmatch`). Add a pattern for these paths, end with a catch-all "
            "`(r'.*', P())`, or follow with another rule (`path_rules([...]) | fsdp('data')`)."
        )

    def match(self, path: Path, leaf: Any, mesh: Any) -> Any:
        text = dotted_path(path)
        for pattern, spec in self.rules:
            if pattern.fullmatch(text):
                return spec
        return NO_MATCH

    def unused(self, seen: Sequence[tuple[Path, Any, Any]]) -> list[str]:
        used = set()
        for path, _, _ in seen:
            text = dotted_path(path)
            used.add(next((n for n, (p, _) in enumerate(self.rules) if p.fullmatch(text)), None))
        paths = list(dict.fromkeys(dotted_path(path) for path, _, _ in seen))
        return [
            f"path_rules pattern {p.pattern!r}{_near_misses(p, paths)}"
            for n, (p, _) in enumerate(self.rules)
            if n not in used and not _catch_all(p)
        ]

    def __repr__(self) -> str:
        rules = ", ".join(f"({p.pattern!r}, {_compat.spec_str(s)})" for p, s in self.rules)
        return f"path_rules([{rules}])"


# A path in jax's `keystr` form (`.layers[0].weight`, `['key']`), as eqxshard printed paths
# before it printed them dotted: read as that one path, so a path pasted from older output
# still matches its leaf.
_KEYSTR = re.compile(r"(?:\.[A-Za-z_]\w*|\[\d+\]|\['[^']*'\]|\[\"[^\"]*\"\])+")
_KEYSTR_PART = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]|\['([^']*)'\]|\[\"([^\"]*)\"\]")


def _from_keystr(pattern: Any) -> Any:
    """`pattern` itself, or, for a path in `keystr` form, that path dotted and escaped."""
    if not isinstance(pattern, str) or not _KEYSTR.fullmatch(pattern):
        return pattern
    parts = [next(g for g in m.groups() if g is not None) for m in _KEYSTR_PART.finditer(pattern)]
    return re.escape(".".join(parts))


def _near_misses(pattern: re.Pattern, paths: list[str]) -> str:
    """` (near misses: 'blocks.0.attn.weight', ...)`: the leaf paths closest to `pattern`
    read as text (its escapes and `\\d+`s dropped), for a pattern with a typo; `""` when
    none is close."""
    text = re.sub(r"\\d[+*]?|\\(.)", lambda m: m.group(1) or "0", pattern.pattern)
    close = difflib.get_close_matches(text, paths, n=3, cutoff=0.6)
    return f" (near misses: {', '.join(map(repr, close))})" if close else ""


def _catch_all(pattern: re.Pattern) -> bool:
    """A pattern such as `.*` that matches any path: kept as a safeguard, never warned
    about when earlier patterns leave it nothing."""
    return all(pattern.fullmatch(text) for text in ("", "layers.0.weight", "a"))


def path_rules(
    rules: Sequence[tuple[str | re.Pattern, PartitionSpec | None]]
    | Mapping[str, PartitionSpec | None]
    | Mapping[re.Pattern, PartitionSpec | None]
    | Mapping[str | re.Pattern, PartitionSpec | None],
) -> PathRules:
    """A rule that gives each leaf the spec of the first pattern its path matches.

    Each leaf's path is written in dotted form (`layers.0.weight`, see `dotted_path`: the
    form errors, `describe` and `auto_plan` print) and matched against the patterns in
    order with `re.fullmatch` (the whole path must match; write `.*` for "anything"). The
    first match wins. A leaf that no pattern matches is an
    error listing every such path, unless the rule is followed by another
    (`path_rules([...]) | fsdp("data")`) or ends with a catch-all `(r".*", P())`. A
    pattern that gives no leaf its spec (it matches no path, or earlier patterns or
    rules take every leaf it matches) is a warning naming it and the leaf paths closest
    to it, alone or inside `first` (a catch-all such as `.*` excepted), from
    `filter_shard`, `filter_shardings` and `filter_init`: the layout is still a valid
    one, but not the one asked for. `describe`, often asked about a part of a model with
    the whole's rules, lists such patterns below its table instead.

    **Arguments:**

    - `rules`: an ordered list of `(pattern, spec)` pairs (or a dict, in its order):
        - `pattern`: a regular expression (a string or a compiled `re.Pattern`); a
            string that is a whole path in `jax.tree_util.keystr`'s form
            (`.layers[0].weight`, `['key']`, as older versions printed paths) stands for
            that one path (`layers\\.0\\.weight`);
        - `spec`: a `PartitionSpec`, or `None` to leave matching leaves alone.

    **Returns:**

    A `Rule`, to pass as a `spec`.

    **Raises:**

    - `TypeError`: if an item is not a pair, a pattern is not a regular expression, or a
        spec is not a `PartitionSpec` or `None`.
    - `ValueError` (when resolved, e.g. by `filter_shard`): for leaves no pattern matches.

    **Warns:**

    - `UserWarning` (when resolved): for patterns that give no leaf its spec.

    !!! Example

        ```python
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"), axis_types=auto)
        model = eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0))
        rules = eqxshard.path_rules([
            (r"(query|key|value)_proj\\.weight", P("model", None)),
            (r"output_proj\\.weight", P(None, "model")),
            (r".*", P()),  # everything else replicated
        ])
        model = eqxshard.filter_shard(model, mesh, rules)
        ```
    """
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    elif isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"`path_rules` takes a list of (pattern, spec) pairs, but got {type(rules).__name__}."
        )
    return PathRules(rules)
