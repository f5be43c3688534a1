#!/usr/bin/env bash
# The GPU check in one call, on a bare CUDA machine: python3 with torch, CuPy (12.x/13.x wheels,
# CuPy 13 or 14), numpy, xxhash and pytest; no Ray, no vLLM, no kvray install, nothing fetched.
#
#   bash scripts/gpu_check.sh            # from anywhere; runs from the repo root
#
# 1. environment: versions, the device, CuPy compiling a kernel, kvray.kernels importing
#    without Ray or vLLM;
# 2. the kernels' `gpu` tests (tests/test_kernels_gpu.py, gpu-marked tests of
#    tests/test_kernels.py): vLLM's GPU KV layouts built synthetically, both engines;
# 3. scripts/bench_kernels.py --gpu-only: gather / scatter between GPU paged caches and pinned
#    host buffers against cudaMemcpyAsync of the same bytes.
# Under 6 minutes (each phase has a time limit). Every phase's output is kept in $LOG_DIR
# (printed) and shown; a summary follows. The last line is the bench's
# `ratio gather_over_d2h=<x> scatter_over_h2d=<y> cupy_over_torch=<z>`; without a CUDA device
# the script imports everything, skips the tests and the bench, and exits 0.
# Environment: PYTHON (default python3), LOG_DIR (default a new temporary directory).
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
LOG_DIR="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvray-gpu-check.XXXXXX")}"
mkdir -p "$LOG_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
T0=$SECONDS

# run NAME LIMIT_S CMD...: run one phase with a time limit, output shown and kept in LOG_DIR.
run() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    if command -v timeout >/dev/null 2>&1; then
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    else
        "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    fi
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s"
    return "$rc"
}

run env 120 "$PY" - <<'EOF'
import importlib
import platform
import sys

print(f"python {platform.python_version()} ({sys.executable}) on {platform.node()}")
for name in ("torch", "cupy", "numpy", "xxhash", "pytest", "ray", "vllm", "pyarrow"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name}: {getattr(mod, '__version__', 'present')}")
    except Exception as exc:
        print(f"  {name}: absent ({type(exc).__name__}: {exc})")
import torch

cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}; CUDA available: {cuda}")
if cuda:
    props = torch.cuda.get_device_properties(0)
    print(f"device 0: {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
# kvray's own import, in a fresh interpreter (the version loop above imported whatever is
# installed): it must load none of these, installed or not.
import subprocess

WATCH = ("ray", "vllm", "pyarrow", "kvray.actors", "kvray.disk", "kvray.client")
probe = (
    "import sys, kvray.kernels; "
    f"print(' '.join(m for m in {WATCH!r} if m in sys.modules))"
)
got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
if got.returncode != 0:
    sys.exit(f"import kvray.kernels failed:\n{got.stderr}")
loaded = got.stdout.split()
print(f"kvray.kernels imported; loaded by it: {loaded or 'none of ' + ', '.join(WATCH)}")
if loaded:
    sys.exit(f"kvray.kernels pulled in {loaded}")
from kvray.kernels.cuda_ops import cupy_available
if cuda:
    print(f"CuPy usable (kvray.kernels.cuda_ops.cupy_available): {cupy_available()}")
    try:
        import cupy

        k = cupy.RawKernel(
            r'extern "C" __global__ void inc(float* x) { x[threadIdx.x] += 1.0f; }', "inc"
        )
        x = cupy.zeros(32, dtype=cupy.float32)
        k((1,), (32,), (x,))
        print(f"CuPy kernel compile + launch: ok ({float(x.sum())}); CUDA runtime "
              f"{cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}")
    except Exception as exc:
        print(f"CuPy kernel compile + launch: FAILED ({type(exc).__name__}: {exc})")
EOF
ENV_RC=$?
CUDA=$(grep -c "CUDA available: True" "$LOG_DIR/env.log" 2>/dev/null)

run tests 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs \
    tests/test_kernels_gpu.py tests/test_kernels.py
TESTS_RC=$?

BENCH_RC=0
if [ "$CUDA" = "1" ]; then
    run bench 150 "$PY" scripts/bench_kernels.py --gpu-only
    BENCH_RC=$?
else
    echo "== bench: skipped (no CUDA device)"
fi

RATIO=$(grep "^ratio " "$LOG_DIR/bench.log" 2>/dev/null | tail -1)
echo "== summary ($((SECONDS - T0))s; logs in $LOG_DIR)"
echo "   environment: exit $ENV_RC"
echo "   gpu tests:   exit $TESTS_RC; $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$LOG_DIR/tests.log" | tail -1)"
if [ "$CUDA" = "1" ]; then
    echo "   bench:       exit $BENCH_RC"
fi
STATUS=0
for rc in $ENV_RC $TESTS_RC $BENCH_RC; do
    [ "$rc" -ne 0 ] && STATUS=1
done
if [ "$CUDA" != "1" ]; then
    echo "gpu_check: no CUDA device found: kernels imported, gpu tests skipped, bench skipped (exit $STATUS)"
elif [ -n "$RATIO" ]; then
    echo "$RATIO"
else
    echo "gpu_check: the bench printed no ratio line (exit $STATUS)"
fi
exit "$STATUS"
