#!/usr/bin/env bash
# Create .venv when missing and install the package with its extras.
# torch==2.13.0 comes first so pip takes the CPU build this machine already holds
# instead of resolving a multi-GB CUDA build as a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
