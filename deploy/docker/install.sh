#!/bin/sh
# The image's install steps in one script: deploy/docker/Dockerfile runs it in its build stage, and
# tests/program/test_deploy.py runs it in a fresh virtual environment (no container engine there).
#
#   sh deploy/docker/install.sh PREFIX     (in a copy of this repository: its root is the current directory)
#
# PREFIX: the virtual environment to install into, made with python3 -m venv unless one is there.
set -eu
prefix="${1:?usage: sh deploy/docker/install.sh PREFIX (the virtual environment to install into)}"
[ -x "$prefix/bin/python" ] || python3 -m venv "$prefix"
# forkless with its JetStream extra (nats-py), from this checkout
"$prefix/bin/python" -m pip install --no-input ".[nats]"
# the console script runs: it lists every variable without starting JAX
"$prefix/bin/forkless" --help > /dev/null
