"""`context_parallel` on a model others wrote and published: esm2quinox's ESM2 (rotary
embeddings through `process_heads`, a padding mask broadcast to `(length, length)`, its
layers stacked by `eqx.filter_vmap` and run by `lax.scan`, its own `eqx.filter_jit`
inside). Converted and run on a `(data, context)` mesh, its outputs, gradients and a
training step under `eqxshard.filter_jit` equal the unconverted model's on one device."""

from __future__ import annotations

import equinox as eqx
import esm2quinox
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import make_mesh, trains_as_one_device
from jax.sharding import NamedSharding, PartitionSpec as P

import eqxshard
from eqxshard._sequence.parallel import ContextParallelAttention

LENGTH = 32
PAD = 1  # esm2quinox's token of ".", its padding
PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "SPIDERMAN", "MVLSEGEWQLVLHVWAKVEAD", "SP#DERM#N"]


def _model() -> esm2quinox.ESM2:
    return esm2quinox.ESM2(
        num_layers=2, embed_size=32, num_heads=4, token_dropout=True, key=jax.random.key(0)
    )


def _tokens() -> np.ndarray:
    return esm2quinox.tokenise(PROTEINS, length=LENGTH)


def _loss(model, tokens):
    """Masked-LM style: cross-entropy of each non-padding position's own token."""
    logits = jax.vmap(model)(tokens).logits
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    real = tokens != PAD
    return jnp.sum(jnp.where(real, losses, 0)) / jnp.sum(real)


def _allclose(got, want, tol=5e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def _split(model, mesh):
    split = eqxshard.context_parallel(model, mesh=mesh)
    assert isinstance(split.layers.attn, ContextParallelAttention)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(split)]
    assert paths == [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model)]
    return eqxshard.filter_replicate(split, mesh)


def test_esm2_outputs_and_gradients_equal_the_original_on_a_data_context_mesh():
    mesh = make_mesh("auto", (2, 4), ("data", "context"))
    model = _model()
    split = _split(model, mesh)
    tokens = _tokens()
    assert (tokens == PAD).any(), "the batch has padding"
    laid_out = jax.device_put(tokens, NamedSharding(mesh, P("data", "context")))
    forward = eqx.filter_jit(lambda model, tokens: jax.vmap(model)(tokens))
    got, want = forward(split, laid_out), jax.vmap(model)(tokens)
    _allclose((got.hidden, got.logits), (want.hidden, want.logits))
    assert tuple(got.logits.sharding.spec)[:2] == ("data", "context")  # the split kept
    value_and_grad = eqx.filter_value_and_grad(_loss)
    _allclose(eqx.filter_jit(value_and_grad)(split, laid_out), value_and_grad(model, tokens))


def test_an_esm2_training_step_equals_the_one_device_step():
    mesh = make_mesh("auto", (2, 4), ("data", "context"))
    optimiser = optax.adamw(1e-3)
    model = _model()
    split = _split(model, mesh)
    state = optimiser.init(eqx.filter(model, eqx.is_array))
    split_state = eqxshard.context_parallel(state, mesh=mesh)
    tokens = _tokens()
    laid_out = jax.device_put(tokens, NamedSharding(mesh, P("data", "context")))
    one, split_ = (model, state, tokens), (split, split_state, laid_out)
    trains_as_one_device(_loss, optimiser, one, split_, rtol=5e-5, atol=1e-4)
