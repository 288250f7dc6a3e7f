"""Placing an Equinox model on a mesh: eqxshard against `eqx.filter_shard` and by hand.

The model is 48 `eqx.nn.MLP(64, 64, 64, 4)`: 480 small array leaves, where per-leaf
Python overhead shows. Everything runs in one process on every device it finds (8 CPU
devices on a CPU-only machine; `JAX_NUM_CPU_DEVICES=n` for another count), and every
ratio compares timings from this one run (interleaved, so drift hits every method alike;
a call shorter than 5 ms is timed as several calls back to back per sample, as `timeit`
picks its loop count):

- (a) replicating the model on an 8-device Auto mesh: the first call (a fresh model after
  `jax.clear_caches()`; `eqx.filter_shard` compiles here) and the steady state (the same
  uncommitted `jax.Array` model, or the same host NumPy model, placed again and again);
- (b) re-placing a model that is already placed (no transfer is needed), against a real
  transfer of the same model from host NumPy;
- (c) inside `jit`: the time to trace and lower `jax.jit(f)` where `f` calls
  `eqxshard.filter_shard`, against `f` calling `with_sharding_constraint` by hand, and
  whether the two compiled HLO modules are identical;
- a breakdown of (a) and (b) by cProfile: the share of the time spent flattening and
  unflattening the tree, resolving (the cache lookup, or the full resolution), checking
  (whether each leaf is already placed, spec checks) and in the transfer itself (JAX),
  each share times the median wall time of the call; "own per leaf" is eqxshard's own
  work (all but the transfer) divided by the 480 leaves;

"By hand" is the batched `jax.device_put(list_of_leaves, list_of_shardings)` a user
would write: one flatten, the array leaves in one call, one unflatten. eqxshard makes
that same call, so the transfers cost the same and the ratio to it is eqxshard's own
overhead (resolving and checking 480 leaves). A ratio below 1 means eqxshard is faster.
Each target gets a PASS/MISS; the timings are not checked by the test suite (it only
runs `--quick` to keep this script working).

    python benchmarks/placement.py [--quick] [--repeats 30]

Host-to-accelerator transfers of big leaves are measured by `benchmarks/transfer.py`.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import os
import pstats
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

# 8 CPU devices (JAX_NUM_CPU_DEVICES=n for another count), before JAX starts its
# backends. GPUs and TPUs are not affected: the benchmark uses every device it finds.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from _table import print_table  # noqa: E402  (benchmarks/_table.py)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import eqxshard  # noqa: E402

N_MLPS = 48
REPLACE_TARGET = 0.03  # a re-place that moves nothing, against a real transfer
OWN_TARGET_US = 2.0  # eqxshard's own work (flattening, resolving, checking) per leaf
MIN_SAMPLE_S = 0.005  # shorter calls are timed several to a sample, back to back


def make_model(seed: int = 0) -> list[eqx.nn.MLP]:
    """48 MLPs with host NumPy weights (drawn on the host: 48 eager inits take seconds)."""
    mlp = eqx.nn.MLP(64, 64, 64, 4, key=jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def draw(x: Any) -> Any:
        return (rng.normal(size=x.shape) / 8).astype(x.dtype) if eqx.is_array(x) else x

    return [jax.tree.map(draw, mlp) for _ in range(N_MLPS)]


def fresh_copy(template: Any, *, host: bool) -> Any:
    """A new model object with new leaves: host NumPy, or uncommitted `jax.Array`s."""
    leaves, treedef = jax.tree.flatten(template)
    new = [np.array(x) if eqx.is_array(x) else x for x in leaves]
    if not host:
        new = [jax.device_put(x) if isinstance(x, np.ndarray) else x for x in new]
    return jax.tree.unflatten(treedef, new)


def by_hand(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """The batched `jax.device_put` a user would write for a model."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if eqx.is_array(x)]
    moved = jax.device_put([leaves[i] for i in where], [sharding] * len(where))
    for i, x in zip(where, moved, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def timed(fn: Callable[[], Any], *, wait: bool = True, calls: int = 1) -> float:
    """Seconds per call over `calls` calls made back to back, each until every array it
    returns is ready (with `wait`)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
            if wait:
                jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls
    finally:
        gc.enable()


def calls_per_sample(fn: Callable[[], Any], *, wait: bool = True) -> int:
    """How many back-to-back calls make one sample last `MIN_SAMPLE_S` (as `timeit` picks
    its loop count): a single sub-millisecond call after `gc.collect()` times the cold
    caches that `gc.collect()` leaves, not the call."""
    fn()  # warm
    once = timed(fn, wait=wait)
    return max(1, min(100, math.ceil(MIN_SAMPLE_S / max(once, 1e-9))))


def returns_its_input(fn: Callable[[], Any], tree: Any) -> bool:
    """Whether `fn()` gives back the very array objects of `tree` (so no copy was made)."""
    out = [x for x in jax.tree.leaves(fn()) if eqx.is_array(x)]
    given = [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]
    return len(out) == len(given) and all(a is b for a, b in zip(out, given, strict=True))


def interleaved(
    calls: dict[str, Callable[[], Any]], repeats: int, *, no_wait: frozenset[str] = frozenset()
) -> dict[str, float]:
    """The median seconds of each call; each repeat runs every call once, in turn.

    A sample is `calls_per_sample` calls back to back (one for calls of 5 ms or more).
    Calls named in `no_wait` return arrays that were ready before the call (see
    `returns_its_input`): waiting on them would time `jax.block_until_ready` (about 2 ms
    for 480 leaves), not the call.
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    loops = {name: calls_per_sample(calls[name], wait=name not in no_wait) for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(calls[name], wait=name not in no_wait, calls=loops[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def first_calls(template: Any, sharding: NamedSharding, repeats: int) -> dict[str, float]:
    """Each method on a fresh model, with JAX's caches cleared before every call."""
    mesh = sharding.mesh
    methods: dict[str, Callable[[Any], Any]] = {
        "eqxshard": lambda m: eqxshard.filter_shard(m, mesh),
        "eqx.filter_shard": lambda m: eqx.filter_shard(m, sharding),
        "by hand": lambda m: by_hand(m, sharding),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model = fresh_copy(template, host=False)
            jax.block_until_ready(model)
            jax.clear_caches()
            times[name].append(timed(lambda m=model, f=methods[name]: f(m)))
    return {name: statistics.median(ts) for name, ts in times.items()}


def trace_and_hlo(arrays: Any, sharding: NamedSharding, repeats: int) -> tuple[dict, bool]:
    """Trace+lower time of `jit(f)` (a new `f` each time), and whether the HLO matches."""
    mesh = sharding.mesh

    def with_eqxshard(tree):
        return eqxshard.filter_shard(tree, mesh)

    def with_wsc(tree):
        leaves, treedef = jax.tree.flatten(tree)
        leaves = jax.lax.with_sharding_constraint(leaves, [sharding] * len(leaves))
        return jax.tree.unflatten(treedef, leaves)

    def lower(f: Callable[[Any], Any]) -> Any:
        def place(tree):  # a new function each time: nothing cached from the last trace
            return f(tree)

        return jax.jit(place).lower(arrays)

    times = interleaved(
        {"eqxshard": lambda: lower(with_eqxshard), "by hand": lambda: lower(with_wsc)}, repeats
    )
    texts = [_hlo(lower(f).compile().as_text()) for f in (with_eqxshard, with_wsc)]
    return times, texts[0] == texts[1]


def _hlo(text: str) -> str:
    """Compiled HLO without its source locations (the files and lines each op came from)."""
    debug_info = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    blocks = [b for b in text.split("\n\n") if not b.lstrip().startswith(debug_info)]
    return re.sub(r",? metadata=\{[^}]*\}", "", "\n\n".join(blocks))


CATEGORIES = ("flattening", "resolving", "checking", "transfer")
# eqxshard's own modules that check rather than resolve (the rest of `eqxshard` resolves;
# `staging` is the transfer); `cache.place_tree` checks which leaves are already placed.
CHECKING = {"specs.py", "place.py", "multihost.py", "exchange.py"}


def _own_category(func: tuple[str, int, str]) -> str | None:
    """The category of a function by where it is defined; `None`: by its callers."""
    filename, _, name = func
    if "flatten" in name or filename.startswith("<generated"):
        return "flattening"  # PyTree (un)flattening: JAX's C++ and Equinox's generated code
    if f"{os.sep}equinox{os.sep}" in filename or filename.endswith("tree_util.py"):
        return "flattening"
    if f"{os.sep}eqxshard{os.sep}" not in filename:
        return None
    base = os.path.basename(filename)
    if base == "staging.py":
        return "transfer"
    if base in CHECKING or (base == "cache.py" and name == "place_tree"):
        return "checking"
    return "resolving"


def breakdown(call: Callable[[], Any], repeats: int) -> dict[str, float]:
    """The share of `call`'s time in each of `CATEGORIES`, by cProfile.

    A function outside eqxshard (a JAX array's `.shape`, a builtin) counts for the
    category of the eqxshard function that called it, and as transfer otherwise.
    """
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(repeats):
        call()
    profile.disable()
    stats: dict[Any, Any] = pstats.Stats(profile).stats  # pyright: ignore[reportAttributeAccessIssue]
    own = {func: _own_category(func) for func in stats}
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for func, (_, _, tottime, _, callers) in stats.items():
        if own[func] is not None:
            totals[own[func]] += tottime
            continue
        rest = tottime
        for caller, (_, _, from_caller, _) in callers.items():
            category = own.get(caller)
            if category not in (None, "transfer"):
                totals[category] += from_caller
                rest -= from_caller
        totals["transfer"] += max(rest, 0.0)
    whole = sum(totals.values()) or 1.0
    return {name: t / whole for name, t in totals.items()}


def on_explicit_mesh(place: Callable[[Any], Any]) -> tuple[str, str]:
    """What `place` does with a batch split over the axis of an Explicit mesh: in short,
    and with the first sentence of the error it raises."""
    try:
        jax.block_until_ready(place(np.ones((8 * jax.device_count(), 8), np.float32)))
    except Exception as e:  # the row reports whatever it raises
        return f"raises {type(e).__name__}", f"{type(e).__name__}: {str(e).split('. ')[0]}"
    return "works", "works"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (3 repeats)")
    parser.add_argument("--repeats", type=int, default=30, help="repeats per steady timing")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    first_repeats = 1 if args.quick else max(3, repeats // 2)
    trace_repeats = 1 if args.quick else max(3, repeats // 3)

    n = jax.device_count()
    auto = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    explicit = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    replicated = NamedSharding(auto, P())
    template = make_model()
    arrays = eqx.filter(template, eqx.is_array)
    n_leaves = len(jax.tree.leaves(arrays))
    on_device = fresh_copy(template, host=False)
    on_host = fresh_copy(template, host=True)
    placed = eqxshard.filter_shard(on_device, auto)

    first = first_calls(template, replicated, first_repeats)
    steady_device = interleaved(
        {
            "eqxshard": lambda: eqxshard.filter_shard(on_device, auto),
            "eqx.filter_shard": lambda: eqx.filter_shard(on_device, replicated),
            "by hand": lambda: by_hand(on_device, replicated),
        },
        repeats,
    )
    steady_host = interleaved(
        {
            "eqxshard": lambda: eqxshard.filter_shard(on_host, auto),
            "eqx.filter_shard": lambda: eqx.filter_shard(on_host, replicated),
            "by hand": lambda: by_hand(on_host, replicated),
        },
        repeats,
    )
    explicit_replicated = NamedSharding(explicit, P())
    steady_explicit = interleaved(
        {
            "eqxshard": lambda: eqxshard.filter_shard(on_host, explicit),
            "by hand": lambda: by_hand(on_host, explicit_replicated),
        },
        repeats,
    )
    replace_calls = {
        "eqxshard": lambda: eqxshard.filter_shard(placed, auto),
        "eqx.filter_shard": lambda: eqx.filter_shard(placed, replicated),
        "by hand": lambda: by_hand(placed, replicated),
    }
    no_copy = frozenset(n for n, f in replace_calls.items() if returns_its_input(f, placed))
    again = interleaved(replace_calls, repeats, no_wait=no_copy)
    trace, identical = trace_and_hlo(arrays, replicated, trace_repeats)
    # The re-place is eqxshard's own work only (nothing moves): its cProfile shares split
    # its wall time. A steady transfer does that same work, then the transfer and one
    # unflatten (timed alone; the transfer is what is left of the wall time).
    profile_repeats = max(3, repeats // 3)
    share = breakdown(lambda: eqxshard.filter_shard(placed, auto), profile_repeats)
    own = {c: share[c] * again["eqxshard"] for c in CATEGORIES}
    leaves, treedef = jax.tree.flatten(on_host)
    unflatten = interleaved(
        {"unflatten": lambda: jax.tree.unflatten(treedef, leaves)},
        31,
        no_wait=frozenset({"unflatten"}),
    )["unflatten"]
    steady_own = {**own, "flattening": own["flattening"] + unflatten}
    steady_own["transfer"] = steady_host["eqxshard"] - sum(steady_own.values())
    shares = {
        "(a) steady, host NumPy -> Auto mesh": steady_own,
        "(b) re-place an already-placed model": own,
    }

    rows: list[tuple[str, ...]] = []

    def row(case: str, ours: float, anchor: str, theirs: float, target: float | None):
        ratio = ours / theirs
        if target is None:
            rows.append((case, _ms(ours), anchor, _ms(theirs), f"{ratio:.2f}x", "", ""))
            return
        inclusive = target in (1.0, REPLACE_TARGET)  # the targets stated as "at most"
        ok = ratio <= target if inclusive else ratio < target
        bound = f"{'<=' if inclusive else '<'} {target:.2f}x"
        result = "PASS" if ok else "MISS"
        rows.append((case, _ms(ours), anchor, _ms(theirs), f"{ratio:.2f}x", bound, result))

    case = "(a) first call, fresh model -> Auto mesh"
    row(case, first["eqxshard"], "eqx.filter_shard", first["eqx.filter_shard"], 0.5)
    row(case, first["eqxshard"], "device_put by hand", first["by hand"], None)
    for case, times in (
        ("(a) steady, uncommitted jax.Array -> Auto", steady_device),
        ("(a) steady, host NumPy -> Auto mesh", steady_host),
    ):
        row(case, times["eqxshard"], "eqx.filter_shard", times["eqx.filter_shard"], 0.4)
        row(case, times["eqxshard"], "device_put by hand", times["by hand"], 1.0)
    case = "(a) steady, host NumPy -> Explicit mesh"
    row(case, steady_explicit["eqxshard"], "device_put by hand", steady_explicit["by hand"], 1.0)
    ours, _ = on_explicit_mesh(lambda x: eqxshard.filter_shard(x, explicit, P("data")))
    theirs, error = on_explicit_mesh(
        lambda x: eqx.filter_shard(x, NamedSharding(explicit, P("data")))
    )
    rows.append(("(a) a batch -> P('data'), Explicit mesh", ours, "eqx.filter_shard", theirs))
    rows[-1] += ("", "", "")
    case = "(b) re-place an already-placed model"
    row(
        case, again["eqxshard"], "eqxshard, NumPy transfer", steady_host["eqxshard"], REPLACE_TARGET
    )
    row(case, again["eqxshard"], "eqx.filter_shard", again["eqx.filter_shard"], None)
    row(case, again["eqxshard"], "device_put by hand", again["by hand"], None)
    case = "(c) trace + lower jax.jit(f)"
    row(case, trace["eqxshard"], "with_sharding_constraint", trace["by hand"], None)
    verdict = "identical" if identical else "DIFFERENT"
    rows.append(("(c) compiled HLO, both f", verdict, "with_sharding_constraint", verdict))
    rows[-1] += ("", "same HLO", "PASS" if identical else "MISS")

    print(
        f"eqxshard {eqxshard.__version__} placement benchmark: jax {jax.__version__}, "
        f"equinox {eqx.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; "
        f"model {N_MLPS} x eqx.nn.MLP(64, 64, 64, 4) = {n_leaves} array leaves; "
        f"medians of {repeats} runs ({first_repeats} for first calls, "
        f"{trace_repeats} for tracing)."
    )
    header = ("case", "eqxshard", "compared with", "its time", "ratio", "target", "result")
    print_table([header, *rows], right={1, 3, 4})
    print(f"eqx.filter_shard on an Explicit mesh: {error}.")
    print()
    print(
        f"Where the time goes: the re-place (b) split by cProfile shares of {profile_repeats} "
        "calls; (a) does the same work, plus one unflatten (timed alone) and the transfer "
        "(the rest):"
    )
    table = [("case", *CATEGORIES, "own per leaf", "target", "result")]
    for case, parts in shares.items():
        per_leaf = sum(parts[c] for c in CATEGORIES if c != "transfer") / n_leaves
        ok = per_leaf * 1e6 <= OWN_TARGET_US
        table.append(
            (
                case,
                *(_ms(parts[c]) for c in CATEGORIES),
                f"{per_leaf * 1e6:.2f} us",
                f"<= {OWN_TARGET_US:.1f} us",
                "PASS" if ok else "MISS",
            )
        )
    print_table(table, right=set(range(1, len(CATEGORIES) + 2)))
    print(
        "(b) return the very arrays they were given, so nothing is waited on: "
        + (", ".join(sorted(no_copy)) or "none")
        + "."
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()
