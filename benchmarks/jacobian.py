"""Jacobians of the associative-scan recurrence of jax-ml/jax#19498: time and temporaries.

One table from one run: for each sequence length `T`, number of layers, the quantity
differentiated against (the scan parameter `lambda`, the dense `weight`, the `input`, the
initial `state`) and the mode (rev/fwd), the time and the temporaries (bytes per device,
`compiled.memory_analysis()`) of `jax.jac*`, `eqx.filter_jac*`, and `eqxshard.filter_jac*`
at `batch_size` = all (None), n/8, "auto" (budget: 1/4 of the unchunked temporaries), and
n/8 split over 8 devices. Ratios are against `jax.jac*` in the same run. The seed's
workload is state 64, batch 16 (`jit(vmap(jac))`), T in {64, 128, 256, 512}, 1 and 2
layers; the default run is trimmed for a small CPU, `--full` runs all of it.

    python benchmarks/jacobian.py [--full] [--hlo]
"""

from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqxshard  # noqa: E402

STATE, BATCH = 64, 16


def binary_operator(element_i, element_j):
    a_i, bu_i = element_i
    a_j, bu_j = element_j
    return a_j * a_i, a_j * bu_i + bu_j


def scan_layer(lam, x, state):
    lams = jnp.repeat(lam[None], x.shape[0] + 1, axis=0)
    _, ys = jax.lax.associative_scan(binary_operator, (lams, jnp.concatenate([state[None], x])))
    return ys[-1], ys[1:]


def model(params, inputs, state, layers):
    """Final state of `layers` stacked recurrences (the seed's one/two-layer models)."""
    x, final = inputs, None
    for i in range(layers):
        x = x @ params[f"weight{i}"].T + params[f"bias{i}"]
        final, x = scan_layer(params[f"lambda{i}"], x, state[i])
    return final


def quantity(name, layers):
    """(the function of one differentiated argument, how to get it from the full args)."""

    def f(diff, params, inputs, state):
        if name == "lambda":
            params = {**params, **diff}
        elif name == "weight":
            params = {**params, **diff}
        elif name == "input":
            inputs = diff
        else:
            state = diff
        return model(params, inputs, state, layers)

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


def batched(jac, pick, f):
    def one(params, inputs, state):
        return jac(pick(params, inputs, state), params, inputs, state)

    return jax.jit(jax.vmap(one, in_axes=(None, 0, 1)))


def measure(fn, args, repeat):
    compiled = fn.lower(*args).compile()
    temps = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return best, temps, compiled


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true", help="the seed's whole sweep")
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    lengths = (64, 128, 256, 512) if opts.full else (64,)
    layer_counts = (1, 2) if opts.full else (1,)
    names = ("lambda", "weight", "input", "state")
    mesh = jax.make_mesh((8,), ("basis",), axis_types=(jax.sharding.AxisType.Auto,))

    header = (
        f"{'T':>4} {'L':>2} {'wrt':>7} {'mode':>4} {'n':>6} | {'jax ms':>8} {'jax MB':>8} | "
        f"{'eqx t':>6} | {'all t':>6} {'all m':>6} | {'n/8 t':>6} {'n/8 m':>6} | "
        f"{'auto k':>6} {'auto m':>6} {'fits':>4} | {'8dev m/n8':>9} {'gather':>6}"
    )
    print("time (t) and temporaries (m) as ratios to jax.jac* of the same row")
    print(header)
    print("-" * len(header))
    for T in lengths:
        for layers in layer_counts:
            keys = jax.random.split(jax.random.key(0), 8)
            params = {}
            for i in range(layers):
                params[f"weight{i}"] = jax.random.normal(keys[3 * i], (STATE, STATE)) / 8
                params[f"lambda{i}"] = jax.random.uniform(keys[3 * i + 1], (STATE,))
                params[f"bias{i}"] = jax.random.normal(keys[3 * i + 2], (STATE,))
            inputs = jax.random.normal(keys[7], (BATCH, T, STATE))
            state = jnp.ones((layers, BATCH, STATE))
            args = (params, inputs, state)
            for name in names:
                f, pick = quantity(name, layers)
                for mode in ("rev", "fwd"):
                    n = basis_size(name, mode, layers, T)
                    ours = eqxshard.filter_jacrev if mode == "rev" else eqxshard.filter_jacfwd
                    theirs = eqx.filter_jacrev if mode == "rev" else eqx.filter_jacfwd
                    plain = jax.jacrev if mode == "rev" else jax.jacfwd
                    t_jax, m_jax, _ = measure(batched(plain(f), pick, f), args, opts.repeat)
                    t_eqx, _, _ = measure(batched(theirs(f), pick, f), args, opts.repeat)
                    t_all, m_all, _ = measure(batched(ours(f), pick, f), args, opts.repeat)
                    k8 = max(1, n // 8)
                    t_8, m_8, _ = measure(
                        batched(ours(f, batch_size=k8), pick, f), args, opts.repeat
                    )
                    budget = m_jax // 4
                    auto = ours(f, batch_size="auto", memory_budget=max(1, budget // BATCH))
                    try:
                        _, m_auto, _ = measure(batched(auto, pick, f), args, 1)
                        (k_auto,) = auto.auto.cache.values()
                        auto_cells = (
                            f"{k_auto:>6} {m_auto / m_jax:>6.2f} {str(m_auto <= budget):>4}"
                        )
                    except ValueError:
                        auto_cells = f"{'-':>6} {'-':>6} {'no':>4}"
                    k8s = max(8, (n // 8) // 8 * 8)
                    sharded = ours(f, batch_size=k8s, mesh=mesh)
                    _, m_sh, compiled = measure(batched(sharded, pick, f), args, 1)
                    gather = "all-gather" in compiled.as_text()
                    print(
                        f"{T:>4} {layers:>2} {name:>7} {mode:>4} {n:>6} | "
                        f"{t_jax * 1e3:>8.2f} {m_jax / 2**20:>8.2f} | {t_eqx / t_jax:>6.2f} | "
                        f"{t_all / t_jax:>6.2f} {m_all / m_jax:>6.2f} | "
                        f"{t_8 / t_jax:>6.2f} {m_8 / m_jax:>6.2f} | {auto_cells} | "
                        f"{m_sh / max(m_8, 1):>9.3f} {str(gather):>6}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
