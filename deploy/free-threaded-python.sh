#!/usr/bin/env bash
# Free-threaded CPython (PEP 703: built with --disable-gil) in a prefix: reuses a build it finds there, else
# builds one from Debian's copy of the release's source (Debian's archive, which these machines reach; neither
# python.org nor a source of 3.14 is: docs/performance.md, "Free-threaded Python"). The interpreter's path is the
# last line printed.
#
#   deploy/free-threaded-python.sh [PREFIX]      # default: $FORKLESS_FT_PREFIX, else ~/.cache/forkless/python3.13t
#
# Needs curl, a C compiler, make and the usual -dev headers (libssl, libffi, zlib, bz2, lzma, sqlite3, readline):
# what building any CPython needs. About 4.5 CPU-minutes (5-8 minutes on 2 busy cores); nothing is installed
# outside PREFIX.
set -euo pipefail

VERSION=3.13.15
SHA256=1e66a7945a48390ee4c2a4268a0e4185884059a13c4aab6d148aa208deea4a76
URL="http://deb.debian.org/debian/pool/main/p/python3.13/python3.13_${VERSION}.orig.tar.xz"

PREFIX="${1:-${FORKLESS_FT_PREFIX:-$HOME/.cache/forkless/python3.13t}}"
PY="$PREFIX/bin/python3.13t"

if [ -x "$PY" ] && "$PY" -c 'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))' 2>/dev/null; then
    echo "$PY"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "building free-threaded CPython $VERSION into $PREFIX (a few minutes)" >&2
curl -fsSL --retry 3 -o "$work/src.tar.xz" "$URL"
echo "$SHA256  $work/src.tar.xz" | sha256sum -c --quiet -
tar -xf "$work/src.tar.xz" -C "$work"
cd "$work/Python-$VERSION"
./configure --quiet --disable-gil --prefix="$PREFIX" --with-ensurepip=install >"$work/configure.log" 2>&1 \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
make -s -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -30 "$work/make.log" >&2; exit 1; }
# the test suite (~100 MB) is left out of the prefix: it is not needed to run anything
make -s altinstall >"$work/install.log" 2>&1 || { tail -30 "$work/install.log" >&2; exit 1; }
rm -rf "$PREFIX/lib/python3.13t/test" "$PREFIX/lib/python3.13t/idlelib/idle_test"
"$PY" -c 'import sys, sysconfig; assert sysconfig.get_config_var("Py_GIL_DISABLED"); assert not sys._is_gil_enabled()'
echo "$PY"
