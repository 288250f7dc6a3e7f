"""Tensor parallelism found from the model's structure and shapes: the rule that splits its
matmul weights over the `model` axis.

The width `W` of the residual stream is the embedding size (or the input size of the
first `Linear`); a `Linear` or `Embedding` weight `(out, in)` that reads `W` (`in == W`)
is an in-projection, split on its output dim; one that writes `W` (`out == W`) is an
out-projection, split on its input dim. Square `W x W` weights that share a parent
module (attention's query, key, value and output projections) are in-projections but the
last, which is their out-projection. Each in/out pair then needs one collective (an
all-reduce of the out-projection's partial sums), as in Megatron-LM.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P

from ...._tree import Path, is_array_like
from ...fsdp import fsdp
from ...path_rules import path_rules
from ...rules import Rule, dotted_path


@dataclasses.dataclass(frozen=True)
class Role:
    """A matmul weight's part in tensor parallelism: the dim split over `model`."""

    dim: int
    kind: str  # "in" (split on the output dim), "out" (on the input dim), "bias"


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    return None


def tensor_parallel_roles(model: Any) -> dict[str, Role]:
    """The dotted path of each matmul weight (and in-projection bias) -> its role."""
    weights: list[tuple[Path, Any, Any]] = []  # (path, leaf, its module)
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_array_like)[0]:
        if not is_array_like(leaf) or not path:
            continue
        parent: Any = model
        for key in path[:-1]:
            parent = _child(parent, key)
        if isinstance(parent, eqx.nn.Linear | eqx.nn.Embedding):
            weights.append((path, leaf, parent))
    embeddings = [leaf for _, leaf, m in weights if isinstance(m, eqx.nn.Embedding)]
    # Weights of layers stacked for a scan (`eqx.filter_vmap` over the constructor) have
    # leading layer dims: the matrix is the last two dims.
    matrices = [(p, x, m) for p, x, m in weights if len(x.shape) >= 2]
    if embeddings and len(embeddings[0].shape) >= 2:
        width = embeddings[0].shape[-1]
    elif matrices:
        width = matrices[0][1].shape[-1]
    else:
        return {}
    roles: dict[str, Role] = {}
    path_shape = {tuple(p): tuple(x.shape) for p, x, _ in matrices}
    square: dict[Path, list[Path]] = {}  # the grandparent (the module holding the Linear)
    for path, leaf, module in matrices:
        out_dim, in_dim = leaf.shape[-2:]
        rows, cols = len(leaf.shape) - 2, len(leaf.shape) - 1
        if isinstance(module, eqx.nn.Embedding) or (in_dim == width and out_dim != width):
            roles[dotted_path(path)] = Role(rows, "in")
        elif out_dim == width and in_dim != width:
            roles[dotted_path(path)] = Role(cols, "out")
        elif out_dim == in_dim == width:
            square.setdefault(tuple(path[:-2]), []).append(path)
    for group in square.values():
        if len(group) < 2:
            continue  # a lone square weight has no partner: left whole
        for path in group[:-1]:
            roles[dotted_path(path)] = Role(len(path_shape[path]) - 2, "in")
        roles[dotted_path(group[-1])] = Role(len(path_shape[group[-1]]) - 1, "out")
    for path, leaf, _ in weights:
        weight = path[:-1] + (jax.tree_util.GetAttrKey("weight"),)
        role = roles.get(dotted_path(weight))
        if role is not None and role.kind == "in" and len(leaf.shape) == role.dim + 1:
            roles[dotted_path(path)] = Role(role.dim, "bias")
    return roles


def _pattern(path: str) -> str:
    parts = [r"\d+" if p.isdigit() else re.escape(p) for p in path.split(".")]
    return r"(?:.*\.)?" + r"\.".join(parts)


def tensor_parallel_specs(
    model: Any, roles: dict[str, Role], shape: dict[str, int]
) -> tuple[dict[str, P], list[str], dict[str, P | None]]:
    """The spec of each weight split over `shape`'s `model` axis (and `fsdp`, when it has
    one) by its dotted path, the weights left whole because their dim does not divide,
    and every array leaf's spec (`None`: not split) by its path."""
    m, f = shape.get("model", 1), shape.get("fsdp", 1)
    specs: dict[str, P] = {}
    skipped = []
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_array_like)[0]
    leaves = [(p, x) for p, x in leaves if is_array_like(x)]
    for path, leaf in leaves:
        text = dotted_path(path)
        role = roles.get(text)
        if role is None:
            continue
        dims = list(leaf.shape)
        if dims[role.dim] % m:
            skipped.append(text)
            continue
        entries: list[Any] = [None] * len(dims)
        entries[role.dim] = "model"
        other = len(dims) - 1 if role.dim == len(dims) - 2 else len(dims) - 2
        if f > 1 and role.kind != "bias" and dims[other] % f == 0:
            entries[other] = "fsdp"
        specs[text] = P(*entries)
    return specs, skipped, {dotted_path(p): specs.get(dotted_path(p)) for p, _ in leaves}


def spec_patterns(specs: dict[str, P], every: dict[str, P | None]) -> list[tuple[str, P]]:
    """`(pattern, spec)` entries for `path_rules` giving each path of `specs` its spec and
    no other leaf of `every` (all array leaves' paths -> their spec) another, whatever the
    entries' order: one pattern per path with its layer indices written `\\d+` where every
    leaf it matches has that spec; else the path itself (with any prefix, for the
    optimiser state's copies) less the longer paths ending the same way whose spec
    differs (`head.linear.weight` vs `linear.weight`)."""
    out: list[tuple[str, P]] = []
    for text, spec in specs.items():
        literal = r"(?:.*\.)?" + re.escape(text)
        for pattern in (_pattern(text), literal):
            if all(every[t] == spec for t in every if re.fullmatch(pattern, t)):
                break
        else:
            others = [t for t in every if re.fullmatch(literal, t) and every[t] != spec]
            exclude = "|".join(re.escape(t) for t in others)
            pattern = rf"(?!(?:.*\.)?(?:{exclude})\Z)" + literal
        if all(pattern != g for g, _ in out):
            out.append((pattern, spec))
    return out


def tensor_parallel_rule(
    model: Any, roles: dict[str, Role], shape: dict[str, int]
) -> tuple[Rule, list[str]] | None:
    """The TP (or FSDP x TP, when `shape` has `fsdp`) rule for `shape`, with the weights
    left whole because their dim does not divide; None if no weight can be split."""
    specs, skipped, every = tensor_parallel_specs(model, roles, shape)
    if not specs:
        return None
    return with_rest(spec_patterns(specs, every), shape), skipped


def with_rest(entries: list[tuple[str, P]], shape: dict[str, int]) -> Rule:
    """`path_rules(entries)`, every other leaf by FSDP over `fsdp` when `shape` has that
    axis, else replicated."""
    if shape.get("fsdp", 1) > 1:
        return path_rules(entries) | fsdp("fsdp")
    return path_rules([*entries, (".*", P())])
