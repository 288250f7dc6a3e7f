"""Jacobians of the associative-scan recurrence of jax-ml/jax#19498: time and temporaries.

Two tables from one run.

The first answers the seed's question, "what should a user do about the Jacobian w.r.t.
`lambda`": for each sequence length `T` and number of layers, the Jacobian w.r.t. every
`lambda` of the model as written (`lax.associative_scan` over `(lambda, B u)` pairs), of
the same model with the recurrence given its own tangent rule (`custom_jvp`: the tangent of
`h_t = lambda h_{t-1} + b_t` is the same recurrence over `dlambda h_{t-1} + db_t`, so
`lambda` is no longer carried through both halves of the scan operator), and (one layer)
of the diagonal from one `jax.jvp`, in time and temporaries against `jax.jac*` of the model
as written.

The second, for each `T`, number of layers, the quantity differentiated against (the scan
parameter `lambda`, the dense `weight`, the `input`, the initial `state`) and the mode
(rev/fwd): time and temporaries (bytes per device, `compiled.memory_analysis()`) of
`jax.jac*`, `eqx.filter_jac*` and `eqxshard.filter_jac*` at `batch_size` = all (`None`),
n/8 and "auto" (budget: 1/4 of `jax.jac*`'s temporaries), and the per-device temporaries
of n/8 over the D devices found (8 CPU devices on a CPU-only machine, `JAX_NUM_CPU_DEVICES`
for another count), split along the basis (`mesh=`) or along the batch of sequences
(the inputs sharded, `vmap` as before; `-` where D does not divide the batch of 16).
Ratios are against `jax.jac*` in the same run.

The workload is the seed's: state 64, batch 16 (`jit(vmap(jac))`), T in {64, 128, 256,
512}, 1 and 2 layers; the default run is trimmed to T = 64, one layer; `--full` runs all
of it. A program whose temporaries exceed `--cap-gib` is compiled (for its memory) but not
run: its time reads `no fit`. A program whose HLO equals `jax.jac*`'s is not timed again:
it reads `=`. Each time is the best of a few calls, as many as fit in `--seconds`.

    python benchmarks/jacobian.py [--full] [--lengths 64 128] [--layers 1 2] [--cap-gib 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time

import jax

# 8 CPU devices (JAX_NUM_CPU_DEVICES=n for another count), before JAX starts its
# backends. GPUs and TPUs are not affected: the benchmark uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

STATE, BATCH = 64, 16
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def binary_operator(element_i, element_j):
    a_i, bu_i = element_i
    a_j, bu_j = element_j
    return a_j * a_i, a_j * bu_i + bu_j


def scan(lam, b):
    """`h_t = lam * h_{t-1} + b_t` with `h_0 = b_0`, for every `t`, as in the seed."""
    lams = jnp.broadcast_to(lam, b.shape)
    return jax.lax.associative_scan(binary_operator, (lams, b))[1]


@jax.custom_jvp
def recurrence(lam, b):
    """`scan` with its own tangent rule: the tangent of a linear recurrence is the same
    recurrence (the same `lam`) over `dlam * h_{t-1} + db_t`, so `lam` is no longer
    differentiated through both halves of the scan operator."""
    return scan(lam, b)


@recurrence.defjvp
def _recurrence_jvp(primals, tangents):
    lam, b = primals
    dlam, db = tangents
    h = scan(lam, b)
    previous = jnp.concatenate([jnp.zeros_like(h[:1]), h[:-1]])
    return h, scan(lam, dlam * previous + db)


def model(params, inputs, state, layers, recur=scan):
    """Final state of `layers` stacked recurrences (the seed's one/two-layer models)."""
    x, final = inputs, None
    for i in range(layers):
        x = x @ params[f"weight{i}"].T + params[f"bias{i}"]
        lam = params[f"lambda{i}"]
        lams = jnp.repeat(lam[None], x.shape[0] + 1, axis=0)  # as the seed writes it
        ys = (
            scan(lams, jnp.concatenate([state[i][None], x]))
            if recur is scan
            else recur(lam, jnp.concatenate([state[i][None], x]))
        )
        final, x = ys[-1], ys[1:]
    return final


def quantity(name, layers, recur=scan):
    """(the function of one differentiated argument, how to get it from the full args)."""

    def f(diff, params, inputs, state):
        if name in ("lambda", "weight"):
            params = {**params, **diff}
        elif name == "input":
            inputs = diff
        else:
            state = diff
        return model(params, inputs, state, layers, recur)

    def pick(params, inputs, state):
        if name in ("lambda", "weight"):
            return {k: v for k, v in params.items() if k.startswith(name)}
        return inputs if name == "input" else state

    return f, pick


def basis_size(name, mode, layers, T):
    if mode == "rev":
        return STATE
    return {"lambda": STATE, "weight": STATE * STATE, "input": T * STATE, "state": STATE}[name] * (
        layers if name in ("lambda", "weight", "state") else 1
    )


def batched(jac, pick):
    def one(params, inputs, state):
        return jac(pick(params, inputs, state), params, inputs, state)

    return jax.jit(jax.vmap(one, in_axes=(None, 0, 1)))


def program_text(fn, args):
    """The lowered program without names or locations (equal text: the same program)."""
    text = fn.lower(*args).as_text()
    return re.sub(r"loc\([^)]*\)|#loc\d*", "", text)


class Runner:
    def __init__(self, cap_bytes, seconds, repeat):
        self.cap, self.seconds, self.repeat = cap_bytes, seconds, repeat

    def compile(self, fn, args):
        compiled = fn.lower(*args).compile()
        return compiled, compiled.memory_analysis().temp_size_in_bytes

    def time(self, compiled, temps, args):
        """Best of a few calls (as many as fit in `seconds`); `None` if it does not fit."""
        if temps > self.cap:
            return None
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = first = time.perf_counter() - start
        for _ in range(min(self.repeat, int(self.seconds / max(first, 1e-9)))):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            best = min(best, time.perf_counter() - start)
        return best

    def same_or_time(self, fn, args, reference, t_jax):
        """`=` if `fn` is the program of `reference`, else its time ratio; and its temporaries."""
        if program_text(fn, args) == reference:
            return f"{'=':>6}", None
        c, m = self.compile(fn, args)
        return ratio(self.time(c, m, args), t_jax), m


def ms(t):
    return "no fit" if t is None else f"{t * 1e3:.2f}"


def ratio(t, base, width=6):
    if t is None:
        return f"{'no fit':>{width}}"
    if base is None:
        return f"{'-':>{width}}"
    return f"{t / base:>{width}.2f}"


def error(compiled, t, args, expected):
    """Largest difference to `expected` (the Jacobian as written), relative to its largest
    entry; `-` when either was not run."""
    if t is None or expected is None:
        return "-"
    pairs = zip(jax.tree.leaves(compiled(*args)), jax.tree.leaves(expected), strict=True)
    worst = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)
    return f"{worst:.1e}"


def make_args(T, layers):
    keys = jax.random.split(jax.random.key(0), 8)
    params = {}
    for i in range(layers):
        params[f"weight{i}"] = jax.random.normal(keys[3 * i], (STATE, STATE)) / 8
        params[f"lambda{i}"] = jax.random.uniform(keys[3 * i + 1], (STATE,))
        params[f"bias{i}"] = jax.random.normal(keys[3 * i + 2], (STATE,))
    inputs = jax.random.normal(keys[7], (BATCH, T, STATE))
    state = jnp.ones((layers, BATCH, STATE))
    return params, inputs, state


def lambda_table(runner, lengths, layer_counts):
    print("Jacobian w.r.t. lambda: the model as written, a custom_jvp recurrence, one jvp")
    header = (
        f"{'T':>4} {'L':>2} {'mode':>4} | {'scan ms':>9} {'scan MB':>8} | "
        f"{'cjvp t':>6} {'cjvp m':>6} | {'cj n/8 t':>8} {'cj n/8 m':>8} | "
        f"{'diag t':>6} {'diag m':>6} | {'cjvp err':>8} {'n/8 err':>8}"
    )
    print(header)
    print("-" * len(header))
    for T in lengths:
        for layers in layer_counts:
            args = make_args(T, layers)
            f, pick = quantity("lambda", layers)
            g, _ = quantity("lambda", layers, recurrence)
            for mode in ("rev", "fwd"):
                plain = jax.jacrev if mode == "rev" else jax.jacfwd
                ours = eqxshard.filter_jacrev if mode == "rev" else eqxshard.filter_jacfwd
                c, m_scan = runner.compile(batched(plain(f), pick), args)
                t_scan = runner.time(c, m_scan, args)
                expected = c(*args) if t_scan is not None else None
                c, m_cj = runner.compile(batched(plain(g), pick), args)
                t_cj = runner.time(c, m_cj, args)
                err_cj = error(c, t_cj, args, expected)
                n = basis_size("lambda", mode, layers, T)
                c, m_cj8 = runner.compile(batched(ours(g, batch_size=max(1, n // 8)), pick), args)
                t_cj8 = runner.time(c, m_cj8, args)
                err_cj8 = error(c, t_cj8, args, expected)
                diag = "     -      -"
                if layers == 1:  # the Jacobian of the last layer's lambda is diagonal

                    def one_jvp(lam, params, inputs, state, f=f):
                        def h(lam):
                            return f({"lambda0": lam}, params, inputs, state)

                        return jax.jvp(h, (lam["lambda0"],), (jnp.ones_like(lam["lambda0"]),))[1]

                    c, m_d = runner.compile(batched(one_jvp, pick), args)
                    t_d = runner.time(c, m_d, args)
                    diag = f"{ratio(t_d, t_scan)} {m_d / m_scan:>6.3f}"
                print(
                    f"{T:>4} {layers:>2} {mode:>4} | {ms(t_scan):>9} {m_scan / 2**20:>8.2f} | "
                    f"{ratio(t_cj, t_scan)} {m_cj / m_scan:>6.3f} | "
                    f"{ratio(t_cj8, t_scan, 8)} {m_cj8 / m_scan:>8.3f} | {diag} | "
                    f"{err_cj:>8} {err_cj8:>8}",
                    flush=True,
                )
    print()


def main_table(runner, lengths, layer_counts, names, modes):
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("basis",), axis_types=(jax.sharding.AxisType.Auto,))
    print("time (t) and temporaries (m) as ratios to jax.jac* of the same row")
    header = (
        f"{'T':>4} {'L':>2} {'wrt':>6} {'mode':>4} {'n':>5} | {'jax ms':>9} {'jax MB':>8} | "
        f"{'eqx t':>6} | {'all t':>6} {'all m':>6} | {'n/8 ms':>9} {'n/8 t':>6} {'n/8 m':>6} | "
        f"{'auto k':>6} {'auto m':>6} {'fits':>5} | {'basis/D':>7} {'batch/D':>7} {'coll':>4}"
    )
    print(header)
    print("-" * len(header))
    for T in lengths:
        for layers in layer_counts:
            args = make_args(T, layers)
            params, inputs, state = args
            split = NamedSharding(mesh, P("basis"))
            batch_args = None
            if BATCH % devices == 0:  # the batch of sequences split over the devices
                batch_args = (
                    params,
                    jax.device_put(inputs, split),
                    jax.device_put(state, NamedSharding(mesh, P(None, "basis"))),
                )
            for name in names:
                f, pick = quantity(name, layers)
                for mode in modes:
                    n = basis_size(name, mode, layers, T)
                    ours = eqxshard.filter_jacrev if mode == "rev" else eqxshard.filter_jacfwd
                    theirs = eqx.filter_jacrev if mode == "rev" else eqx.filter_jacfwd
                    plain = jax.jacrev if mode == "rev" else jax.jacfwd

                    jax_fn = batched(plain(f), pick)
                    c, m_jax = runner.compile(jax_fn, args)
                    t_jax = runner.time(c, m_jax, args)
                    reference = program_text(jax_fn, args)

                    same = (args, reference, t_jax)
                    eqx_t, _ = runner.same_or_time(batched(theirs(f), pick), *same)
                    all_t, m_all = runner.same_or_time(batched(ours(f), pick), *same)
                    m_all = m_jax if m_all is None else m_all

                    k8 = max(1, n // 8)
                    c, m_8 = runner.compile(batched(ours(f, batch_size=k8), pick), args)
                    t_8 = runner.time(c, m_8, args)

                    budget = m_jax // 4
                    auto = ours(f, batch_size="auto", memory_budget=max(1, budget))
                    try:
                        _, m_auto = runner.compile(batched(auto, pick), args)
                        (k_auto,) = auto.auto.cache.values()  # pyright: ignore
                        auto_cells = f"{k_auto:>6} {m_auto / m_jax:>6.3f} {m_auto <= budget!s:>5}"
                    except ValueError:  # even one vector at a time does not fit the budget
                        auto_cells = f"{'-':>6} {'-':>6} {'raise':>5}"

                    k8s = max(devices, k8 // devices * devices)
                    sharded = batched(ours(f, batch_size=k8s, mesh=mesh), pick)
                    c_basis, m_basis = runner.compile(sharded, args)
                    texts = c_basis.as_text()
                    batch_cell = f"{'-':>7}"
                    if batch_args is not None:
                        c_batch, m_batch = runner.compile(
                            batched(ours(f, batch_size=k8), pick), batch_args
                        )
                        texts += c_batch.as_text()
                        batch_cell = f"{m_batch / m_8:>7.3f}"
                    coll = "yes" if any(op in texts for op in COLLECTIVES) else "none"
                    print(
                        f"{T:>4} {layers:>2} {name:>6} {mode:>4} {n:>5} | "
                        f"{ms(t_jax):>9} {m_jax / 2**20:>8.2f} | {eqx_t} | "
                        f"{all_t} {m_all / m_jax:>6.2f} | "
                        f"{ms(t_8):>9} {ratio(t_8, t_jax)} {m_8 / m_jax:>6.3f} | {auto_cells} | "
                        f"{m_basis / m_8:>7.3f} {batch_cell} {coll:>4}",
                        flush=True,
                    )


def cpu_name():
    try:
        with open("/proc/cpuinfo") as info:
            names = [ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true", help="the seed's whole sweep")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths T")
    parser.add_argument("--layers", type=int, nargs="+", help="numbers of layers")
    parser.add_argument("--names", nargs="+", default=["lambda", "weight", "input", "state"])
    parser.add_argument("--modes", nargs="+", default=["rev", "fwd"])
    parser.add_argument("--only", choices=["lambda", "main"], help="print one table")
    parser.add_argument("--cap-gib", type=float, default=10.0, help="run nothing above this")
    parser.add_argument("--seconds", type=float, default=3.0, help="time spent per program")
    parser.add_argument("--repeat", type=int, default=5, help="most calls per program")
    opts = parser.parse_args()
    lengths = opts.lengths or ((64, 128, 256, 512) if opts.full else (64,))
    layer_counts = opts.layers or ((1, 2) if opts.full else (1,))
    runner = Runner(int(opts.cap_gib * 2**30), opts.seconds, opts.repeat)
    print(
        f"jax {jax.__version__}, equinox {eqx.__version__}, Python {platform.python_version()}; "
        f"{cpu_name()}, {os.cpu_count()} cores, {len(jax.devices())} "
        f"{jax.devices()[0].platform} devices; programs with temporaries over "
        f"{opts.cap_gib} GiB are not run"
    )
    if opts.only != "main":
        lambda_table(runner, lengths, layer_counts)
    if opts.only != "lambda":
        main_table(runner, lengths, layer_counts, opts.names, opts.modes)


if __name__ == "__main__":
    main()
