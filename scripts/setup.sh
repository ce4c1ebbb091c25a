#!/usr/bin/env bash
# Create .venv and install gspo into it. torch==2.13.0 (the CPU wheel) goes in first so that
# resolving the project's torch range never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,math,data,bench]" "$@"
