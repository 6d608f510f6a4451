#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md (issues 7 and 8) on a machine with 1 or 2+ GPUs.
# No download: the target is a random-weight Llama-3.1-8B-shaped model with the SmolLM2 tokenizer
# (scripts/make_random_target.py); the data are the first ShareGPT records.
#   PHASES="bench multi loader train ddp" OUT=/tmp/figs TOK=tok_dir DATA=chats.jsonl bash scripts/gpu_runs.sh
# Knobs: N (source rows), ROUNDS and LOADER_WORKERS (bench loader), TRAIN_WORKERS (e.g. "4 0"), STEPS.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; W=${WORK:-/tmp/eagle_gpu}; TOK=${TOK:-.gpu/tok}; DATA=${DATA:-.gpu/sharegpt_800.jsonl}
N=${N:-200}; STEPS=${STEPS:-30}; PHASES=${PHASES:-bench multi loader train ddp}
mkdir -p "$OUT" "$W"
ed() { python3 -m eagle_data.cli.main "$@"; }
bench() { python3 -m benchmarks "$@"; }
ms() { date +%s%N; }
took() { echo "  [$(( ($(ms) - $1) / 1000000 )) ms] $2" | tee -a "$OUT/timings.txt"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
NG=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "gpus: $NG"
common=(--model "$W/target" --data "$DATA" --num_samples "$N" --device cuda --dtype bfloat16 --max_length 2048
        --batch_tokens 32768 --shard_max_samples 64 --progress false)
need_target() { [ -f "$W/target/config.json" ] || { s=$(ms); python3 scripts/make_random_target.py "$W/target" --tokenizer "$TOK" | tail -1; took $s make_target; }; }
need_x1() {
  need_target
  [ -f "$W/x1/manifest.json" ] || { s=$(ms); CUDA_VISIBLE_DEVICES=0 ed extract --out "$W/x1" "${common[@]}" 2>&1 \
    | grep -E "extracted|dataset" | tee "$OUT/extract_1rank.txt"; took $s extract_1rank; }
}

if has bench; then  # issue 7: (a) plain (b) capture->host (c) capture+shards on local disk (d) raw disk
  for w in ${BENCH_WRITERS:-2}; do
    s=$(ms); bench extract --writers $w --json_out "$OUT/bench_extract_w$w.json" 2>&1 | grep -v Warn; took $s bench_extract_w$w
  done
fi
if has multi; then  # issue 8.1: one rank on GPU 0, then two ranks on GPUs 0 and 1 over the same rows
  need_x1
  if [ "$NG" -ge 2 ]; then
    s=$(ms)
    for r in 0 1; do
      CUDA_VISIBLE_DEVICES=$r python3 -m eagle_data.cli.main extract --out "$W/x2" --rank $r --world_size 2 "${common[@]}" \
        2>&1 | grep -E "extracted|dataset" > "$OUT/extract_2rank_r$r.txt" &
    done
    wait; took $s extract_2ranks_wall
    cat "$OUT"/extract_2rank_r*.txt
    ed verify "$W/x2" 2>&1 | tail -12 | tee "$OUT/verify_2rank.txt"
    python3 - "$W/x1" "$W/x2" <<'PY' | tee "$OUT/keys_compare.txt"
import sys, eagle_data
a, b = (set(eagle_data.load_index(p)["key"]) for p in sys.argv[1:3])
r = eagle_data.load_index(sys.argv[2])
r0 = {k for k, s in zip(r["key"], r["shard"]) if s.startswith("00000-")}
r1 = {k for k, s in zip(r["key"], r["shard"]) if s.startswith("00001-")}
print({"single_rank": len(a), "two_rank_union": len(b), "equal": a == b, "rank0": len(r0), "rank1": len(r1),
       "disjoint": not (r0 & r1)})
PY
  fi
fi
if has loader; then  # issue 7.3: loader vs raw sequential read of the same shards
  need_x1; s=$(ms)
  bench loader "$W/x1" --workers "${LOADER_WORKERS:-[0,2,4]}" --rounds "${ROUNDS:-2}" --json_out "$OUT/bench_loader.json" 2>&1 | tail -24 | tee "$OUT/bench_loader.txt"
  took $s bench_loader
fi
if has train; then  # issue 7.3: drafter step time with the DataModule vs batch held on the GPU
  need_x1
  for nw in ${TRAIN_WORKERS:-4}; do
    s=$(ms)
    bench train "$W/x1" "$W/target" --steps "$STEPS" --num_workers "$nw" --json_out "$OUT/bench_train_w$nw.json" 2>&1 | tail -15
    took $s bench_train_w$nw
  done
fi
if has ddp; then  # issue 8.2: DDP drafter training, 1 GPU vs 2 GPUs
  need_x1
  for d in 1 2; do
    [ "$d" -le "$NG" ] || continue
    s=$(ms); python3 scripts/ddp_scaling.py "$W/x1" "$W/target" --devices $d --steps "$STEPS" --out "$OUT/ddp_$d.json" 2>&1 | tail -1
    took $s ddp_$d
  done
fi
