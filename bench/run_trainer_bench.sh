#!/usr/bin/env bash
# One-GPU throughput comparison on the one-stage slice of Mistral-7B (issue 17): 16 decoder layers
# + embedding + head (3.75 B parameters), seq 4096, micro-batch 2 x 16, plain causal rows unless a
# row says packed. All rows in one run, same model shape and rows:
#   bash bench/run_trainer_bench.sh [phase ...]    phases: main checks extra levers levers2 ckpt wgrad
#                                                  fp8 fp8parity fp8speed trainer_mb4 baselines
#                                                  packedfp8 mb4
#                                                  (default: main checks extra)
# main:   the trainer (training/train.py's own setup + loader, fp32 grad accumulation) vs the plain
#         HF loop with Liger + window-free SDPA + no recompute, (a) pure bf16, (b) fp32 master weights
# checks: the GPU correctness checks against their limits (`pytest -m gpu`: tests/test_gpu_kernels.py)
# extra:  the trainer on packed documents; the trainer with bf16 gradient accumulation
# levers: issue 17's levers beside the baselines (profiles of the trainer and HF bf16 steps;
#         host syncs + pageable copies as before; compiled decoder layers; compiled + bf16 accum)
# levers2: the trainer with the levers the profile pointed at (defaults), the two HF loops, and the
#         trainer with the varlen kernel on whole-document rows (isolates the attention lever)
# ckpt:   the trainer's checkpoint save stall, async vs synchronous (CKPT_LAYERS-layer slice): the
#         first save and a second one (host buffers reused)
# wgrad:  the trainer (defaults: the weight-gradient GEMM accumulates into the fp32 buffer) and the
#         trainer without that (train.fused_wgrad_accumulation off) beside the two HF loops; its GPU
#         check and kernel timing first
# fp8:    train.fp8 tensorwise / rowwise (with compile_layers, which fuses the casts), 16 layers
# fp8parity: 200 steps (PARITY_STEPS) of bf16 vs fp8 tensorwise vs rowwise on a PARITY_LAYERS-layer
#         slice at lr 1e-4 (PARITY_LR); PARITY_DATA=DIR: real text (bench/parity_corpus.py), else a
#         repeating random-token pool (the loss falls: memorisation); losses compared
# fp8speed: the trainer's bf16 and fp8 tensorwise rows at 2 x 16 and 4 x 8 (no HF rows: see main)
# trainer_mb4 / baselines: fp8speed's last row / main's two HF rows, alone
# packedfp8: packed rows, 4 layers: bf16 vs fp8 tensorwise + compile_layers (dynamic document counts)
# mb4:    micro-batch 4 x 8 (same tokens per step): the trainer and the two HF loops
# longctx: issue 29, window-free model (Mistral v0.2/v0.3 shape: full attention credit is honest),
#         mb 1: seq LC_SEQ (16384) x LC_GA (4) with train.recompute auto / none / full / every_n 2 /
#         mlp / attention (LC_MODES), then seq LC_SEQ_LONG (32768) x LC_GA_LONG (2) with auto / none
#         (LC_LONG_MODES; OOM recorded); the bf16 logits parity at 8192 with a 4096 window first
# Results: $BENCH_OUT/row_*.json + logs, the table printed last (bench/report.py).
set -uo pipefail
cd "$(dirname "$0")/.."

source bench/gpu_env.sh || exit 1
LAYERS=${LAYERS:-16}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-2}

T=bench/train_throughput.py
TR="$PY -m torch.distributed.run --standalone --nproc_per_node 1"
common() {  # common LAYERS MICRO_BATCH GRAD_ACCUM STEPS WARMUP [SEQ]: the settings every row of a phase shares
  COMMON=(--model "${MODEL:-7b}" --layers "$1" --seq-len "${6:-4096}" --micro-batch "$2" --grad-accum "$3"
          --steps "$4" --warmup "$5")
}
common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
HF=(--setup hf_single --hf-liger --sliding-window none --act-ckpt 0 --docs causal)

row() {  # row NAME TIMEOUT_S LAUNCHER ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout -k 10 "$limit" "$@" "${COMMON[@]}" --label "$name" --out "$BENCH_OUT/row_$name.json" \
      > "$BENCH_OUT/log_$name.txt" 2>&1
  local rc=$?
  grep -E "^RESULT|Error|error:|OOM|out of memory" "$BENCH_OUT/log_$name.txt" | grep -v Warning | head -5
  [ $rc -ne 0 ] && { echo "row $name: exit $rc"; tail -8 "$BENCH_OUT/log_$name.txt"; }
  return 0
}

TRAINER=($T --setup trainer --stages 1 --docs causal --attention auto --kernels auto)
for phase in ${*:-main checks extra}; do
  case $phase in
    main)
      row trainer 200 $TR "${TRAINER[@]}"
      row hf_bf16 150 $PY $T "${HF[@]}" --master bf16
      row hf_fp32_master 150 $PY $T "${HF[@]}" --master fp32
      ;;
    levers)  # issue 17's levers, each a row beside the baselines; the first two are profiled too
      row trainer 200 $TR "${TRAINER[@]}" --profile "$BENCH_OUT/prof_trainer.txt"
      row hf_bf16 150 $PY $T "${HF[@]}" --master bf16 --profile "$BENCH_OUT/prof_hf_bf16.txt"
      row trainer_compiled 240 $TR "${TRAINER[@]}" --compile-layers 1
      row trainer_syncs_pageable 160 $TR "${TRAINER[@]}" --sync-free 0 --pin-memory 0
      ;;
    levers2)  # after the profile: cuDNN SDPA on whole-document rows + fused fp32 accumulation (defaults)
      row trainer 200 $TR "${TRAINER[@]}" --profile "$BENCH_OUT/prof_trainer.txt"
      row hf_bf16 150 $PY $T "${HF[@]}" --master bf16
      row hf_fp32_master 150 $PY $T "${HF[@]}" --master fp32
      row trainer_varlen_attention 200 $TR "${TRAINER[@]}" --causal-rows-sdpa 0
      ;;
    ckpt)  # the save stall, async vs synchronous, on a $CKPT_LAYERS-layer slice (a 16-layer checkpoint is ~60 GB)
      # CKPT_STEPS steps first: the host-memory reservation (background, from setup) has time to finish
      common "${CKPT_LAYERS:-2}" 2 16 "${CKPT_STEPS:-12}" 1
      row trainer_ckpt_async 240 $TR "${TRAINER[@]}" --checkpoint --async-checkpoint 1
      [ "${CKPT_SYNC:-1}" = 1 ] && row trainer_ckpt_sync 240 $TR "${TRAINER[@]}" --checkpoint --async-checkpoint 0
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    wgrad)
      echo "=== wgrad check ($(date +%T))"
      timeout -k 10 120 $PY -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu_kernels.py -k wgrad 2>&1 \
        | grep -E "PASS|FAIL|Error|passed|failed" | head -8
      timeout -k 10 120 $PY bench/kernel_bench.py --only wgrad --out "$BENCH_OUT/wgrad_check" 2>&1 | grep -E "wgrad|Error" | head -4
      row trainer 200 $TR "${TRAINER[@]}"
      row hf_bf16 150 $PY $T "${HF[@]}" --master bf16
      row trainer_wgrad_unfused 200 $TR "${TRAINER[@]}" --fused-wgrad 0
      row hf_fp32_master 150 $PY $T "${HF[@]}" --master fp32
      ;;
    fp8)
      row trainer_fp8_tensorwise 300 $TR "${TRAINER[@]}" --fp8 tensorwise --compile-layers 1
      row trainer_fp8_rowwise 300 $TR "${TRAINER[@]}" --fp8 rowwise --compile-layers 1
      ;;
    fp8parity)  # 200 steps; the trainer's fastest bf16 setting vs the two fp8 recipes, same rows and seeds
      common "${PARITY_LAYERS:-4}" 2 4 "${PARITY_STEPS:-200}" 0
      DATA=()  # PARITY_DATA: real text (bench/parity_corpus.py pack); unset: the random-token pool
      [ -n "${PARITY_DATA:-}" ] && DATA=(--data "$PARITY_DATA" --docs packed)
      P=(--lr "${PARITY_LR:-1e-4}" "${DATA[@]}")
      row parity_bf16 300 $TR "${TRAINER[@]}" "${P[@]}"
      row parity_fp8_tensorwise 300 $TR "${TRAINER[@]}" "${P[@]}" --fp8 tensorwise --compile-layers 1
      [ "${PARITY_ROWWISE:-1}" = 1 ] && row parity_fp8_rowwise 300 $TR "${TRAINER[@]}" "${P[@]}" --fp8 rowwise --compile-layers 1
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    fp8speed)  # FP8 against the trainer's own bf16, at 2 x 16 and 4 x 8, same call
      row trainer 200 $TR "${TRAINER[@]}"
      row trainer_fp8_tensorwise 300 $TR "${TRAINER[@]}" --fp8 tensorwise --compile-layers 1
      common "$LAYERS" 4 8 "$STEPS" "$WARMUP"
      row trainer_fp8_tensorwise_mb4 300 $TR "${TRAINER[@]}" --fp8 tensorwise --compile-layers 1
      row trainer_mb4 200 $TR "${TRAINER[@]}"
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    trainer_mb4)  # the trainer's bf16 at 4 x 8 alone (fp8speed's last row)
      common "$LAYERS" 4 8 "$STEPS" "$WARMUP"
      row trainer_mb4 200 $TR "${TRAINER[@]}"
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    baselines)  # the two HF loops of main alone
      row hf_bf16 150 $PY $T "${HF[@]}" --master bf16
      row hf_fp32_master 150 $PY $T "${HF[@]}" --master fp32
      ;;
    packedfp8)  # packed rows (documents per micro-batch vary): fp8 + compiled layers vs bf16, 4 layers
      common 4 2 16 "$STEPS" 3
      row packed_bf16 200 $TR "${TRAINER[@]}" --docs packed
      row packed_fp8_tensorwise 200 $TR "${TRAINER[@]}" --docs packed --fp8 tensorwise --compile-layers 1
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    mb4)
      common "$LAYERS" 4 8 "$STEPS" "$WARMUP"
      row trainer_mb4 200 $TR "${TRAINER[@]}"
      row hf_bf16_mb4 150 $PY $T "${HF[@]}" --master bf16
      row hf_fp32_master_mb4 150 $PY $T "${HF[@]}" --master fp32
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    longctx)
      if [ "${LC_PARITY:-1}" = 1 ]; then
        echo "=== window parity ($(date +%T))"
        timeout -k 10 240 $PY -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu_kernels.py -k window \
            --junitxml "$BENCH_OUT/window_check.xml" 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | head -12
      fi
      LC=("${TRAINER[@]}" --sliding-window none)
      common "$LAYERS" 1 "${LC_GA:-4}" "${LC_STEPS:-3}" 1 "${LC_SEQ:-16384}"
      for m in ${LC_MODES-auto none full every_n mlp attention}; do
        row "lc${LC_SEQ:-16384}_$m" 200 $TR "${LC[@]}" --recompute "$m" --recompute-every "${LC_EVERY:-2}"
      done
      common "$LAYERS" 1 "${LC_GA_LONG:-2}" "${LC_STEPS:-3}" 1 "${LC_SEQ_LONG:-32768}"
      for m in ${LC_LONG_MODES-auto none}; do
        row "lc${LC_SEQ_LONG:-32768}_$m" 200 $TR "${LC[@]}" --recompute "$m" --recompute-every "${LC_EVERY:-2}"
      done
      common "$LAYERS" 2 16 "$STEPS" "$WARMUP"
      ;;
    checks)
      echo "=== checks ($(date +%T))"
      timeout -k 10 150 $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu_kernels.py tests/test_training_fast_kernels.py \
          tests/test_training_flops.py tests/test_bench_metrics.py tests/test_bench_report.py tests/test_bench_train_throughput.py 2>&1 | tail -8
      ;;
    extra)
      row trainer_packed 200 $TR $T --setup trainer --stages 1 --docs packed --attention auto --kernels auto
      row trainer_bf16_accum 200 $TR "${TRAINER[@]}" --grad-accum-dtype bf16
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
echo "=== table"
$PY bench/report.py "$BENCH_OUT"
