"""Multi-host training of an Equinox MLP with optax: the same script on a laptop and a cluster.

Each process reads only its own rows of every batch, and `filter_shard(...,
process_local=True)` makes the global batch from them. Process 0 logs the global loss.
Checkpoints are sharded (each process writes its own shards), and `--resume` continues
from the newest one with the same results as a run that never stopped: the data of step
`s` depends on `s` only, never on what ran before.

    # one process (8 CPU devices on a laptop; every device of a GPU/TPU machine)
    python examples/train_multihost.py
    # two processes with 4 CPU devices each, on this machine
    python -m eqxshard.launch -n 2 --devices-per-process 4 -- examples/train_multihost.py
    # a cluster: one process per task; JAX reads Slurm's / Open MPI's / Kubernetes' variables
    srun --ntasks=16 python examples/train_multihost.py --checkpoint-dir /shared/run
    # carry on from the newest checkpoint after a failure
    python -m eqxshard.launch -n 2 --devices-per-process 4 -- examples/train_multihost.py \\
        --checkpoint-dir /tmp/run --resume
"""

import argparse
import hashlib
import os
import sys

import jax

# A demo started by hand on one CPU: split it into 8 devices. `python -m eqxshard.launch`
# sets the count per process itself (JAX_NUM_CPU_DEVICES); accelerators are not affected.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

FEATURES, WIDTH, DEPTH, SEED = 8, 32, 2, 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=5e-3)
    parser.add_argument("--fsdp", action="store_true", help="shard parameters (else replicate)")
    parser.add_argument("--checkpoint-dir", default=None, help="no checkpoints if not given")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    parser.add_argument("--log-every", type=int, default=10, help="1 logs every step")
    parser.add_argument("--expect-processes", type=int, default=None)
    parser.add_argument("--expect-devices", type=int, default=None)
    parser.add_argument("--platform", default=None, help="expected platform: cpu, gpu, tpu")
    parser.add_argument(
        "--heartbeat-timeout", type=int, default=None, help="seconds (JAX's default: 100)"
    )
    parser.add_argument("--die-at-step", type=int, default=None, help="fault injection")
    parser.add_argument("--die-process", type=int, default=1, help="the process that dies")
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def read_rows(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows `start:stop` of an endless regression data set, y = sin(2 x . w) + noise.

    A stand-in for reading a slice of a data set on disk: row `r` depends on `r` only,
    so each process reads just its own rows, and a resumed run reads the same rows.
    """
    w = np.random.default_rng(SEED).normal(size=(FEATURES, 1)) / np.sqrt(FEATURES)
    xs, ys = [], []
    for row in range(start, stop):
        rng = np.random.default_rng((SEED, row))
        x = rng.normal(size=FEATURES)
        xs.append(x)
        ys.append(np.sin(2 * x @ w) + 0.05 * rng.normal(size=1))
    return np.asarray(xs, np.float32), np.asarray(ys, np.float32)


def local_batch(step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of the global batch of `step` (steps count from 1)."""
    per_process = batch_size // jax.process_count()
    start = (step - 1) * batch_size + jax.process_index() * per_process
    return read_rows(start, start + per_process)


def check_batch(batch_size: int) -> None:
    """Stops at start-up, on every process alike, where the global batch does not split
    evenly over this run's devices (e.g. after a restart on fewer hosts)."""
    devices, processes = jax.device_count(), jax.process_count()
    if batch_size % devices:
        raise SystemExit(
            f"--batch-size {batch_size} does not split over the {devices} devices of this "
            f"run ({processes} process{'es' if processes != 1 else ''} x "
            f"{jax.local_device_count()} devices): "
            f"{batch_size} % {devices} = {batch_size % devices}. Give a multiple of "
            f"{devices} (e.g. {batch_size - batch_size % devices or devices}); for a run "
            "that may go on with fewer hosts (`--min-hosts`), one that every device count "
            "it may shrink to divides (48 divides 8, 6 and 4)."
        )


def make_model(key: jax.Array) -> eqx.nn.MLP:
    return eqx.nn.MLP(FEATURES, 1, WIDTH, DEPTH, activation=jax.nn.gelu, key=key)


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def fingerprint(tree) -> str:
    """A hash of every array leaf's bytes: equal hashes, bit-identical parameters."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(eqxshard.filter_get(eqx.filter(tree, eqx.is_array))):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Join the run: the launcher's variables, a cluster JAX detects, or a single process.
    how = eqxshard.initialize(heartbeat_timeout_seconds=args.heartbeat_timeout)
    # Fail here, not after an hour of training on the wrong devices.
    report = eqxshard.check_setup(
        processes=args.expect_processes, devices=args.expect_devices, platform=args.platform
    )
    is_logger = jax.process_index() == 0
    log = print if is_logger else (lambda *a, **k: None)
    log(f"joined by {how}: {report}")
    # The global batch stays the same whatever the run's size (a run restarted on fewer
    # hosts gives each process more rows), so it must split evenly over every device.
    check_batch(args.batch_size)

    # One axis over every device of every process. Auto axes: XLA inserts the gradient
    # all-reduce (and, with --fsdp, the parameter all-gathers) by itself.
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    # Replicated parameters (data parallel), or each large leaf split over "data" (FSDP).
    rule = eqxshard.fsdp("data", min_size=256) if args.fsdp else P()
    optimiser = optax.adam(args.learning_rate)

    # Created in place: with --fsdp, no device ever holds a whole parameter.
    model = eqxshard.filter_init(make_model, mesh, rule)(jax.random.key(SEED))
    params = eqx.filter(model, eqx.is_array)
    opt_state = eqxshard.filter_init(optimiser.init, mesh, eqxshard.like(params))(params)

    start = 0
    if args.resume and args.checkpoint_dir is not None:
        latest = eqxshard.latest_step(args.checkpoint_dir)
        if latest is not None:
            # Read into the layout of the freshly made state: each process its own shards.
            state = (model, opt_state)
            model, opt_state = eqxshard.filter_restore(args.checkpoint_dir, state, step=latest)
            start = latest
            log(f"resumed from the checkpoint of step {start}")
            if start >= args.steps:
                log(
                    f"nothing left to do: the checkpoint of step {start} is at or past "
                    f"--steps {args.steps} (raise --steps to train on)"
                )
        else:
            log(f"--resume: no checkpoint in {args.checkpoint_dir} yet, starting at step 0")

    # The parameters and the state stay in their planned layout, the loss replicated.
    # (Nothing donated: a background checkpoint save may still read the old arrays.)
    @eqxshard.filter_jit(out_shardings=(rule, eqxshard.like(params), P()), mesh=mesh)
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    first = None
    loss = None
    for step in range(start + 1, args.steps + 1):
        if step == args.die_at_step and jax.process_index() == args.die_process:
            print(f"process {args.die_process} dies at step {step}", flush=True)
            os._exit(1)  # a crash: no clean-up, no goodbye to the other processes
        # Each process passes only its own rows; together they make the global batch.
        x, y = eqxshard.filter_shard(
            local_batch(step, args.batch_size), mesh, P("data"), process_local=True
        )
        model, opt_state, loss = train_step(model, opt_state, x, y)
        loss = float(loss)  # the global mean loss, the same on every process
        first = loss if first is None else first
        if step % args.log_every == 0 or step == args.steps:
            log(f"step {step} loss {loss:.9g}", flush=True)
        if args.checkpoint_dir is not None and step % args.checkpoint_every == 0:
            eqxshard.filter_save(args.checkpoint_dir, step, (model, opt_state))
            log(f"saved the checkpoint of step {step}", flush=True)

    digest = fingerprint(model)  # a collective: every process takes part
    log(f"final parameters {digest}")
    if start == 0 and first is not None and loss is not None:  # a fresh run learned
        if not loss < first / 2:
            log(f"FAILED: final loss {loss:.4f} is not below half the first {first:.4f}")
            return 1
        log(f"final loss {loss:.4f} < first loss {first:.4f} / 2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
