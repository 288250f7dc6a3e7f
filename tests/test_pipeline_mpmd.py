"""`pipeline_value_and_grad`: the MPMD pipeline (each stage its own program on its own
sub-mesh) in the 1F1B and GPipe orders. Its value and gradients against
`jax.value_and_grad` of `jax.lax.scan` over the same layers, its programs compiled once per
stage and kind, the residuals each stage holds (at most S microbatches' under 1F1B, M under
GPipe), the order itself, and its errors."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
from tiny_stack import D, N, blocks as _blocks, layer as _layer

import eqxshard
from eqxshard._pipeline.bubble import bubble_fraction
from eqxshard._pipeline.mpmd import programs, ticks


def _x(batch=16, seed=2):
    return jax.random.normal(jax.random.key(seed), (batch, D))


def _targets(batch=16):
    return jax.random.normal(jax.random.key(3), (batch, D))


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _scan(blocks, x, layer=_layer):
    return jax.lax.scan(lambda h, b: (layer(b, h), None), x, blocks)[0]


def _close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def expected():
    """`jax.value_and_grad` of the scan's loss (for the blocks and x), computed once for every
    mesh and schedule."""
    loss = lambda blocks, x: _mse(_scan(blocks, x), _targets())  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(_blocks(), _x())


# (mesh kind, shape, names, the spec of x's batch, the stack's spec inside a stage)
CASES = [
    ("auto", (2, 4), ("data", "stage"), P("data"), None),
    ("explicit", (4,), ("stage",), P(), None),
    ("mixed", (4, 2), ("stage", "model"), P(), "model"),
]


@pytest.mark.parametrize(("kind", "shape", "names", "xspec", "inner"), CASES)
# GPipe's order once, in the tests part: the same programs as 1F1B's, run in another order.
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.heavy)])
def test_value_and_gradients_match_scan(kind, shape, names, xspec, inner, schedule, expected):
    mesh = make_mesh(kind, shape=shape, names=names)
    over = (lambda path, a: P(None, inner) if a.ndim == 2 else P(inner)) if inner else None
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages(inner=over))
    x = eqxshard.filter_shard(_x(), mesh, xspec)
    value, (grad_blocks, grad_x) = eqxshard.pipeline_value_and_grad(
        _layer, blocks, x, _mse, targets=_targets(), mesh=mesh, microbatches=4, schedule=schedule
    )
    _close((value, (grad_blocks, grad_x)), expected)
    # Gradients come back laid out as their arguments: the stack over the stages, x as x.
    for g, w in zip(jax.tree.leaves(grad_blocks), jax.tree.leaves(blocks), strict=True):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
    assert grad_x.sharding.is_equivalent_to(x.sharding, 2)


def test_equinox_blocks_pytree_input_remat_an_unplaced_stack_and_the_mesh_set():
    mesh = make_mesh("auto", shape=(2, 4), names=("data", "stage"))
    keys = jax.random.split(jax.random.key(3), N)
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(keys)  # not laid out yet
    x = {"a": _x(), "b": _x(seed=5)}

    def layer(block, h):  # non-array leaves of a block, and h a dict
        return {"a": jnp.tanh(jax.vmap(block)(h["a"])) + h["b"], "b": h["b"] * 0.5}

    def loss(y):
        return jnp.mean(y["a"] ** 2) + jnp.mean(jnp.sin(y["b"]))

    def reference(blocks, x):
        arrays, static = eqx.partition(blocks, eqx.is_array)
        return loss(_scan(arrays, x, lambda b, h: layer(eqx.combine(b, static), h)))

    expected = eqx.filter_value_and_grad(reference)(blocks, x)
    with jax.set_mesh(mesh):  # the mesh in context; each stage's program runs on its own
        value, (grads, _) = eqxshard.pipeline_value_and_grad(
            layer, blocks, x, loss, microbatches=8, remat="full"
        )
    _close((value, grads), expected)
    assert grads.weight.sharding.spec[0] == "stage"  # laid out over the stages first


_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration_secs, **kwargs: (
        _COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
)


def test_each_stage_compiles_its_forward_and_backward_once():
    mesh = make_mesh("auto", shape=(2, 4), names=("data", "stage"))
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages())
    traces = []

    def layer(block, h):
        traces.append(None)
        return _layer(block, h)

    def loss(y):  # one function for every step: a new one is a new program, as in `jit`
        return jnp.mean(y**2)

    def step(seed):
        x = eqxshard.filter_shard(_x(seed=seed), mesh, P("data"))
        return eqxshard.pipeline_value_and_grad(layer, blocks, x, loss, mesh=mesh, microbatches=8)

    del _COMPILES[:]
    step(0)
    # The forwards trace the layer (a scan traces its body once) at most once per stage (the
    # stages but the last share a trace where JAX keys it by shapes only), whatever M is.
    assert 2 <= len(traces) <= 4, len(traces)
    first = len(_COMPILES)
    print(first)
    # 4 forwards + 4 backwards, the cut of x, the join of its gradient, the sum of the
    # losses, and a few placement helpers: far fewer than the 2*M*S forwards and backwards.
    assert 2 * 4 <= first <= 2 * 4 + 6, first
    traces.clear()
    del _COMPILES[:]
    value = step(1)[0]
    assert not traces and not _COMPILES, (len(traces), _COMPILES)
    assert np.isfinite(float(value))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_residuals_held_per_stage_are_bounded_by_the_stages_not_the_microbatches(schedule):
    S, M = 4, 8
    mesh = make_mesh("auto", shape=(2, S), names=("data", "stage"))
    blocks = eqxshard.filter_shard(_blocks(), mesh, eqxshard.stages())
    x = eqxshard.filter_shard(_x(32), mesh, P("data"))
    counts, sizes = [], []
    eqxshard.pipeline_value_and_grad(
        _layer,
        blocks,
        x,
        lambda y: jnp.mean(y**2),
        mesh=mesh,
        microbatches=M,
        schedule=schedule,
        on_tick=lambda c, b: (counts.append(c), sizes.append(b)),
    )
    peaks = [max(c[s] for c in counts) for s in range(S)]
    byte_peaks = [max(b[s] for b in sizes) for s in range(S)]
    assert counts[-1] == [0] * S  # every residual released after its backward
    if schedule == "1f1b":
        assert peaks == [S - s for s in range(S)]  # stage s: its S-s-1 warm-ups, plus one
    else:
        assert peaks == [M] * S
    assert peaks == ticks.held(schedule, S, M)
    # The bytes follow the count: a microbatch's residuals weigh the same on every stage but
    # the last (which keeps its loss's too).
    per = byte_peaks[0] // peaks[0]
    assert per > 0 and byte_peaks[:-1] == [per * p for p in peaks[:-1]]


def test_residuals_are_activations_not_copies_of_the_weights():
    weights, static = eqx.partition(_blocks(2), eqx.is_array)
    h = _x(6)
    out, kept, how = programs.forward(_layer, static, "none", weights, h)
    _close(out, _scan(weights, h))
    # `jax.vjp` keeps the weights for the backward; the forward hands them back as indices
    # (the backward is given the weights again), so what the driver holds per microbatch
    # is activations only: (layers, rows, features).
    assert kept and all(a.shape[:2] == (2, 6) for a in kept), [a.shape for a in kept]
    assert 1 in how[1]  # leaf 1 (`w`; `b` sorts first), which the pullback keeps


@pytest.mark.parametrize(("S", "M"), [(1, 1), (2, 2), (4, 4), (4, 9), (3, 5)])
@pytest.mark.parametrize("schedule", ticks.SCHEDULES)
def test_ticks_run_every_item_once_after_its_inputs(S, M, schedule):
    done = {}
    for t, tick in enumerate(ticks.ticks(schedule, S, M)):
        assert len({s for s, _, _ in tick}) == len(tick)  # a stage runs one item per tick
        for s, kind, m in tick:
            assert (s, kind, m) not in done
            if kind == "F" and s > 0:
                assert done[(s - 1, "F", m)] < t
            if kind == "B":
                assert done[(s, "F", m)] < t
                assert s == S - 1 or done[(s + 1, "B", m)] < t
        done.update({item: t for item in tick})
    assert len(done) == 2 * S * M
    expected = [min(S - s, M) for s in range(S)] if schedule == "1f1b" else [M] * S
    assert ticks.held(schedule, S, M) == expected


@pytest.mark.parametrize(("S", "M"), [(1, 1), (2, 2), (4, 4), (4, 9), (3, 5), (8, 3)])
@pytest.mark.parametrize("schedule", ticks.SCHEDULES)
def test_each_stage_idles_the_bubble_fraction_of_the_ticks(S, M, schedule):
    # A stage works 2M of the ticks (a forward and a backward per microbatch), and idles
    # the rest: the bubble `filter_pipeline`'s checks and `auto_plan` reckon with.
    idle = 1 - 2 * M / len(ticks.ticks(schedule, S, M))
    assert idle == pytest.approx(bubble_fraction(S, M))


# ---- errors ------------------------------------------------------------------------------


def _mesh():
    return make_mesh("auto", shape=(2, 4), names=("data", "stage"))


def _call(**overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        layer=_layer, blocks=_blocks(), x=_x(), loss=lambda y: jnp.mean(y), microbatches=4
    )
    kwargs.update(overrides)
    kwargs.setdefault("mesh", _mesh())
    layer, blocks, x, loss = (kwargs.pop(k) for k in ("layer", "blocks", "x", "loss"))
    return eqxshard.pipeline_value_and_grad(layer, blocks, x, loss, **kwargs)


def test_errors_of_its_own_arguments():
    with pytest.raises(TypeError, match=r"`loss` to be a callable.*got int"):
        _call(loss=3)
    with pytest.raises(ValueError, match=r"schedule=\.\.\.\)` takes one of '1f1b', 'gpipe'"):
        _call(schedule="zb")
    with pytest.raises(TypeError, match=r"on_tick=\.\.\.\)` takes `None` or a callable.*got str"):
        _call(on_tick="print")
    abstract = AbstractMesh((2, 4), ("data", "stage"))
    with pytest.raises(ValueError, match=r"needs a `jax.sharding.Mesh` with devices.*AbstractMesh"):
        _call(mesh=abstract)
    with pytest.raises(
        ValueError, match=r"(?s)`targets` to have the batch.*\(16\).*\n  t.*shape \(8, 4\)"
    ):
        _call(targets={"t": _targets(8)}, loss=lambda y, t: jnp.mean(y - t["t"]))
    with pytest.raises(TypeError, match=r"(?s)`targets` to be an array.*\n  name.*str"):
        _call(targets={"name": "abc"})
    with pytest.raises(ValueError, match=r"`loss` to return a scalar.*returned shape \(4,\)"):
        _call(loss=lambda y: jnp.mean(y, axis=0))  # one value per feature, not a scalar


def test_traced_leaves_are_refused_naming_each():
    def inside(blocks, x):
        return _call(blocks=blocks, x=x)[0]

    with pytest.raises(ValueError, match=r"(?s)cannot run inside `jit`.*blocks\.w.*x"):
        jax.jit(inside)(_blocks(), _x())


def test_the_pipeline_checks_are_shared():
    with pytest.raises(ValueError, match="microbatches=2, fewer than the 4 stages"):
        _call(microbatches=2)
    with pytest.raises(ValueError, match="cannot split 6 layers"):
        _call(blocks=_blocks(6))
    with pytest.raises(ValueError, match=r"must name the mesh axis.*'pipe'"):
        _call(axis="pipe")
    with pytest.raises(ValueError, match="not divisible by 8"):
        x = jax.device_put(_x(12), NamedSharding(_mesh(), P("data")))
        _call(x=x)
    with pytest.raises(TypeError, match=r"`layer` to be a callable"):
        _call(layer=None)
