#!/usr/bin/env bash
# tau on real data after fixed training time (issue 14), end to end on one machine:
#   1. ShareGPT rows [0, N) -> OUT/train.jsonl, rows [17000, 17200) -> OUT/heldout.jsonl (the held-out set);
#   2. extract both with SmolLM2 (bf16 on the GPU), build the draft vocabulary from the training set;
#   3. train with configs/train/tau_bench_gpu.yaml, checkpoints after 2, 4 and 8 minutes of training;
#   4. tau of each checkpoint on the first 40 held-out keys (sorted), 16 positions each, K=7,
#      max_length 2048, beside the untrained drafter and prompt-lookup speculation on the same
#      positions (eagle-data eval), with 95 % intervals.
# Usage: OUT=out/tau N=6000 bash scripts/tau_bench.sh          (GPU)
#        OUT=/tmp/tau N=12 HELD=4 MINUTES="0.05 0.1" DEVICE=cpu ACCEL=cpu PRECISION=32-true bash scripts/tau_bench.sh  (smoke test)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/tau}; N=${N:-6000}; HELD=${HELD:-200}; DEVICE=${DEVICE:-cuda}; VOCAB=${VOCAB:-16384}
MINUTES=${MINUTES:-"2 4 8"}; ACCEL=${ACCEL:-gpu}; PRECISION=${PRECISION:-bf16-mixed}; EVAL_N=${EVAL_N:-40}
ed() { python -m eagle_data.cli.main "$@"; }
mkdir -p "$OUT"
python - "$OUT" "$N" "$HELD" <<'PY'
import json, sys
from eagle_data.extract.sources import iter_records
out, n, held = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(f"{out}/train.jsonl", "w") as tr, open(f"{out}/heldout.jsonl", "w") as ho:
    for row, rec in iter_records("sharegpt", num_samples=17000 + held):
        if row < n or row >= 17000:
            (tr if row < n else ho).write(json.dumps(rec, ensure_ascii=False) + "\n")
PY
for part in train heldout; do
  ed extract --out "$OUT/$part" --data "$OUT/$part.jsonl" --dataset_tag "$part" --device "$DEVICE" \
    --dtype bfloat16 --max_length 2048 --batch_tokens 65536 --progress false | tail -n 1
done
ed vocab "$OUT/train" --size "$VOCAB" --out "$OUT/train/draft_vocab_$VOCAB.safetensors"
last=$(echo "$MINUTES" | awk '{print $NF}')
marks="[$(echo "$MINUTES" | tr ' ' ',')]"
secs=$(python -c "print(int($last * 60 + 30))")
ed train --config configs/train/tau_bench_gpu.yaml --model.dataset_dir "$OUT/train" \
  --model.draft_vocab "$OUT/train/draft_vocab_$VOCAB.safetensors" --model.draft_vocab_size "$VOCAB" \
  --data.train "$OUT/train" --trainer.accelerator "$ACCEL" --trainer.precision "$PRECISION" \
  --trainer.max_time "{\"seconds\": $secs}" --trainer.default_root_dir "$OUT/run" \
  --trainer.callbacks "[{\"class_path\": \"eagle_train.callbacks.TimedCheckpoints\", \"init_args\": {\"minutes\": $marks}}]"
for m in $MINUTES; do
  ed eval "$OUT/heldout" "$OUT/run/at_${m}min.ckpt" --out "$OUT/eval_${m}min" --heldout_fraction 1.0 \
    --num_samples "$EVAL_N" --positions_per_sample 16 --steps 7 --max_length 2048 --device "$DEVICE" \
    --compare_untrained "$([ "$m" = "$(echo $MINUTES | awk '{print $1}')" ] && echo true || echo false)"
done
