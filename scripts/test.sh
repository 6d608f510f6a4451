#!/usr/bin/env bash
# Set up (with the sglang extra, which runs SGLang on CPU) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,sglang
# one line per test file with its progress, the 15 slowest tests at the end
exec .venv/bin/python -m pytest --durations=15 "$@"
