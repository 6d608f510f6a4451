#!/usr/bin/env bash
# Create .venv and install eagle-data with the given extras (default: dev). Idempotent.
#   bash scripts/setup.sh            -> .[dev]
#   bash scripts/setup.sh dev,sglang -> .[dev,sglang]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)
stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')-$hash"
# an install of these extras and more (e.g. dev,sglang from the test command) serves a call for fewer
for other in .venv/.installed-*-"$hash"; do
  [ -f "$other" ] || continue
  have=$(basename "$other"); have=",${have#.installed-}"; have="${have%-$hash},"; have="${have//-/,}"
  missing=0
  for e in ${extras//,/ }; do [[ "$have" == *",$e,"* ]] || missing=1; done
  [ $missing = 0 ] && stamp="$other" && break
done
if [ ! -f "$stamp" ]; then
  echo "setup: installing eagle-data[${extras}] into .venv (torch and friends, ~6 GB: minutes on a fresh machine)..."
  .venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  # setuptools' "Editable installation" banner (a note about editable installs, not a problem) is dropped
  .venv/bin/python -m pip install --quiet -e ".[${extras}]" 2>&1 | grep -v "^WARNING: Location" \
    | awk '/BuildBackendWarning: Editable installation/ {skip=1} !skip {print} /with strategy, WheelFile/ {skip=0}' || true
  if [[ ",$extras," == *",dev,"* ]]; then
    # The vLLM-format export is tested with the speculators package's own loader. Its wheel with
    # --no-deps (it requires torchaudio/torchvision, GBs its loader never touches, and an older
    # datasets); its light import-time dependencies normally.
    .venv/bin/python -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" \
      2>&1 | grep -v "^WARNING: Location" || true
    # pip then reports speculators' requirements it did not install (torchaudio, ...): expected here
    .venv/bin/python -m pip install --quiet "openai>=2.0.0" "loguru>=0.7.2,<=0.7.3" "pydantic>=2" \
      "pydantic-settings>=2" "typer>=0.12" aiohttp psutil protobuf click 2>&1 | grep -v "^WARNING: Location" \
      | grep -v -E "^ERROR: pip's dependency resolver does not currently take into account|^speculators 0\.9\.0 requires " || true
    .venv/bin/python -c "import speculators" 2>/dev/null || echo "setup: speculators does not import; its export test will be skipped"
  fi
  .venv/bin/python -c "import eagle_data, torch, webdataset, datasets, lightning" 
  touch "$stamp"
  echo "setup: done"
fi
