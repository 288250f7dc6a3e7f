"""Data-parallel training of an Equinox MLP with eqxshard.

Every device holds a full copy of the model and the optimiser state (replicated) and
one slice of each batch (sharded along the mesh axis "data"). JAX inserts the gradient
all-reduce by itself: the only sharding code is the four `eqxshard` calls below.

    python examples/train_data_parallel.py
"""

import os
import sys

import jax

# A demo on one CPU: split it into 8 devices (JAX_NUM_CPU_DEVICES=n for another count).
# This must run before JAX starts its backends. GPUs and TPUs are not affected: the
# script uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

STEPS, BATCH, LEARNING_RATE, PRINT_EVERY = 150, 256, 5e-3, 25

# EQXSHARD_EXAMPLE_STEPS=n runs n steps instead (the tests use a few, on 1, 2 and 8
# devices); the learning check needs the full run.
FULL_STEPS = STEPS
STEPS = int(os.environ.get("EQXSHARD_EXAMPLE_STEPS", STEPS))


def make_dataset(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic regression problem: y = sin(x . w) + noise, as host NumPy arrays."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8, 1)).astype(np.float32) / np.sqrt(8)
    y = np.sin(2 * x @ w) + 0.05 * rng.normal(size=(n, 1)).astype(np.float32)
    return x, y


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    prediction = jax.vmap(model)(x)
    return jnp.mean((prediction - y) ** 2)


def main() -> int:
    # One mesh axis over every device, with Auto axes: most Equinox models are written for
    # them (`jax.make_mesh`'s default since jax 0.9, Explicit axes, makes JAX ask an
    # `Embedding` lookup or a `Conv` for `out_sharding=`). eqxshard handles both.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    print(f"{jax.device_count()} devices, mesh {dict(mesh.shape)}")

    model = eqx.nn.MLP(8, 1, 64, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    optimiser = optax.adam(LEARNING_RATE)
    # The model and the optimiser state: a full copy on every device. Only the arrays of
    # the model go to `optimiser.init`; the activation function is not an array.
    model = eqxshard.filter_replicate(model, mesh)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_array))
    opt_state = eqxshard.filter_replicate(opt_state, mesh)

    # `eqx.filter_jit` plus the step's layouts and donation: the batch split over "data"
    # (so each device computes the loss and gradient of its own rows), the old model and
    # state donated (their buffers reused for the new ones), the batch kept.
    @eqxshard.filter_jit(
        in_shardings=(None, None, P("data"), P("data")),
        donate=(True, True, False, False),
        mesh=mesh,
    )
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    x_all, y_all = make_dataset(max(STEPS // 4, 1) * BATCH)
    batches_per_epoch = len(x_all) // BATCH
    losses = []
    for step in range(STEPS):
        start = (step % batches_per_epoch) * BATCH
        batch = (x_all[start : start + BATCH], y_all[start : start + BATCH])
        # Host NumPy -> devices: each device receives its own BATCH / device_count rows.
        x, y = eqxshard.filter_shard(batch, mesh, P("data"))
        model, opt_state, loss = train_step(model, opt_state, x, y)
        losses.append(float(loss))
        if step == 0:
            assert isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
            rows = x.addressable_shards[0].data.shape
            print(f"batch {x.shape} laid out as {x.sharding.spec}: each device holds {rows}")
        if (step + 1) % PRINT_EVERY == 0:
            mean = sum(losses[-PRINT_EVERY:]) / PRINT_EVERY
            print(f"steps {step + 2 - PRINT_EVERY:3d}-{step + 1:3d}  mean loss {mean:.4f}")

    first, final = losses[0], losses[-1]
    if STEPS < FULL_STEPS:
        print(f"learning check skipped: {STEPS} of {FULL_STEPS} steps; final loss {final:.4f}")
        return 0
    if not final < first / 10:
        print(f"FAILED: final loss {final:.4f} is not below first loss {first:.4f} / 10")
        return 1
    print(f"final loss {final:.4f} < first loss {first:.4f} / 10")
    return 0


if __name__ == "__main__":
    sys.exit(main())
