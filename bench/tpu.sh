#!/usr/bin/env bash
# The benchmark on the lent TPU host, in one command of at most ~9 minutes:
#
#     bash bench/tpu.sh [OUT]        # OUT: where the results go (default bench/out-tpu/DATE, UTC)
#
# The TPU host (one TPU v5e chip, 13 cores, Python 3.11 with JAX and libtpu) has no package index
# and refuses every TCP or UDP socket, loopback included; unix-domain sockets work, and one
# program at a time may hold the chip (each program that opens it pays ~15 s). So this script
#   1. installs nothing: it checks that the modules the benchmark imports are there (carry their
#      wheels: janus, aiohttp and its dependencies, msgspec, psutil, ...) and names any missing;
#   2. checks that JAX sees the TPU (JAX_PLATFORMS=tpu);
#   3. runs `python -m bench.run --tpu --unix --out OUT`: every socket a unix-domain one (the load
#      generator, the ping probe, the clients, forkless through FORKLESS_WS_UNIX_SOCKET), every
#      process of the run refusing inet sockets (bench/unix.py), the designs one after another:
#      forkless, spawn, inline, io-ceiling and forkless-nojax at 1,000 and 10,000 msg/s and at the
#      bounded window (io-ceiling and forkless-nojax with JAX_PLATFORMS=cpu: they never step on the
#      chip), the compute ceiling and the device floor (bench/device_floor.py, the device's own
#      round trip of a trivial donated per-stream step) in one process, forkless's start-up;
#      one repeat each of 2.5 s (bench/plan.py's Plan.tpu);
#   4. then two measurements of issue 48, each one more opening of the chip: OUT/packed_io.json
#      (bench/packed_io.py: a step's round trip with one array per input and output against one
#      packed array each way, at 1 and 256 messages a step) and OUT/checkpoint_stall.json
#      (bench/checkpoint_stall.py --writer controller: the largest step-to-step gap of the real
#      controller at 1,000 msg/s with a 1M-stream, 68 MB state checkpointed every 2 s, phases
#      "off", "whole" (cloned on the device, the host copy on the writer thread) and
#      "device-get" (the host copy on the main thread, as before)); their main figures are
#      printed at the end and written to OUT/transfers.md (bench/transfers.py);
#   5. writes OUT/results.json, OUT/logs/ and OUT/results.md: the tables of bench/docs/last-run.md's results
#      block (the platform and the JAX device on its first line), the latency budget per hop, the
#      device floor and the CPU µs per message (forkless's IO thread and main thread apart);
#      OUT/bench.png where matplotlib is installed. Nothing in the repository is changed: the
#      integrator copies OUT to bench/out-tpu/DATE without its logs/, archives it (python -m
#      bench.archive bench/out-tpu/DATE) and says what it shows in bench/out-tpu/README.md
#      (bench/docs/running.md, "What the repository keeps").
#
# Environment:
#   PYTHON                  the interpreter (default: python3)
#   JAX_PLATFORMS           default tpu; JAX_PLATFORMS=cpu runs the same on the CPU, to check the
#                           script's shape on a machine without a TPU (tests/bench/test_bench_smoke.py)
#   FORKLESS_BENCH_QUICK=1  the smoke size (bench.run --tpu --quick): every section, seconds each
#   FORKLESS_BENCH_TRANSFERS=0  bench.run alone: not issue 48's two measurements after it (step 4, ~3 minutes)
#   FORKLESS_BENCH_UNIX=0   TCP on loopback instead of unix sockets (a host where TCP works)
#   FORKLESS_STEPS_IN_FLIGHT  passed to the forkless runs as it is (auto when unset: 2 on the TPU)
#   FORKLESS_BENCH_FT_PYTHON  a free-threaded interpreter (a venv's python, its own site-packages): forkless runs
#                           on it too, as the design forkless-ft, beside the others on PYTHON (bench/plan.py);
#                           its PYTHONPATH is FORKLESS_BENCH_FT_PYTHONPATH's alone, and TPU_LIBRARY_PATH points
#                           its JAX at the host's libtpu.so
#   FORKLESS_BENCH_AB_STEPS="1 2"  instead of the full run, an A/B of FORKLESS_STEPS_IN_FLIGHT on
#                           forkless alone: bench.ab --plan tpu --unix, A = the first value, B = the
#                           second, at 1,000 and 10,000 msg/s and the bounded window, alternating
#                           A B / B A, FORKLESS_BENCH_AB_REPEATS (default 2) repeats, the hops
#                           too; prints the medians side by side, writes OUT/ab.json (~5 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out-tpu/$(date -u +%Y-%m-%d)}"
PY="${PYTHON:-python3}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-tpu}"
started=$(date +%s)

"$PY" - <<'EOF'
import importlib.util, os, sys
# what bench.run and its clients import (requirements.txt's runtime and the benchmark's own)
needed = ("jax", "numpy", "janus", "aiohttp", "msgspec", "psutil")
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"bench/tpu.sh: missing {', '.join(missing)}: install their wheels (no package index is "
                     "needed: pip install --no-index --find-links WHEELS ...), then run again")
import jax
devices = jax.devices()
print(f"bench/tpu.sh: JAX_PLATFORMS={os.environ['JAX_PLATFORMS']}, jax {jax.__version__}, devices {devices}")
if os.environ["JAX_PLATFORMS"].startswith("tpu") and devices[0].platform != "tpu":
    raise SystemExit(f"bench/tpu.sh: JAX runs on {devices[0].platform}, not the TPU: is libtpu installed?")
EOF

if [[ -n "${FORKLESS_BENCH_AB_STEPS:-}" ]]; then
    read -r k_a k_b <<<"$FORKLESS_BENCH_AB_STEPS"
    mkdir -p "$OUT"
    ab=("$PY" -m bench.ab --base . --plan tpu --repeats "${FORKLESS_BENCH_AB_REPEATS:-2}" --hops
        --env-a "FORKLESS_STEPS_IN_FLIGHT=$k_a" --env-b "FORKLESS_STEPS_IN_FLIGHT=$k_b" --out "$OUT/ab.json")
    if [[ "${FORKLESS_BENCH_UNIX:-1}" != 0 ]]; then
        ab+=(--unix)
    fi
    echo "bench/tpu.sh: JAX_PLATFORMS=$JAX_PLATFORMS ${ab[*]}"
    "${ab[@]}" | tee "$OUT/ab.md"
    echo "bench/tpu.sh: $(( $(date +%s) - started )) s in all; the A/B is in $OUT/ab.md"
    exit 0
fi

run=("$PY" -m bench.run --tpu)
if [[ "${FORKLESS_BENCH_UNIX:-1}" != 0 ]]; then
    run+=(--unix)
else
    export FORKLESS_BENCH_UNIX=0
fi
if [[ "${FORKLESS_BENCH_QUICK:-0}" == 1 ]]; then
    run+=(--quick)
fi
run+=(--out "$OUT")
echo "bench/tpu.sh: JAX_PLATFORMS=$JAX_PLATFORMS ${run[*]}"
"${run[@]}"

if [[ "${FORKLESS_BENCH_TRANSFERS:-1}" == 0 ]]; then
    echo "bench/tpu.sh: $(( $(date +%s) - started )) s in all; the tables are in $OUT/results.md"
    exit 0
fi
if [[ "${FORKLESS_BENCH_QUICK:-0}" == 1 ]]; then
    packed=(--seconds 0.3 --rounds 1)
    stall=(--streams 5000 --seconds 3 --rounds 1 --every 0.5)
else
    packed=(--seconds 3 --rounds 3)
    stall=(--streams 1000000 --seconds 36 --rounds 3 --every 2)
fi
echo "bench/tpu.sh: $PY -m bench.packed_io ${packed[*]} --out $OUT/packed_io.json"
"$PY" -m bench.packed_io "${packed[@]}" --sizes 1,256 --out "$OUT/packed_io.json"
echo "bench/tpu.sh: $PY -m bench.checkpoint_stall --writer controller ${stall[*]} --modes off,whole,device-get"
"$PY" -m bench.checkpoint_stall --writer controller "${stall[@]}" --modes off,whole,device-get \
    > "$OUT/checkpoint_stall.json"
"$PY" -m bench.transfers "$OUT" | tee "$OUT/transfers.md"
echo "bench/tpu.sh: $(( $(date +%s) - started )) s in all; the tables are in $OUT/results.md"
