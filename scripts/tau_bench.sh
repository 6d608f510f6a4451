#!/usr/bin/env bash
# tau on real data after fixed training time (issue 14), end to end on one machine:
#   prep     ShareGPT rows [0, N) -> OUT/train.jsonl, rows [17000, 17000+HELD) -> OUT/heldout.jsonl
#            (kept when both files exist already, e.g. carried to a machine without network);
#   regen    (with REGEN=1) SmolLM2 writes every assistant turn of the training rows itself
#            (eagle-data regenerate, greedy, HF generate on DEVICE) -> OUT/regen; extract then
#            reads OUT/regen instead of OUT/train.jsonl (issue 19: original vs regenerated answers);
#   extract  both with SmolLM2 (EXTRACT_ARGS: more `eagle-data extract` options, e.g. "--backend sglang"; bf16 on the GPU; the training set stored as STORAGE, default bfloat16,
#            e.g. float8_e4m3fn for issue 16; FINAL_ROWS=taught stores the final states only where
#            they teach; GRAPHS=1: the prefill through CUDA graphs); the draft vocabulary from the training set;
#   tune     (optional) a short run per variant, side by side, cosine over SWEEP_SECONDS: VARIANTS
#            (one per line, extra `eagle-data train` options, e.g. "--model.lr 1.2e-3 --data.max_tokens
#            65536") or one per lr of LRS; the variant with the lowest training loss (last fifth of the
#            logged steps; a variant that failed or diverged is left out, and said) -> OUT/train_args.txt,
#            the train and control phases' TRAIN_ARGS (an explicit LR still wins). A variant
#            with "--model.zero_features true" is a control, never chosen (EVAL_TUNE="v1 v4" or "all"
#            evaluates those of the tune's checkpoints beside the run's). Training data only: the held-out set is not read;
#   train    configs/train/tau_bench_gpu.yaml, checkpoints after each of MINUTES of training time
#            (the lr cosine spans the last mark; training stops there);
#   control  the same training with the target's features zeroed (zero_features) for the first mark;
#   eval     tau of each checkpoint on the first EVAL_N held-out keys (sorted), 16 positions each,
#            K=7, max_length 2048, beside the untrained drafter and prompt-lookup speculation on the
#            same positions (eagle-data eval, 95 % intervals), all checkpoints at once; then a table.
# Usage: OUT=out/tau N=8769 LRS="3e-4 6e-4 1.2e-3" bash scripts/tau_bench.sh   (GPU; PHASES="extract tune" etc. for parts)
#        OUT=/tmp/tau N=12 HELD=4 MINUTES="0.3 0.6" DEVICE=cpu ACCEL=cpu PRECISION=32-true EVAL_N=2 \
#          TRAIN_ARGS="--data.max_tokens 4096 --data.num_workers 1" bash scripts/tau_bench.sh   (CPU smoke test:
#          ~7 min on 2 cores; the GPU config's 65,536-token batches and 8 workers alone take ~10 GB and
#          minutes per step there)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && export PATH="$PWD/.venv/bin:$PATH"  # scripts/setup.sh's environment, as main.sh uses it
OUT=${OUT:-out/tau}; N=${N:-6000}; HELD=${HELD:-200}; DEVICE=${DEVICE:-cuda}; VOCAB=${VOCAB:-16384}
MINUTES=${MINUTES:-"2 4 8"}; ACCEL=${ACCEL:-gpu}; PRECISION=${PRECISION:-bf16-mixed}; EVAL_N=${EVAL_N:-40}
ALL_PHASES="prep regen extract tune train control eval"
PHASES=${PHASES:-$ALL_PHASES}; REGEN=${REGEN:-0}; LRS=${LRS:-""}; SWEEP_SECONDS=${SWEEP_SECONDS:-60}
CONFIG=${CONFIG:-configs/train/tau_bench_gpu.yaml}
ed() { python -m eagle_data.cli.main "$@"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
PHASES=$(echo $PHASES)  # one space between names (has() matches " name ")
[ -n "$PHASES" ] || { echo "PHASES: empty ($ALL_PHASES)" >&2; exit 2; }
for p in $PHASES; do  # a misspelt phase would be skipped unsaid
  case " $ALL_PHASES " in *" $p "*) ;; *) echo "PHASES: unknown phase '$p' ($ALL_PHASES)" >&2; exit 2;; esac
done
# MINUTES as the checkpoint names write them ({m:g}: "0.050" -> "0.05", "1e-1" -> "0.1"), increasing
MINUTES=$(python - $MINUTES <<'PY'
import math, sys
try:
    m = [float(x) for x in sys.argv[1:]]
except ValueError:
    m = []
names = [f"{x:g}" for x in m]  # the checkpoint names: two marks must not share one
if not m or not all(0 < x < math.inf for x in m) or m != sorted(set(m)) or len(set(names)) < len(m):
    sys.exit(f"MINUTES: numbers > 0, increasing, each once to 6 significant digits (got {' '.join(sys.argv[1:])!r})")
print(" ".join(names))
PY
) || exit 2
first=$(echo "$MINUTES" | awk '{print $1}'); last=$(echo "$MINUTES" | awk '{print $NF}')
mkdir -p "$OUT"

if has prep && ! [ -s "$OUT/train.jsonl" -a -s "$OUT/heldout.jsonl" ]; then
python - "$OUT" "$N" "$HELD" <<'PY'
import json, sys
from eagle_data.extract.sources import iter_records
out, n, held = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(f"{out}/train.jsonl", "w") as tr, open(f"{out}/heldout.jsonl", "w") as ho:
    for row, rec in iter_records("sharegpt", num_samples=17000 + held):
        if row < n or row >= 17000:
            (tr if row < n else ho).write(json.dumps(rec, ensure_ascii=False) + "\n")
PY
fi

if has regen && [ "$REGEN" = 1 ]; then
  ed regenerate --out "$OUT/regen" --data "$OUT/train.jsonl" --device "$DEVICE" --dtype bfloat16 --mode all \
    --max_new_tokens "${REGEN_MAX_NEW:-512}" --max_length 2048 --batch_size "${REGEN_BATCH:-256}" \
    --rows_per_part "${REGEN_PART:-500}" --progress false ${REGEN_ARGS:-} | tail -n 1
fi

if has extract; then
  for part in train heldout; do
    src="$OUT/$part.jsonl"; [ "$part" = train ] && [ "$REGEN" = 1 ] && src="$OUT/regen"
    store=(); [ "$part" = train ] && store=(--storage_dtype "${STORAGE:-bfloat16}" --final_rows "${FINAL_ROWS:-all}")  # held-out: as served (bf16)
    [ "${GRAPHS:-0}" = 1 ] && store+=(--backend_kwargs '{"cuda_graphs": true}')
    # shellcheck disable=SC2086  # EXTRACT_ARGS: more options, e.g. --backend sglang
    ed extract --out "$OUT/$part" --data "$src" --dataset_tag "$part" --device "$DEVICE" \
      --dtype bfloat16 --max_length 2048 --batch_tokens 65536 --progress false "${store[@]}" ${EXTRACT_ARGS:-} | tail -n 1
  done
  ed vocab "$OUT/train" --size "$VOCAB" --out "$OUT/draft_vocab_$VOCAB.safetensors"
fi

# train DIR MINUTES_LIST LR ZERO [extra args...]: one run, checkpoints DIR/at_{m}min.ckpt; LR (when
# given) comes last, so an explicit lr wins over the extra args (e.g. the tune's choice)
train() {
  local dir=$1 marks=$2 lr=$3 zero=$4; shift 4
  local end; end=$(echo "$marks" | awk '{print $NF}')
  local lrarg=(); [ -n "$lr" ] && lrarg=(--model.lr "$lr")
  ed train --config "$CONFIG" --model.dataset_dir "$OUT/train" \
    --model.draft_vocab "$OUT/draft_vocab_$VOCAB.safetensors" --model.draft_vocab_size "$VOCAB" \
    --model.zero_features "$zero" --model.lr_schedule_minutes "$end" \
    --data.train "$OUT/train" --trainer.accelerator "$ACCEL" --trainer.precision "$PRECISION" \
    --trainer.max_time "{\"seconds\": $(python -c "print(int($end * 60 + 600))")}" --trainer.default_root_dir "$dir" \
    --trainer.callbacks "[{\"class_path\": \"eagle_train.callbacks.TimedCheckpoints\", \"init_args\": {\"minutes\": [$(echo "$marks" | tr ' ' ',')], \"stop_after_last\": true}}]" \
    "$@" "${lrarg[@]}"
}

# the variants of the tune: VARIANTS (one per line: extra `eagle-data train` options, split at white
# space, no quoting), or one per lr of LRS; an explicit LR is each variant's lr unless it sets one
if [ -z "${VARIANTS:-}" ] && [ -n "$LRS" ]; then VARIANTS=$(for lr in $LRS; do echo "--model.lr $lr"; done); fi
if has tune && [ -n "${VARIANTS:-}" ]; then
  mins=$(python -c "print($SWEEP_SECONDS / 60)")
  rm -rf "$OUT/tune" "$OUT/lr.txt" "$OUT/train_args.txt" "$OUT/tune.json"; mkdir -p "$OUT/tune"; i=0; pids=()
  base=(); [ -n "${LR:-}" ] && base=(--model.lr "$LR")  # before each variant's options: a variant's lr wins
  while IFS= read -r v; do
    [ -n "${v// /}" ] || continue; i=$((i + 1)); d="$OUT/tune/v$i"; mkdir -p "$d"; echo "$v" > "$d/args.txt"
    # shellcheck disable=SC2086  # a variant is a list of options
    train "$d" "$mins" "" false --data.num_workers "${TUNE_WORKERS:-3}" --trainer.logger \
      "{\"class_path\": \"lightning.pytorch.loggers.CSVLogger\", \"init_args\": {\"save_dir\": \"$d\"}}" \
      --trainer.log_every_n_steps 10 "${base[@]}" $v > "$d.log" 2>&1 &
    pids+=("$!")
  done <<< "$VARIANTS"
  for j in "${!pids[@]}"; do  # a variant that failed (e.g. out of memory late in its run) is not a candidate
    wait "${pids[$j]}" || echo "failed" > "$OUT/tune/v$((j + 1))/failed"
  done
  python - "$OUT" <<'PY'
import csv, glob, json, math, os, re, statistics, sys
out = sys.argv[1]
res, left = {}, []
for d in sorted(glob.glob(f"{out}/tune/v*/"), key=lambda p: int(p.rstrip("/").rsplit("v", 1)[1])):
    args, log = open(f"{d}args.txt").read().strip(), d.rstrip("/") + ".log"
    if os.path.exists(f"{d}failed"):  # a control too: said, though never a candidate
        left.append(f"{args!r} failed (see {log})")
        continue
    if re.search(r"--model\.zero_features(=|\s+)true\b", args):  # a control, not a candidate (EVAL_TUNE scores it)
        continue
    paths = glob.glob(f"{d}**/metrics.csv", recursive=True)
    rows = [r for p in paths for r in csv.DictReader(open(p)) if r.get("train/loss_step")]
    tail = [float(r["train/loss_step"]) for r in rows[-max(1, len(rows) // 5):]]
    if not rows or not all(map(math.isfinite, tail)):
        left.append(f"{args!r} " + ("diverged (non-finite loss)" if rows else "logged no training loss") + f" (see {log})")
        continue
    res[args] = {"loss": statistics.fmean(tail), "steps": int(rows[-1]["step"])}
for why in left:
    print("tune: left out:", why)
if not res:
    sys.exit("tune: no candidate (every variant failed, diverged or is a features-zeroed control): "
             "nothing chosen, OUT/train_args.txt not written")
best = min(res, key=lambda k: res[k]["loss"])
json.dump({"runs": res, "left_out": left, "best": best}, open(f"{out}/tune.json", "w"), indent=1)
open(f"{out}/train_args.txt", "w").write(best)
print("tune (training loss, last fifth of logged steps):",
      "; ".join(f"{k}: {v['loss']:.4f} ({v['steps']} steps)" for k, v in res.items()), "-> best:", best)
PY
fi
LR=${LR:-$(cat "$OUT/lr.txt" 2>/dev/null || true)}

# TRAIN_ARGS: more `eagle-data train` options for the run and the control (e.g. "--model.loss.step_weight 0.9");
# default: the tune's best variant (OUT/train_args.txt), when there was a tune
TRAIN_ARGS=${TRAIN_ARGS:-$(cat "$OUT/train_args.txt" 2>/dev/null || true)}
if has train; then train "$OUT/run" "$MINUTES" "$LR" false ${TRAIN_ARGS:-}; fi
if has control; then train "$OUT/run_zero" "$first" "$LR" true ${TRAIN_ARGS:-}; fi

if has eval; then
  evals=()  # "checkpoint (relative to OUT) name compare_untrained"
  for m in $MINUTES; do
    if [ -f "$OUT/run/at_${m}min.ckpt" ]; then evals+=("run/at_${m}min.ckpt eval_${m}min $([ "$m" = "$first" ] && echo true || echo false)")
    else echo "eval: no checkpoint $OUT/run/at_${m}min.ckpt (not trained, or stopped before ${m} minutes)"; fi
  done
  if [ -f "$OUT/run_zero/at_${first}min.ckpt" ]; then evals+=("run_zero/at_${first}min.ckpt eval_zero_${first}min false")
  elif has control || [ -d "$OUT/run_zero" ]; then echo "eval: no control checkpoint $OUT/run_zero/at_${first}min.ckpt"; fi
  for v in ${EVAL_TUNE:-}; do  # the tune's runs too ("v1 v4", or "all"; e.g. a features-zeroed control)
    [ "$v" = all ] && v=$(cd "$OUT/tune" 2>/dev/null && ls -d v*/ | tr -d / || true)
    for w in $v; do
      c=$(ls "$OUT/tune/$w"/at_*min.ckpt 2>/dev/null | head -n 1 || true)
      if [ -n "$c" ]; then evals+=("${c#"$OUT"/} eval_tune_$w false"); else echo "eval: tune variant $w has no checkpoint"; fi
    done
  done
  [ "${#evals[@]}" -gt 0 ] || { echo "eval: no checkpoint to evaluate under $OUT" >&2; exit 1; }
  names=()
  for e in "${evals[@]}"; do
    set -- $e
    rm -rf "${OUT:?}/$2"; names+=("$2")  # no result of an earlier call is shown as this one's
    { ed eval "$OUT/heldout" "$OUT/$1" --out "$OUT/$2" --heldout_fraction 1.0 --num_samples "$EVAL_N" \
        --positions_per_sample 16 --steps 7 --max_length 2048 --device "$DEVICE" --compare_untrained "$3" \
        > "$OUT/$2.log" 2>&1 && echo "$1" > "$OUT/$2/checkpoint.txt"; } &
  done
  wait
  python - "$OUT" "${names[@]}" <<'PY'
import json, os, sys, torch
out, names = sys.argv[1], sys.argv[2:]
print("| drafter | train steps | tau | 95 % interval | chains | P(accept >= 1) |")
print("|---|---|---|---|---|---|")
seen = set()
for name in names:
    label_name = name[5:]
    if label_name.startswith("tune_"):  # name the variant by its options
        label_name += f" ({open(f'{out}/tune/{label_name[5:]}/args.txt').read().strip()})"
    if not os.path.exists(f"{out}/{name}/checkpoint.txt"):
        print(f"| trained {label_name} | - | failed (see {out}/{name}.log) | - | - | - |")
        continue
    ckpt = f"{out}/" + open(f"{out}/{name}/checkpoint.txt").read().strip()
    steps = torch.load(ckpt, map_location="cpu", weights_only=True).get("global_step", "?")
    for who, r in json.load(open(f"{out}/{name}/acceptance.json")).items():
        if not isinstance(r, dict) or "tau" not in r or (who != "trained" and who in seen):
            continue  # the untrained drafter and prompt lookup: same positions in every eval, shown once
        seen.add(who)
        label = {"trained": f"trained {label_name}", "untrained": "untrained", "prompt_lookup": "prompt lookup"}[who]
        lo, hi = r["tau_ci95"] or ("-", "-")
        print(f"| {label} | {steps if who == 'trained' else '-'} | {r['tau']:.3f} | [{lo}, {hi}] | "
              f"{r['num_chains']} | {r['accept_at_least'][0]:.3f} |")
PY
fi
