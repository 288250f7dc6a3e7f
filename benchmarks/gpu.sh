#!/usr/bin/env bash
# Everything eqxshard measures on a GPU, in one batch: the GPU tests, the transfer,
# placement and Jacobian benchmarks, and every example script. Run it from the repository
# root on a machine with a GPU and JAX for it (nothing is installed):
#
#     bash benchmarks/gpu.sh                      # every part
#     bash benchmarks/gpu.sh tests transfer       # some parts
#
# Parts: versions tests transfer placement jacobian examples. Each part's output goes to
# "$OUT/<part>.txt" ($OUT defaults to benchmarks/results/gpu) and its last lines are
# printed; each is bounded by `timeout`, so that one stuck part does not take the rest.
# The exit status is the number of parts that failed.
set -u
out="${OUT:-benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"
python="${PYTHON:-python}"
failed=0

run() {  # run NAME SECONDS COMMAND...: COMMAND's output to $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name: $* (at most ${limit} s)"
    local start=$SECONDS status=0
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1 || status=$?
    echo "-- $name: exit $status after $((SECONDS - start)) s"
    tail -n 25 "$out/$name.txt"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(versions tests transfer placement jacobian examples)
for part in "${parts[@]}"; do
    case "$part" in
    versions)
        run versions 60 "$python" -c 'import sys, jax, jaxlib, equinox, numpy
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib",
      jaxlib.__version__, "| equinox", equinox.__version__, "| numpy", numpy.__version__)
for d in jax.devices():
    print(d.platform, d.device_kind, "memories:", [m.kind for m in d.addressable_memories()])'
        command -v nvidia-smi >/dev/null && nvidia-smi >>"$out/versions.txt" 2>&1
        ;;
    tests) run tests 420 "$python" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_staging.py ;;
    transfer) run transfer 300 "$python" benchmarks/transfer.py ;;
    placement) run placement 240 "$python" benchmarks/placement.py --repeats 15 ;;
    jacobian) run jacobian 400 "$python" benchmarks/jacobian.py ;;
    examples)
        for script in examples/[a-z]*.py; do
            run "example_$(basename "$script" .py)" 240 "$python" "$script"
        done
        ;;
    *)
        echo "unknown part: $part (parts: versions tests transfer placement jacobian examples)"
        failed=$((failed + 1))
        ;;
    esac
done
exit "$failed"
