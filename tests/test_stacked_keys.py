"""`Stacked.__call__(h, key=...)`: one key split into a key per layer and passed to blocks
that take one (dropout here), against a hand-written loop that gives layer `i` the key
`jax.random.split(key, n)[i]`: the plain scan, its remat, and the pipeline (per example
under `jax.vmap`, with a key per example or one shared key, and on a batch)."""

from __future__ import annotations

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxshard import Stacked
from eqxshard._pipeline.stacked.keys import takes_key

D = 8
N = 8


class DropBlock(eqx.Module):
    """A residual block with dropout; works on one example `(T, D)` or a batch."""

    w: jax.Array
    drop: eqx.nn.Dropout

    def __init__(self, key):
        self.w = jax.random.normal(key, (D, D)) / np.sqrt(D)
        self.drop = eqx.nn.Dropout(0.5)

    def __call__(self, h, *, key=None):
        return h + self.drop(jnp.tanh(h @ self.w), key=key)


def blocks(n=N):
    """The first `n` of the 8 blocks: sliced, so that every layer count shares one compiled
    initialisation (each new count would compile JAX's random numbers again)."""
    made = eqx.filter_vmap(DropBlock)(jax.random.split(jax.random.key(0), N))
    return jax.tree.map(lambda a: a[:n] if eqx.is_array(a) else a, made)


def loop(layers, h, key):
    for layer, k in zip(layers, jax.random.split(key, len(layers)), strict=True):
        h = layer(h, key=k)
    return h


def call(stack, h, key):
    return stack(h, key=key)


def scan_loss(model, run, x, keys):
    return jnp.sum(jax.vmap(lambda h, k: run(model, h, k))(x, keys) ** 2)


def pipeline_loss(model, run, x, keys, shared):
    axes = (0, None) if shared else (0, 0)
    return jnp.mean(jax.vmap(lambda h, k: run(model, h, k), axes)(x, keys) ** 2)


# Module-wide: the loop's reference is compiled once for the cases that share it.
SCAN_GRAD = eqx.filter_jit(eqx.filter_value_and_grad(scan_loss))
GRAD = eqx.filter_jit(eqx.filter_value_and_grad(pipeline_loss))
CALL = eqx.filter_jit(call)
LOOP = eqx.filter_jit(loop)


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-5)


def test_which_blocks_take_a_key():
    assert takes_key(DropBlock(jax.random.key(0)))
    assert takes_key(lambda h, **kwargs: h)
    assert not takes_key(lambda h: h)
    assert not takes_key(jnp.ones(3))
    assert takes_key(eqx.nn.Lambda(jax.nn.relu))  # `eqx.nn` layers take `key=`
    assert not takes_key(jax.nn.relu)


# The plain scan: 4 layers (a key each; the depth is not the point), the loop's value and
# gradients computed once for both remat policies.
SCAN_N = 4


@pytest.fixture(scope="module")
def scan_case():
    x = jax.random.normal(jax.random.key(1), (4, 3, D))
    keys = jax.random.split(jax.random.key(2), 4)
    layers = Stacked(blocks(SCAN_N)).to_layers()
    return x, keys, layers, SCAN_GRAD(layers, loop, x, keys)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_scan_gives_each_layer_the_loop_s_key(remat, scan_case):
    x, keys, layers, (value_ref, g_ref) = scan_case
    stack = Stacked(blocks(SCAN_N), remat=remat)
    value, g = SCAN_GRAD(stack, call, x, keys)
    close(value, value_ref)
    close(g.to_layers(), g_ref)
    # Dropout ran: other keys, other values. (Under `jit`: eagerly each layer's ops dispatch
    # one by one.)
    assert not np.allclose(CALL(stack, x[0], keys[0]), CALL(stack, x[0], keys[1]))
    # A raw `jax.random.PRNGKey` works as well.
    raw = jax.random.PRNGKey(3)
    close(CALL(stack, x[0], raw), LOOP(layers, x[0], raw))


@pytest.mark.parametrize(
    ("repeats", "shared"), [(1, False), pytest.param(2, True, marks=pytest.mark.heavy)]
)
def test_the_pipeline_under_vmap_gives_each_layer_the_loop_s_key(repeats, shared):
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    options: dict[str, Any] = dict(axis="stage", microbatches=4, repeats=repeats, mesh=mesh)
    stack = Stacked(blocks(), remat="dots", **options)
    layers = Stacked(blocks()).to_layers()
    x = jax.random.normal(jax.random.key(1), (8, 3, D))
    # A key per example, or one key shared by every example (the same masks in each).
    keys = jax.random.key(2) if shared else jax.random.split(jax.random.key(2), 8)
    value, g = GRAD(stack, call, x, keys, shared)
    value_ref, g_ref = GRAD(layers, loop, x, keys, shared)
    close(value, value_ref)
    close(eqx.tree_at(lambda s: s.blocks, stack, g.blocks).to_layers(), g_ref)
    # The pipeline is in the program (of the gradient step just compiled: traced once).
    lowered = cast(Any, GRAD).lower(stack, call, x, keys, shared)  # typed as the function
    assert "collective_permute" in lowered.as_text()


def test_the_pipeline_on_a_batch_gives_each_microbatch_its_own_key():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    stack = Stacked(blocks(), axis="stage", microbatches=4, mesh=mesh)
    layers = Stacked(blocks()).to_layers()
    x = jax.random.normal(jax.random.key(1), (8, 3, D))
    key = jax.random.key(2)
    out = eqx.filter_jit(lambda s, x, k: s(x, key=k))(stack, x, key)
    for m in range(4):  # microbatch m: rows m, m+4, with the key fold_in(key, m)
        close(out[m::4], loop(layers, x[m::4], jax.random.fold_in(key, m)))
