"""Jacobians of a linear-recurrence (S5-style) layer that do not fit a memory budget at once.

The model of jax-ml/jax#19498: `x_t = lambda * x_{t-1} + W u_t + b`, run with
`lax.associative_scan`. We want, for a batch of sequences, the Jacobian of the final
state w.r.t. the scan parameter `lambda`, the dense weight, the input sequence and the
initial state (reverse mode: one row per state entry, 64 rows).

`jax.jacrev` pulls all 64 rows back at once. Here the unchunked Jacobian needs more
temporaries than the (pretend) budget, set from figures measured on this device (between
what one row at a time and all rows at once need), so `eqxshard.filter_jacrev(batch_size="auto",
memory_budget=...)` picks a chunk of rows that fits, and the result is checked
against `jax.jacrev`. Finally the rows are split over every device (`mesh=`).

    python examples/jacobian_scan.py
"""

import os

import jax

# A demo on one CPU: split it into 8 devices (JAX_NUM_CPU_DEVICES=n for another count),
# before JAX starts its backends. GPUs and TPUs are not affected: every device is used.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import eqxshard  # noqa: E402

STATE, T, BATCH = 64, 32, 2


def binary_operator(element_i, element_j):
    a_i, bu_i = element_i
    a_j, bu_j = element_j
    return a_j * a_i, a_j * bu_i + bu_j


def layer(params, inputs, init_state):
    """Final state of the recurrence over `inputs` (T, STATE)."""
    x = inputs @ params["weight"].T + params["bias"]
    lam = jnp.repeat(params["lambda"][None], T + 1, axis=0)
    elements = (lam, jnp.concatenate([init_state[None], x]))
    _, ys = jax.lax.associative_scan(binary_operator, elements, axis=0)
    return ys[-1]


def model(a):
    return layer(*a)


def batched(jac):
    """The Jacobians w.r.t. the parameters (lambda, weight, bias), the input and the
    initial state, for every sequence of the batch (as in the seed: `jit(vmap(jac))`)."""
    return jax.jit(jax.vmap(lambda *a: jac(a), in_axes=(None, 0, 0)))


def compiled(fn, *args):
    return fn.lower(*args).compile()


keys = jax.random.split(jax.random.key(0), 4)
params = {
    "lambda": jax.random.uniform(keys[0], (STATE,)),
    "weight": jax.random.normal(keys[1], (STATE, STATE)) / 8,
    "bias": jax.random.normal(keys[2], (STATE,)),
}
inputs = jax.random.normal(keys[3], (BATCH, T, STATE))
init_state = jnp.ones((BATCH, STATE))
args = (params, inputs, init_state)


def temporaries(fn):
    return fn.memory_analysis().temp_size_in_bytes


def matmul_rtol():
    """A tolerance for float32 results here: 1e-3, or more where the platform's default
    matmul precision is lower (TF32 on recent NVIDIA GPUs), from one measured product."""
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    default = np.asarray(jnp.dot(a, a))
    with jax.default_matmul_precision("highest"):
        exact = np.asarray(jnp.dot(a, a))
    return max(1e-3, 10 * float(np.max(np.abs(default - exact)) / np.max(np.abs(exact))))


reference = compiled(batched(jax.jacrev(model)), *args)
unchunked = temporaries(reference)
# The budget comes from this device's own figures: a quarter of the unchunked temporaries,
# but never below what pulling back one row at a time needs here (compilers differ).
one_row = temporaries(compiled(batched(eqxshard.filter_jacrev(model, batch_size=1)), *args))
budget = max(unchunked // 4, one_row + (unchunked - one_row) // 8)
print(f"T = {T}, batch {BATCH}: jax.jacrev needs {unchunked:,} bytes of temporaries")
print(f"one row at a time needs {one_row:,}; budget: {budget:,} bytes per device")
assert one_row <= budget < unchunked, "chunking the rows saves no memory on this device"
rtol = matmul_rtol()

# "auto" measures the program it is compiled into: under `jit(vmap(jac))`, the batched one.
jac = eqxshard.filter_jacrev(model, batch_size="auto", memory_budget=budget)
chunked = compiled(batched(jac), *args)
analysis = chunked.memory_analysis()
assert analysis is not None
temps = analysis.temp_size_in_bytes
(rows,) = jac.auto.cache.values()  # pyright: ignore[reportFunctionMemberAccess]
print(f"filter_jacrev(batch_size='auto'): {rows} rows at a time, {temps:,} bytes")
print(f"<= budget: {temps <= budget}")
assert temps <= budget

jacs, expected = chunked(*args), reference(*args)
jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol), jacs, expected)
print(
    "equal to jax.jacrev; d state / d lambda:",
    jacs[0]["lambda"].shape,
    "d state / d input:",
    jacs[1].shape,
)

# Rows split over every device: each pulls back its own rows, no communication.
devices = jax.device_count()
mesh = jax.make_mesh((devices,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
sharded = compiled(batched(eqxshard.filter_jacrev(model, batch_size=devices, mesh=mesh)), *args)
d_input = sharded(*args)[1]
np.testing.assert_allclose(d_input, expected[1], rtol=rtol, atol=rtol)
hlo = sharded.as_text()
assert hlo is not None
gathers = "all-gather" in hlo
print(f"sharded over {devices} devices:", d_input.sharding.spec, "all-gather in HLO:", gathers)
