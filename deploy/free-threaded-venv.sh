#!/usr/bin/env bash
# A virtual environment on free-threaded CPython (PEP 703) with forkless's requirements, the GIL checked off
# after importing every one of them (docs/performance.md, "Free-threaded Python").
#
#   deploy/free-threaded-venv.sh VENV [runtime|tests|dev]
#
#   runtime (default)  requirements.txt: enough for `VENV/bin/python app.py` from this checkout
#   tests              and what the thread-safety tests need (`pytest -m threads`; .ci/run runs them)
#   dev                requirements-dev.txt: the whole test suite, as far as it runs on this build
#
# The interpreter: $FORKLESS_FT_PYTHON, else python3.13t on PATH, else deploy/free-threaded-python.sh (which
# reuses its prefix's build or builds one). Wheels are preferred to newer source releases (--prefer-binary:
# ml_dtypes 0.5.4 has a cp313t wheel, 0.6.0 only a source release). On free-threaded 3.13, what does not build
# there is left out, named on one line: msgspec (its C source supports free-threading from 3.14 on; the wire's
# JSON then runs on the standard library's json, and FORKLESS_FEEDS is refused, saying why) and cryptography
# (cffi refuses free-threaded 3.13; only the TLS tests use it, to make a certificate).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${1:?usage: deploy/free-threaded-venv.sh VENV [runtime|tests|dev]}"
SET="${2:-runtime}"
case "$SET" in runtime | tests | dev) ;; *) echo "unknown set '$SET': runtime, tests or dev" >&2; exit 2 ;; esac

if [ -n "${FORKLESS_FT_PYTHON:-}" ]; then
    PY="$FORKLESS_FT_PYTHON"
elif command -v python3.13t >/dev/null; then
    PY="$(command -v python3.13t)"
else
    PY="$(deploy/free-threaded-python.sh | tail -1)"
fi
"$PY" -c 'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))' \
    || { echo "$PY is not a free-threaded build (Py_GIL_DISABLED unset)" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
skip='^$'
if "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))'; then
    skip='^(msgspec|cryptography)\b'
    echo "free-threaded 3.13: leaving out msgspec and cryptography (no build for it; docs/performance.md)" >&2
fi
grep -vE "$skip" requirements.txt >"$work/runtime.txt"
case "$SET" in
    runtime) cp "$work/runtime.txt" "$work/wanted.txt" ;;
    tests) { echo "-r $work/runtime.txt"; grep -E '^(pytest|pytest-timeout|pytest-xdist|hypothesis|filelock|websockets)\b' \
        requirements-dev.txt; } >"$work/wanted.txt" ;;
    dev) sed "s|^-r requirements.txt|-r $work/runtime.txt|" requirements-dev.txt | grep -vE "$skip" >"$work/wanted.txt" ;;
esac

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --prefer-binary -r "$work/wanted.txt"

# every requirement imported with the GIL's re-enabling made an error that names the module
modules="numpy ml_dtypes scipy jax jaxlib aiohttp multidict yarl frozenlist propcache aiohappyeyeballs aiosignal janus
    prometheus_client json"
case "$SET" in
    tests) modules="$modules pytest xdist pytest_timeout hypothesis filelock websockets" ;;
    dev) modules="$modules pytest xdist pytest_timeout hypothesis filelock websockets psutil yaml matplotlib nats" ;;
esac
"$VENV/bin/python" -W "error:The global interpreter lock:RuntimeWarning" -c '
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
assert not sys._is_gil_enabled(), "the GIL is on after importing " + " ".join(sys.argv[1:])
print(f"{sys.executable}: Python {sys.version.split()[0]}, the GIL off after importing {len(sys.argv) - 1} modules")
' $modules
