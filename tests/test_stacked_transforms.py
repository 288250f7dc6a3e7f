"""A pipelined `Stacked` reached through other transformations: nested `jax.vmap` pipelines
the inner batch; `jax.checkpoint`, `jax.jit` or a `lax.scan` body inside `jax.vmap` (where
the stack sees one example and no batch) is a named error, not a silent per-example
"pipeline"; `jax.jit` on a stack whose blocks hold numbers (non-array leaves that become
0-d tracers) runs, shared by every layer."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxshard
from eqxshard import Stacked
from eqxshard._pipeline.stacked.batching import batching_of

D = 8


class Block(eqx.Module):
    """A residual block with a number, `scale`: a non-array leaf shared by every layer."""

    w: jax.Array
    scale: float

    def __init__(self, key):
        self.w = jax.random.normal(key, (D, D)) / np.sqrt(D)
        self.scale = 0.5

    def __call__(self, h):
        return h + self.scale * jnp.tanh(h @ self.w)


def stacks():
    blocks = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 8))
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    return Stacked(blocks, axis="stage", microbatches=4, mesh=mesh), Stacked(blocks)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


X = jax.random.normal(jax.random.key(1), (8, 3, D))


def test_nested_vmap_pipelines_the_inner_batch():
    piped, plain = stacks()
    run = jax.jit(lambda s, x: jax.vmap(jax.vmap(s))(x))
    x = X.reshape(2, 4, 3, D)
    # The inner batch of 4 in 4 microbatches: rows of 1, which 'data' (2) cannot split.
    with pytest.warns(eqxshard.FallbackWarning, match=r"microbatches of 1 rows"):
        close(run(piped, x), run(plain, x))
    assert "collective_permute" in run.lower(piped, x).as_text()


@pytest.mark.parametrize(
    "through",
    [
        lambda s, h: eqx.filter_checkpoint(s)(h),
        lambda s, h: jax.jit(lambda h: s(h))(h),
        lambda s, h: jax.lax.scan(lambda c, _: (s(c), None), h, None, length=1)[0],
    ],
    ids=["checkpoint", "jit", "scan"],
)
def test_a_transformation_that_traces_it_inside_vmap_is_a_named_error(through):
    piped, plain = stacks()
    expected = jax.vmap(lambda h: through(plain, h))(X)  # the plain scan: no batch needed
    close(expected, jax.vmap(plain)(X))
    with pytest.raises(ValueError, match=r"traces it on its own .* inside `jax.vmap`"):
        jax.vmap(lambda h: through(piped, h))(X)
    # Outside the vmap, the same transformation pipelines.
    close(through(piped, X), expected)


def test_batching_of_sees_a_vmap_beyond_a_staged_trace():
    states = []
    record = lambda h: states.append(batching_of(h)) or h  # noqa: E731
    jax.vmap(lambda h: jax.jit(record)(h))(jnp.ones((2, 3)))
    jax.vmap(lambda h: jax.checkpoint(record)(h))(jnp.ones((2, 3)))
    jax.jit(lambda h: jax.vmap(record)(h))(jnp.ones((2, 3)))
    jax.jit(lambda h: record(h))(jnp.ones(4))
    assert states == ["staged", "staged", "innermost", "none"]


def _vmapped(s, x):
    return jax.vmap(s)(x)


def _loss(s, x):
    return jnp.sum(jax.vmap(s)(x) ** 2)


# The references (`scale` stays a float): module-wide, compiled once for both cases.
_REFERENCE = eqx.filter_jit(_vmapped)
_REFERENCE_GRAD = eqx.filter_jit(eqx.filter_grad(_loss))


@pytest.mark.parametrize("pipelined", [False, True])
def test_jax_jit_on_a_stack_whose_blocks_hold_numbers(pipelined):
    piped, plain = stacks()
    stack = piped if pipelined else plain
    expected = _REFERENCE(plain, X)
    close(jax.jit(_vmapped)(stack, X), expected)
    close(jax.jit(lambda s, x: s(x))(stack, X), expected)  # on a batch
    grads = jax.jit(jax.grad(_loss))(stack, X)
    grads_ref = _REFERENCE_GRAD(plain, X)
    close(grads.blocks.w, grads_ref.blocks.w)
