#!/usr/bin/env bash
# The benchmark on a GPU, in one command (about 5-8 minutes in all, the install included):
#
#     bash bench/gpu.sh [OUT]        # OUT: where the results go (default bench/out-gpu/DATE, UTC)
#
# Run it from a checkout, in a virtual environment (python -m venv .venv && . .venv/bin/activate),
# on a machine with an NVIDIA GPU and its driver (CUDA 12). It
#   1. installs requirements-dev.txt with the CUDA 12 build of jaxlib: pip install "jax[cuda12]<range>",
#      the range being requirements.txt's for jax (so the GPU run uses a jax the project supports);
#   2. checks that JAX sees the GPU;
#   3. runs `python -m bench.run --accelerator --out OUT` with JAX_PLATFORMS=cuda: every design
#      (forkless, spawn, inline, io-ceiling, forkless-nojax) at 1,000 and 10,000 msg/s and at the
#      bounded window, the heavy step, start-up, and the step-cost section (the default step and
#      steps calibrated to ~1 ms and ~10 ms on this GPU, with the ping probe); one repeat each
#      of 2.5 s (the reduced plan: no state scaling, no forced CPU devices);
#   4. writes OUT/results.json, OUT/bench.png, OUT/logs/ and OUT/results.md: the same tables as
#      bench/docs/last-run.md's results block, whose first line names the platform (JAX_PLATFORMS=cuda)
#      and the JAX device. Nothing in the repository's bench/README.md or bench/docs/ is changed: a run
#      worth keeping is archived (python -m bench.archive OUT) and its folder's line added to
#      bench/out-gpu/README.md (bench/docs/running.md, "What the repository keeps").
#
# Environment:
#   PYTHON                       the interpreter (default: python)
#   FORKLESS_GPU_SKIP_INSTALL=1  install nothing (the requirements are in place); the install
#                                command is printed instead
#   JAX_PLATFORMS                default cuda; JAX_PLATFORMS=cpu runs the same on the CPU, to check
#                                the script's shape on a machine without a GPU
#   FORKLESS_BENCH_QUICK=1       the smoke size (bench.run --quick): seconds, not minutes
#   FORKLESS_BENCH_UNIX=1        every socket a unix-domain one (bench.run --unix, bench/unix.py)
#   FORKLESS_BENCH_DRY_RUN=1     print the install and the benchmark's command, run neither
#                                (tests/bench/test_bench_smoke.py; the same bench.run is run there by
#                                bench/tpu.sh, the session's benchmark run)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out-gpu/$(date -u +%Y-%m-%d)}"
PY="${PYTHON:-python}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
# each design is a process of its own, one after the other; without this, JAX would take 75% of
# the GPU's memory at each start, which also slows every start
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
started=$(date +%s)

# requirements.txt's range for jax, e.g. ">=0.4.30,<0.11"
jax_range=$(sed -n 's/^jax\([<>=!~][^ #]*\).*/\1/p' requirements.txt)
if [[ -z "$jax_range" ]]; then
    echo "bench/gpu.sh: no jax line in requirements.txt" >&2
    exit 2
fi
install=("$PY" -m pip install -r requirements-dev.txt "jax[cuda12]${jax_range}")
run=("$PY" -m bench.run --accelerator)
if [[ "${FORKLESS_BENCH_UNIX:-0}" == 1 ]]; then
    run+=(--unix)
fi
if [[ "${FORKLESS_BENCH_QUICK:-0}" == 1 ]]; then
    run+=(--quick)
fi
run+=(--out "$OUT")
if [[ "${FORKLESS_BENCH_DRY_RUN:-0}" == 1 ]]; then
    echo "bench/gpu.sh: dry run: ${install[*]}"
    echo "bench/gpu.sh: dry run: JAX_PLATFORMS=$JAX_PLATFORMS ${run[*]}"
    exit 0
fi
if [[ "${FORKLESS_GPU_SKIP_INSTALL:-0}" == 1 ]]; then
    echo "bench/gpu.sh: install skipped (FORKLESS_GPU_SKIP_INSTALL=1): ${install[*]}"
else
    echo "bench/gpu.sh: ${install[*]}"
    "${install[@]}"
fi

"$PY" - <<'EOF'
import os, jax
devices = jax.devices()
print(f"bench/gpu.sh: JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}, jax {jax.__version__}, devices {devices}")
if os.environ["JAX_PLATFORMS"].startswith("cuda") and devices[0].platform != "gpu":
    raise SystemExit(f"bench/gpu.sh: JAX runs on {devices[0].platform}, not the GPU: is jax[cuda12] installed?")
EOF

echo "bench/gpu.sh: JAX_PLATFORMS=$JAX_PLATFORMS ${run[*]}"
"${run[@]}"
echo "bench/gpu.sh: $(( $(date +%s) - started )) s in all; the tables are in $OUT/results.md"
