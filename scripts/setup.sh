#!/usr/bin/env bash
# Create .venv and install eagle-data with the given extras (default: dev). Idempotent.
#   bash scripts/setup.sh            -> .[dev]
#   bash scripts/setup.sh dev,sglang -> .[dev,sglang]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
PY="${PYTHON:-python3}"
# one setup at a time per checkout: two pips writing one .venv at once break it
if command -v flock >/dev/null; then
  exec 9>"${TMPDIR:-/tmp}/eagle-data-setup-$(pwd | cksum | cut -d' ' -f1).lock"
  flock 9
fi

# pip showing only its warnings and errors, known noise dropped (an index warning, the requirements
# of speculators' --no-deps wheel); a failing pip fails the call with its whole output
pip_q() {
  local log rc=0
  log=$(mktemp)
  .venv/bin/python -m pip "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    cat "$log" >&2; rm -f "$log"
    echo "setup: pip $* failed (exit $rc, output above)" >&2
    return "$rc"
  fi
  grep -E "^(WARNING|ERROR)" "$log" | grep -v -E "^WARNING: Location|^ERROR: pip's dependency resolver does not currently take into account" || true
  rm -f "$log"
}
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
  pip_q install --quiet --upgrade pip || echo "setup: pip could not upgrade itself; going on with the one there"
  pip_q install -e ".[${extras}]"  # (not --quiet: a failure shows pip's reasons, e.g. which requirement conflicts)
  if [[ ",$extras," == *",dev,"* ]]; then
    # The vLLM-format export is tested with the speculators package's own loader. Its wheel with
    # --no-deps (it requires torchaudio/torchvision, GBs its loader never touches, and an older
    # datasets); its light import-time dependencies normally.
    # (optional: without them only that test is skipped, said below)
    pip_q install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" || true
    # pip then reports speculators' requirements it did not install (torchaudio, ...): expected here
    pip_q install --quiet "openai>=2.0.0" "loguru>=0.7.2,<=0.7.3" "pydantic>=2" \
      "pydantic-settings>=2" "typer>=0.12" aiohttp psutil protobuf click || true
    .venv/bin/python -c "import speculators" 2>/dev/null || echo "setup: speculators does not import; its export test will be skipped"
  fi
  .venv/bin/python -c "import eagle_data, torch, webdataset, datasets, lightning" 
  touch "$stamp"
  echo "setup: done"
fi
