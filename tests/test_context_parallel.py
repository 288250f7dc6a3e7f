"""`context_parallel` against the model it converts, on one device: one attention layer
(each strategy, per-head masks, causal), an ESM2-like protein language model written as
others write it (rotary embeddings through `process_heads`, a padding mask, layers
stacked by `eqx.filter_vmap` and run by `lax.scan`) on a `(data, context)` mesh, a
training step under `eqxshard.filter_jit`, and every bad input's error."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_mesh, trains_as_one_device
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard._sequence.parallel import ContextParallelAttention

T, E, HEADS, LAYERS, VOCAB, PAD = 32, 16, 4, 2, 11, 0


def _paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _allclose(got, want, tol=2e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_one_layer_matches_the_original(strategy: str):
    mesh = make_mesh("auto", (4,), ("context",))
    attention = eqx.nn.MultiheadAttention(HEADS, E, use_query_bias=True, key=jax.random.key(0))
    split = eqxshard.context_parallel(attention, strategy=strategy, mesh=mesh)
    assert isinstance(split, ContextParallelAttention)
    assert isinstance(split, eqx.nn.MultiheadAttention)
    assert _paths(split) == _paths(attention)
    again = eqxshard.context_parallel(split, strategy="all_gather", mesh=mesh)
    assert type(again) is ContextParallelAttention and again.strategy == "all_gather"
    x = jax.random.normal(jax.random.key(1), (3, T, E))
    mask = jax.random.bernoulli(jax.random.key(2), 0.6, (T, T)).at[:, 0].set(True)
    heads = jax.random.bernoulli(jax.random.key(3), 0.6, (HEADS, T, T)).at[:, :, 0].set(True)

    def loss(model, x, m):
        return jnp.sum(jnp.sin(jax.vmap(lambda x: model(x, x, x, m))(x)))

    for m in (None, mask) if strategy == "all_to_all" else (None, mask, heads):
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(split, x, m)
        want = eqx.filter_value_and_grad(loss)(attention, x, m)
        _allclose(got, want)
    if strategy == "all_to_all":
        with pytest.raises(ValueError, match=r"cannot take a mask per head.*strategy='ring'"):
            loss(split, x, heads)


# jax 0.7.2 records no mesh axes a `vmap` takes over an Explicit axis, and fails to lower a
# per-example `shard_map` there ("Sharding spec ('data',) implies that array axis 0 is
# partitioned 2 times, but does not evenly divide the dimension size 1"); later JAX runs it.
HAS_VMAP_MESH_AXES = hasattr(
    __import__("jax._src.core", fromlist=["get_axis_env"]).get_axis_env(),
    "explicit_mesh_axis_names",
)


@pytest.mark.skipif(not HAS_VMAP_MESH_AXES, reason="JAX records no vmap-taken mesh axes")
def test_on_an_explicit_data_context_mesh():
    """Inputs laid out over Explicit `data` and `context` axes; the output keeps the layout."""
    mesh = make_mesh("explicit", (2, 4), ("data", "context"))
    attention = eqx.nn.MultiheadAttention(HEADS, E, key=jax.random.key(0))
    split = eqxshard.filter_replicate(eqxshard.context_parallel(attention, mesh=mesh), mesh)
    x = jax.random.normal(jax.random.key(1), (2, T, E))
    laid_out = jax.device_put(x, NamedSharding(mesh, P("data", "context")))

    def loss(model, x):
        return jnp.sum(jnp.sin(jax.vmap(lambda x: model(x, x, x))(x)))

    got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(split, laid_out)
    _allclose(got, eqx.filter_value_and_grad(loss)(attention, x))
    out = eqx.filter_jit(lambda m, x: jax.vmap(lambda x: m(x, x, x))(x))(split, laid_out)
    assert out.sharding.spec == P("data", "context", None)


def test_causal_equals_a_causal_mask():
    mesh = make_mesh("auto", (4,), ("context",))
    attention = eqx.nn.MultiheadAttention(HEADS, E, key=jax.random.key(0))
    split = eqxshard.context_parallel(attention, causal=True, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (T, E))
    pad = jnp.broadcast_to(jnp.arange(T) < T - 5, (T, T))  # the last 5 keys are padding
    tril = jnp.tril(jnp.ones((T, T), bool))
    _allclose(eqx.filter_jit(split)(x, x, x), attention(x, x, x, tril))
    _allclose(eqx.filter_jit(split)(x, x, x, pad), attention(x, x, x, tril & pad))


class Layer(eqx.Module):
    """An ESM2-like layer: pre-norm attention with rotary embeddings, then an MLP."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    rotary: eqx.nn.RotaryPositionalEmbedding
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(E)
        self.attention = eqx.nn.MultiheadAttention(
            HEADS, E, use_query_bias=True, use_key_bias=True, use_output_bias=True, key=keys[0]
        )
        self.rotary = eqx.nn.RotaryPositionalEmbedding(E // HEADS)
        self.norm2 = eqx.nn.LayerNorm(E)
        self.up = eqx.nn.Linear(E, 2 * E, key=keys[1])
        self.down = eqx.nn.Linear(2 * E, E, key=keys[2])

    def __call__(self, x, mask):
        def process_heads(q, k, v):
            rotate = jax.vmap(self.rotary, in_axes=1, out_axes=1)
            return rotate(q), rotate(k), v

        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y, mask, process_heads=process_heads)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))


class ProteinLM(eqx.Module):
    """Embedding, `LAYERS` layers stacked and run by `lax.scan`, a norm and a head."""

    embedding: eqx.nn.Embedding
    layers: Layer
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, E, key=keys[0])
        self.layers = eqx.filter_vmap(Layer)(jax.random.split(keys[1], LAYERS))
        self.norm = eqx.nn.LayerNorm(E)
        self.head = eqx.nn.Linear(E, VOCAB, key=keys[2])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        mask = jnp.broadcast_to(tokens != PAD, (tokens.shape[0], tokens.shape[0]))
        params, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer_params):
            return eqx.combine(layer_params, static)(x, mask), None

        x, _ = jax.lax.scan(step, x, params)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss_fn(model, tokens):
    logits = jax.vmap(model)(tokens)
    targets = jnp.roll(tokens, -1, axis=1)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(jnp.where(tokens != PAD, losses, 0)) / jnp.sum(tokens != PAD)


def _tokens(batch: int = 4):
    tokens = jax.random.randint(jax.random.key(7), (batch, T), 1, VOCAB)
    return tokens.at[1, T - 9 :].set(PAD).at[2, T - 3 :].set(PAD)  # padded examples


def test_a_protein_lm_matches_the_original_on_a_data_context_mesh():
    mesh = make_mesh("auto", (2, 4), ("data", "context"))
    model = ProteinLM(jax.random.key(0))
    split = eqxshard.context_parallel(model, mesh=mesh)
    assert _paths(split) == _paths(model)
    assert isinstance(split.layers.attention, ContextParallelAttention)
    tokens = _tokens()
    laid_out = jax.device_put(tokens, NamedSharding(mesh, P("data", "context")))
    replicated = eqxshard.filter_replicate(split, mesh)
    got = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(replicated, laid_out)
    want = eqx.filter_value_and_grad(loss_fn)(model, tokens)
    _allclose(got, want)
    forward = eqx.filter_jit(lambda model, tokens: jax.vmap(model)(tokens))
    _allclose(forward(replicated, laid_out), jax.vmap(model)(tokens))
    # Keys and values go round the ring; the compiled program holds no all-gather of them.
    params, static = eqx.partition(replicated, eqx.is_array)
    run = jax.jit(lambda params, tokens: jax.vmap(eqx.combine(params, static))(tokens))
    hlo = run.lower(params, laid_out).compile().as_text()
    assert hlo is not None and "collective-permute" in hlo


def test_a_training_step_equals_the_one_device_step():
    mesh = make_mesh("auto", (2, 4), ("data", "context"))
    optimiser = optax.adam(1e-2)
    model = ProteinLM(jax.random.key(0))
    split = eqxshard.filter_replicate(eqxshard.context_parallel(model, mesh=mesh), mesh)
    # An optimiser state made from the original model converts as the model does.
    state = optimiser.init(eqx.filter(model, eqx.is_array))
    split_state = eqxshard.context_parallel(state, mesh=mesh)
    assert jax.tree.structure(split_state) == jax.tree.structure(
        optimiser.init(eqx.filter(split, eqx.is_array))
    )
    tokens = _tokens()
    laid_out = jax.device_put(tokens, NamedSharding(mesh, P("data", "context")))
    trains_as_one_device(loss_fn, optimiser, (model, state, tokens), (split, split_state, laid_out))


def test_no_attention_warns_and_returns_the_model():
    model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    with pytest.warns(UserWarning, match=r"found no `eqx.nn.MultiheadAttention`.*unchanged"):
        out = eqxshard.context_parallel(model)
    assert jax.tree.structure(out) == jax.tree.structure(model)
    assert all(a is b for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(model), strict=True))


def test_dropout_in_inference_mode_gives_the_originals_outputs():
    mesh = make_mesh("auto", (4,), ("context",))
    attention = eqx.nn.MultiheadAttention(HEADS, E, dropout_p=0.3, key=jax.random.key(0))
    split = eqxshard.context_parallel(attention, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (T, E))
    want = attention(x, x, x, inference=True)
    _allclose(split(x, x, x, key=jax.random.key(2), inference=True), want)
    _allclose(eqx.nn.inference_mode(split)(x, x, x), want)
    with pytest.raises(ValueError, match=r"drops attention weights.*needs a `key`.*inference"):
        split(x, x, x)


@pytest.mark.parametrize("strategy", ["ring", "all_gather", "all_to_all"])
def test_dropout_is_the_originals_in_distribution(strategy: str):
    """With dropout: the same output for the same key, another for another key; over many
    keys the mean is the output without dropout and the spread the original's; gradients
    flow to every projection."""
    mesh = make_mesh("auto", (4,), ("context",))
    attention = eqx.nn.MultiheadAttention(HEADS, E, dropout_p=0.3, key=jax.random.key(0))
    split = eqxshard.context_parallel(attention, strategy=strategy, mesh=mesh)
    x = jax.random.normal(jax.random.key(1), (T, E))
    call = eqx.filter_jit(lambda m, key: m(x, x, x, key=key))
    one, other = jax.random.key(2), jax.random.key(3)
    np.testing.assert_array_equal(call(split, one), call(split, one))
    assert not np.allclose(call(split, one), call(split, other))

    keys = jax.random.split(jax.random.key(4), 400)
    outs = eqx.filter_jit(lambda m: jax.vmap(lambda key: m(x, x, x, key=key))(keys))
    got, original = np.asarray(outs(split)), np.asarray(outs(attention))
    want = np.asarray(attention(x, x, x, inference=True))
    error = np.abs(got.mean(axis=0) - want)
    assert np.all(error <= 5 * got.std(axis=0) / np.sqrt(len(keys)) + 1e-5)
    spread = got.std(axis=0).mean() / original.std(axis=0).mean()
    assert 0.8 < spread < 1.25, spread

    loss = lambda m: jnp.sum(jnp.sin(m(x, x, x, key=one)))
    grads = eqx.filter_jit(eqx.filter_grad(loss))(split)
    for proj in (grads.query_proj, grads.key_proj, grads.value_proj, grads.output_proj):
        assert np.all(np.isfinite(proj.weight)) and np.any(proj.weight != 0)


BAD = {
    "axis": (
        dict(axis="seq"),
        ValueError,
        r"axis='seq'.*not an axis of the mesh given.*\('context',\)",
    ),
    "strategy": (
        dict(strategy="tree"),
        ValueError,
        r"strategy=.*must be one of 'ring'.*got 'tree'",
    ),
    "axis type": (dict(axis=1), TypeError, r"axis=.*must be a mesh axis name"),
    "causal": (dict(causal=1), TypeError, r"causal=.*must be a bool"),
    "mesh": (dict(mesh="context"), TypeError, r"mesh=.*must be a `jax.sharding.Mesh`"),
    "heads_axis": (dict(heads_axis=1), TypeError, r"heads_axis=.*must be a mesh axis name"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_a_clear_error(name: str):
    options, error, match = BAD[name]
    attention = eqx.nn.MultiheadAttention(HEADS, E, key=jax.random.key(0))
    options = {"mesh": make_mesh("auto", (4,), ("context",)), **options}
    with pytest.raises(error, match=match):
        eqxshard.context_parallel(attention, **options)


def test_an_axis_the_set_mesh_lacks_is_a_clear_error():
    attention = eqx.nn.MultiheadAttention(HEADS, E, key=jax.random.key(0))
    with jax.set_mesh(make_mesh("auto", (4,), ("data",))):
        with pytest.raises(ValueError, match=r"not an axis of the mesh set by `jax.set_mesh`"):
            eqxshard.context_parallel(attention)


def test_a_batched_call_is_a_clear_error():
    mesh = make_mesh("auto", (4,), ("context",))
    attention = eqx.nn.MultiheadAttention(HEADS, E, key=jax.random.key(0))
    split = eqxshard.context_parallel(attention, mesh=mesh)
    x = jnp.zeros((2, T, E))
    with pytest.raises(ValueError, match=r"takes one example.*under `jax.vmap`"):
        split(x, x, x)
