"""`context_attention` against attention on one device, written here in plain JAX: values
and gradients with respect to query, key and value, the output's layout, each strategy's
collectives and the ring's memory, and every bad input's error."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_sharding, make_mesh, named

import eqxshard

T, H, D = 32, 4, 8


def reference(q, k, v, mask=None, segment_ids=None, causal=False, scale=None, factors=None):
    """Attention on one device: softmax over the keys a query may see (a query that sees
    none gets 0), grouped-query heads by repeating each key head; `factors` `(..., H, T,
    S)` multiply the weights after the softmax (dropout)."""
    t, h, dk = q.shape[-3:]
    s, g = k.shape[-3], k.shape[-2]
    scale = 1 / math.sqrt(dk) if scale is None else scale
    k, v = jnp.repeat(k, h // g, axis=-2), jnp.repeat(v, h // g, axis=-2)
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * scale
    valid = jnp.ones(scores.shape, bool)
    if causal:
        valid &= jnp.tril(jnp.ones((t, s), bool))
    if mask is not None:
        valid &= mask[..., None, :, :]
    if segment_ids is not None:
        valid &= (segment_ids[..., :, None] == segment_ids[..., None, :])[..., None, :, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1), 0)
    if factors is not None:
        weights = weights * factors
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


@dataclass(frozen=True)
class Case:
    strategy: str
    kind: str = "auto"  # the mesh's axis types
    data: int = 1  # the size of a "data" axis before "context" (1: no data axis)
    context: int = 4
    causal: bool = False
    key_heads: int = 2
    mask: bool = False
    segments: bool = False
    lead: tuple[int, ...] = (2,)
    shared: bool = False  # one mask / segment ids for every example, without batch dims

    def mesh(self):
        if self.data == 1:
            return make_mesh(self.kind, (self.context,), ("context",))
        return make_mesh(self.kind, (self.data, self.context), ("data", "context"))

    def layout(self):
        """How the inputs and the output are laid out: batch over data, sequence over context."""
        batch = ["data" if self.data > 1 and i == 0 else None for i in range(len(self.lead))]
        return (*batch, "context")


def inputs(case: Case, seed: int = 0):
    """Query, key, value, mask and segment ids; query 3 of the first example sees no key."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (*case.lead, T, H, D))
    k = jax.random.normal(keys[1], (*case.lead, T, case.key_heads, D))
    v = jax.random.normal(keys[2], (*case.lead, T, case.key_heads, D))
    mask = seg = None
    lead = () if case.shared else case.lead
    if case.mask:
        mask = jax.random.bernoulli(keys[3], 0.7, (*lead, T, T))
        mask = mask.at[(0,) * len(lead) + (3,)].set(False)
    if case.segments:
        seg = jnp.sort(jax.random.randint(keys[4], (*lead, T), 0, 3), axis=-1)
    return q, k, v, mask, seg


def _loss_and_grads(attention):
    def loss(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(jnp.sin(out) * jnp.arange(out.shape[-1])), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


def _check_against_reference(case: Case, run) -> None:
    """`run(attention)` calls `_loss_and_grads(attention)` on the inputs as it likes."""
    q, k, v, mask, seg = inputs(case)
    mesh = case.mesh()
    split = named(mesh, *case.layout())
    placed = [jax.device_put(x, split) if case.data > 1 else x for x in (q, k, v)]

    def attention(q, k, v):
        return eqxshard.context_attention(
            q,
            k,
            v,
            mask=mask,
            segment_ids=seg,
            causal=case.causal,
            mesh=mesh,
            strategy=case.strategy,
        )

    def plain(q, k, v):
        return reference(q, k, v, mask, seg, case.causal)

    (_, out), grads = run(_loss_and_grads(attention), *placed)
    (_, expected), expected_grads = _loss_and_grads(plain)(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_sharding(out.sharding, split, out.ndim)  # the sequence stays split
    if case.mask:  # a query that sees no key: 0, and no NaN in any gradient
        np.testing.assert_array_equal(np.asarray(out)[(0,) * len(case.lead) + (3,)], 0)


CASES = [
    Case("ring", causal=True, mask=True, segments=True),
    Case("ring", kind="explicit", data=2, key_heads=1, mask=True),
    Case("ring", context=8, causal=True, key_heads=4, lead=()),
    Case("all_gather", kind="explicit", causal=True, mask=True, segments=True, shared=True),
    Case("all_gather", data=2, mask=True, lead=(2, 3)),
    Case("all_to_all", causal=True, mask=True, segments=True),  # 2 key heads over 4: repeated
    Case("all_to_all", kind="explicit", data=2, key_heads=4, segments=True),
]


def _case_id(case: Case) -> str:
    parts = [case.strategy, case.kind, f"data{case.data}" if case.data > 1 else ""]
    parts += [f"context{case.context}", f"G{case.key_heads}", f"lead{len(case.lead)}"]
    parts += [name for name in ("causal", "mask", "segments", "shared") if getattr(case, name)]
    return "-".join(p for p in parts if p)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_attention_on_one_device_under_jit(case: Case):
    _check_against_reference(case, lambda f, *args: jax.jit(f)(*args))


# Every strategy, causal or not, one key head or one per query head, on each mesh
# (all_to_all needs the 4 heads to divide over the axis: not over 8).
MESHES = [("explicit", 1, 4), ("auto", 2, 4), ("explicit", 2, 4), ("auto", 1, 8)]
EVERY = [
    Case(strategy, kind, data, context, causal, key_heads, mask=True, segments=True)
    for strategy in ("ring", "all_gather", "all_to_all")
    for kind, data, context in MESHES
    for causal in (False, True)
    for key_heads in (1, 4)
    if not (strategy == "all_to_all" and H % context)
]


@pytest.mark.heavy
@pytest.mark.parametrize("case", EVERY, ids=_case_id)
def test_matches_attention_on_one_device_every_combination(case: Case):
    _check_against_reference(case, lambda f, *args: jax.jit(f)(*args))


def test_eagerly_and_under_filter_jit_with_the_mesh_set():
    case = Case("ring", causal=True, mask=True)
    _check_against_reference(case, lambda f, *args: f(*args))
    _check_against_reference(case, lambda f, *args: eqx.filter_jit(f)(*args))
    q, k, v, _, _ = inputs(case)
    mesh = case.mesh()
    with jax.set_mesh(mesh):
        out = eqxshard.context_attention(q, k, v, causal=True)
    np.testing.assert_allclose(out, reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    assert_sharding(out.sharding, named(mesh, None, "context"), out.ndim)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_per_example_under_vmap(kind: str):
    """The per-example call an Equinox model makes, batched by `jax.vmap`."""
    case = Case("ring", kind=kind, causal=True, segments=True, lead=())
    mesh = case.mesh()
    q, k, v, _, seg = inputs(replace(case, lead=(3,)))

    def one(q, k, v, seg):
        return eqxshard.context_attention(q, k, v, segment_ids=seg, causal=True, mesh=mesh)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(jax.vmap(one)(q, k, v, seg)))

    def plain(q, k, v):
        return jnp.sum(jnp.sin(reference(q, k, v, segment_ids=seg, causal=True)))

    out, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    expected, expected_grads = jax.value_and_grad(plain, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _compiled(strategy: str, t: int, *, grad: bool, context: int = 4, causal: bool = False):
    mesh = make_mesh("auto", (context,), ("context",))
    q = jax.ShapeDtypeStruct((1, t, H, D), jnp.float32)

    def attention(q, k, v):
        out = eqxshard.context_attention(q, k, v, causal=causal, mesh=mesh, strategy=strategy)
        return jnp.sum(out**2)

    f = jax.grad(attention, argnums=(0, 1, 2)) if grad else attention
    return jax.jit(f).lower(q, q, q).compile()


@pytest.mark.parametrize(
    ("strategy", "collective"),
    [("ring", "collective-permute"), ("all_gather", "all-gather"), ("all_to_all", "all-to-all")],
)
def test_each_strategy_compiles_to_its_collective(strategy: str, collective: str):
    text = _compiled(strategy, T, grad=True).as_text()
    assert text is not None
    assert collective in text
    if strategy == "ring":  # keys and values only ever pass round, forward and backward
        assert "all-gather" not in text and "all-to-all" not in text


def test_the_ring_holds_no_score_block_of_the_whole_sequence():
    """At T=1024 over 8 devices, a device's `T/C x T` scores are 2 MiB (all heads, float32):
    the all-gather strategy holds them, the ring a few `T/C x T/C` blocks at a time
    (forward: about 2.3 blocks' worth, 0.6 MiB; with its backward: 5.5, 1.4 MiB)."""
    t, context = 1024, 8
    block = (t // context) * t * H * 4
    for grad in (False, True):
        ring = _compiled("ring", t, grad=grad, context=context).memory_analysis()
        gather = _compiled("all_gather", t, grad=grad, context=context).memory_analysis()
        assert ring is not None and gather is not None
        assert ring.temp_size_in_bytes < block <= gather.temp_size_in_bytes


def _zeros(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_heads_split_over_a_second_axis(strategy: str, kind: str):
    """With `heads_axis`, each device attends its heads of its part of the sequence: the
    same values and gradients, the output's heads split over that axis."""
    mesh = make_mesh(kind, (2, 2), ("context", "model"))
    q, k, v, mask, _ = inputs(Case(strategy, mask=True))
    split = named(mesh, None, "context", "model")
    placed = [jax.device_put(x, split) for x in (q, k, v)]

    def attention(q, k, v):
        return eqxshard.context_attention(
            q, k, v, mask=mask, mesh=mesh, strategy=strategy, heads_axis="model"
        )

    (_, out), grads = jax.jit(_loss_and_grads(attention))(*placed)
    plain = lambda q, k, v: reference(q, k, v, mask)
    (_, expected), expected_grads = _loss_and_grads(plain)(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_sharding(out.sharding, split, out.ndim)


P_DROP = 0.3
# (strategy, causal): the ring's causal layout draws its blocks' bits in zig-zag order.
DROPOUT = [("ring", False), ("ring", True), ("all_gather", True), ("all_to_all", False)]


def _factors(mesh, strategy: str, causal: bool, key, *, lead=(2,), heads_axis=None):
    """The factor each attention weight got, `(..., H, T, S)`, read off an attention whose
    queries are 0 (every key it sees weighs the same) and whose values are one-hot key
    positions: output `[t, h, s]` is the weight of key `s` for query `t`, times its factor."""
    zeros = jnp.zeros((*lead, T, H, D))
    onehot = jnp.broadcast_to(jnp.eye(T)[:, None, :], (*lead, T, 2, T))
    out = eqxshard.context_attention(
        zeros,
        zeros[..., :2, :],
        onehot,
        causal=causal,
        mesh=mesh,
        strategy=strategy,
        dropout_p=P_DROP,
        dropout_key=key,
        heads_axis=heads_axis,
    )
    seen = np.arange(1, T + 1) if causal else np.full(T, T)  # keys each query sees
    return np.moveaxis(np.asarray(out), -2, -3) * seen[:, None]


@pytest.mark.parametrize("strategy, causal", DROPOUT)
def test_dropout_drops_each_weight_with_probability_p(strategy: str, causal: bool):
    """Each weight is kept (times `1/(1-p)`) or dropped, with the probability asked for;
    each example, head and block draws its own bits, the same for the same key; values
    and gradients are those of attention with the weights so dropped."""
    mesh = make_mesh("auto", (4,), ("context",))
    key = jax.random.key(7)
    factors = _factors(mesh, strategy, causal, key)
    seen = np.broadcast_to(np.tril(np.ones((T, T), bool)) if causal else True, factors.shape)
    kept = factors[seen] * (1 - P_DROP)
    np.testing.assert_allclose(kept, np.round(kept), atol=1e-5)  # 0 or 1/(1-p)
    assert abs(kept.mean() - (1 - P_DROP)) < 4 * math.sqrt(P_DROP * (1 - P_DROP) / kept.size)
    np.testing.assert_array_equal(factors[~seen], 0)
    diagonal = [factors[0, 0, i * 8 : (i + 1) * 8, i * 8 : (i + 1) * 8] for i in range(4)]
    others = [*diagonal[1:], factors[1, 0, :8, :8], factors[0, 1, :8, :8]]
    assert all(not np.array_equal(diagonal[0], x) for x in others)
    np.testing.assert_array_equal(factors, _factors(mesh, strategy, causal, key))
    assert not np.array_equal(factors, _factors(mesh, strategy, causal, jax.random.key(8)))

    q, k, v, _, _ = inputs(Case(strategy))

    def attention(q, k, v):
        return eqxshard.context_attention(
            q,
            k,
            v,
            causal=causal,
            mesh=mesh,
            strategy=strategy,
            dropout_p=P_DROP,
            dropout_key=key,
        )

    (_, out), grads = jax.jit(_loss_and_grads(attention))(q, k, v)
    plain = lambda q, k, v: reference(q, k, v, causal=causal, factors=factors)
    (_, expected), expected_grads = _loss_and_grads(plain)(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dropout_with_examples_and_heads_over_explicit_axes():
    """Examples and heads on other devices of the data and heads axes get other factors,
    the same whichever devices hold them (read off inputs left whole, they are those of
    the inputs laid out): values and gradients are attention's with them."""
    mesh = make_mesh("explicit", (2, 2, 2), ("data", "context", "model"))
    key = jax.random.key(7)
    factors = _factors(mesh, "ring", True, key, heads_axis="model")
    assert not np.array_equal(factors[0, 0], factors[1, 0])  # examples over `data`
    assert not np.array_equal(factors[0, 0], factors[0, 2])  # heads over `model`
    kept = factors[np.broadcast_to(np.tril(np.ones((T, T), bool)), factors.shape)]
    np.testing.assert_allclose(kept * (1 - P_DROP), np.round(kept * (1 - P_DROP)), atol=1e-5)
    q, k, v, _, _ = inputs(Case("ring"))
    split = named(mesh, "data", "context", "model")
    placed = [jax.device_put(x, split) for x in (q, k, v)]

    def attention(q, k, v):
        return eqxshard.context_attention(
            q,
            k,
            v,
            causal=True,
            mesh=mesh,
            heads_axis="model",
            dropout_p=P_DROP,
            dropout_key=key,
        )

    (_, out), grads = jax.jit(_loss_and_grads(attention))(*placed)
    plain = lambda q, k, v: reference(q, k, v, causal=True, factors=factors)
    (_, expected), expected_grads = _loss_and_grads(plain)(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy, causal", DROPOUT)
def test_dropout_averages_to_attention_without_it(strategy: str, causal: bool):
    """Over many keys (one call under `jax.vmap` over the key), the mean output is the
    output without dropout, within five standard errors of each element."""
    mesh = make_mesh("auto", (4,), ("context",))
    q, k, v, _, _ = inputs(Case(strategy))
    attend = lambda key, p: eqxshard.context_attention(
        q, k, v, causal=causal, mesh=mesh, strategy=strategy, dropout_p=p, dropout_key=key
    )
    keys = jax.random.split(jax.random.key(0), 400)
    outs = np.asarray(jax.jit(jax.vmap(lambda key: attend(key, P_DROP)))(keys))
    want = np.asarray(attend(None, 0.0))
    error = np.abs(outs.mean(axis=0) - want)
    assert np.all(error <= 5 * outs.std(axis=0) / math.sqrt(len(keys)) + 1e-5)
    assert outs.std(axis=0).mean() > 0.05  # the outputs do vary with the key


# (arguments changed from a good call, the error, the words it must say)
BAD = {
    "query_length": (
        {"query": _zeros(2, 30, H, D)},
        ValueError,
        r"cannot split the sequence of `query` \(length 30\) evenly over mesh axis 'context' "
        r"\(size 4\)\. Pad the sequence to a multiple of 4",
    ),
    "key_length": (
        {"key": _zeros(2, 30, 2, D), "value": _zeros(2, 30, 2, D)},
        ValueError,
        r"sequence of `key` \(length 30\)",
    ),
    "causal_ring_chunks": (
        {"query": _zeros(2, 36, H, D), "key": _zeros(2, 36, 2, D), "value": _zeros(2, 36, 2, D)},
        ValueError,
        r"causal=True, strategy='ring'\)` splits the sequence into 8 chunks.*Pad the sequence",
    ),
    "all_to_all_heads": (
        {"query": _zeros(2, T, 6, D), "strategy": "all_to_all", "causal": False},
        ValueError,
        r"strategy='all_to_all'\)` splits the heads.*`query` has 6 heads, not a multiple of 4",
    ),
    "axis": ({"axis": "sequence"}, ValueError, r"`context_attention\(axis=\.\.\.\)` must name"),
    "strategy": ({"strategy": "ulysses"}, ValueError, r"strategy=\.\.\.\)` must be one of"),
    "widths": ({"key": _zeros(2, T, 2, 4)}, ValueError, r"same width Dk"),
    "heads": (
        {"key": _zeros(2, T, 3, D), "value": _zeros(2, T, 3, D)},
        ValueError,
        r"`query` has 4 heads and `key` has 3: the query heads must be a multiple",
    ),
    "key_value": ({"value": _zeros(2, T, 1, D)}, ValueError, r"must agree on S and G"),
    "batch": ({"key": _zeros(3, T, 2, D)}, ValueError, r"same leading \(batch\) dims"),
    "rank": ({"query": _zeros(T, D)}, ValueError, r"`query` must have shape \(\.\.\., T, H, Dk\)"),
    "mask_shape": (
        {"mask": _zeros(2, T, T - 1, dtype=bool)},
        ValueError,
        r"mask=\.\.\.\)` must have shape \(\.\.\., T, S\) = \(2, 32, 32\)",
    ),
    "mask_dtype": (
        {"mask": _zeros(2, T, T)},
        TypeError,
        r"mask=\.\.\.\)` must be a boolean array, got dtype float32",
    ),
    "segments_shape": (
        {"segment_ids": _zeros(2, T, 1, dtype=np.int32)},
        ValueError,
        r"segment_ids=\.\.\.\)` must have shape \(\.\.\., T\)",
    ),
    "segments_dtype": ({"segment_ids": _zeros(2, T)}, TypeError, r"must be an integer array"),
    "segments_lengths": (
        {
            "key": _zeros(2, 16, 2, D),
            "value": _zeros(2, 16, 2, D),
            "causal": False,
            "segment_ids": _zeros(2, T, dtype=np.int32),
        },
        ValueError,
        r"segment_ids=\.\.\.\)` are shared by queries and keys",
    ),
    "causal_lengths": (
        {"key": _zeros(2, 16, 2, D), "value": _zeros(2, 16, 2, D)},
        ValueError,
        r"causal=True\)` needs queries and keys of the same length",
    ),
    "causal_type": ({"causal": "yes"}, TypeError, r"`context_attention\(causal=\.\.\.\)` must"),
    "scale_type": ({"scale": "big"}, TypeError, r"`context_attention\(scale=\.\.\.\)` must"),
    "heads_axis": (
        {"heads_axis": "context"},
        ValueError,
        r"`context_attention\(heads_axis=\.\.\.\)` must name an axis of the mesh other than",
    ),
    "heads_axis_size": (
        {"heads_axis": "model", "mesh": make_mesh("auto", (2, 4), ("context", "model"))},
        ValueError,
        r"heads_axis='model'\)` splits the heads over an axis of size 4.*`key` 2",
    ),
    "dropout_range": ({"dropout_p": 1.5}, ValueError, r"\(dropout_p=\.\.\.\)` must be in \[0, 1\]"),
    "dropout_type": ({"dropout_p": "0.1"}, TypeError, r"\(dropout_p=\.\.\.\)` must be a Python"),
    "dropout_key": (
        {"dropout_p": 0.1},
        ValueError,
        r"`context_attention\(dropout_p=0.1\)` drops attention weights.*needs `dropout_key`",
    ),
    "no_mesh": ({"mesh": None}, ValueError, r"without a `mesh` and no mesh is set"),
    "mesh_type": ({"mesh": "context"}, TypeError, r"`context_attention\(mesh=\.\.\.\)` must"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_clear_error(name: str):
    changes, error, words = BAD[name]
    call = {
        "query": _zeros(2, T, H, D),
        "key": _zeros(2, T, 2, D),
        "value": _zeros(2, T, 2, D),
        "causal": True,
        "mesh": make_mesh("auto", (4,), ("context",)),
        **changes,
    }
    q, k, v = call.pop("query"), call.pop("key"), call.pop("value")
    with pytest.raises(error, match=words):
        eqxshard.context_attention(q, k, v, **call)


def test_eager_calls_build_one_program_per_call_shape():
    """Eagerly, one jitted program per call shape (kept across calls, emptied by
    `eqxshard.clear_caches`), not a `shard_map` run op by op on every call."""
    from eqxshard._sequence import attention

    case = Case("ring")
    q, k, v, _, _ = inputs(case)
    mesh = case.mesh()
    eqxshard.clear_caches()
    first = eqxshard.context_attention(q, k, v, mesh=mesh)
    again = eqxshard.context_attention(q, k, v, mesh=mesh)
    info = attention._program.cache_info()  # noqa: SLF001 - the cache under test
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)
    np.testing.assert_array_equal(first, again)
    eqxshard.context_attention(
        q[..., : T // 2, :, :], k[..., : T // 2, :, :], v[..., : T // 2, :, :], mesh=mesh
    )
    assert attention._program.cache_info().currsize == 2  # noqa: SLF001
    eqxshard.clear_caches()
    assert attention._program.cache_info().currsize == 0  # noqa: SLF001
