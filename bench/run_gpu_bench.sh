#!/usr/bin/env bash
# (The 2026-11-30 harness of the levers. Issue 16's trainer-vs-ZeRO-2/FSDP2 run is bench/run_2gpu_bench.sh.)
# One command for the whole GPU benchmark on a 2-GPU machine (H200 x2 measured):
#   bash bench/run_gpu_bench.sh [phase ...]      phases: env checks baselines best repeat causal levers levers2 extra
#   (default: all but env; about 25 minutes on 2 x H200)
# Results: one JSON per row under $BENCH_OUT (default ./bench_out), a markdown table printed last.
# Needs python3 with torch, transformers, deepspeed, liger-kernel (a folder of wheels in $WHEELS,
# default .whl/, is installed to /tmp/site first when deepspeed is missing).
set -uo pipefail
cd "$(dirname "$0")/.."

source bench/gpu_env.sh || exit 1
NGPU=${NGPU:-2}

T=bench/train_throughput.py
TR="$PY -m torch.distributed.run --standalone --nproc_per_node $NGPU"
SEQ=4096
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-2}

row() {  # row NAME TIMEOUT_S LAUNCHER ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout -k 10 "$limit" "$@" --label "$name" --seq-len $SEQ --steps "$STEPS" --warmup "$WARMUP" \
      --out "$BENCH_OUT/row_$name.json" > "$BENCH_OUT/log_$name.txt" 2>&1
  local rc=$?
  grep -E "^RESULT|Error|error:|OOM|out of memory" "$BENCH_OUT/log_$name.txt" | head -5
  [ $rc -ne 0 ] && { echo "row $name: exit $rc"; tail -15 "$BENCH_OUT/log_$name.txt"; }
  return 0
}

pipe() {  # pipe NAME TIMEOUT_S ARGS...   (the project's trainer, 2 stages, its one engine builder;
  # the hand-built `--setup pipeline` engine of the 2026-11-30 rows in bench/RESULTS.md is gone)
  local name=$1 limit=$2; shift 2
  row "$name" "$limit" $TR $T --setup trainer --stages 2 "$@"
}

phases=${*:-checks baselines best repeat causal levers levers2 extra}
for phase in $phases; do
  case $phase in
    env)
      nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv
      nvidia-smi topo -m 2>/dev/null | head -5
      ;;
    checks)
      echo "=== checks ($(date +%T))"
      # pass/fail: the tests marked gpu (every measured value printed and in checks.xml's properties);
      # then the kernel timings (kernel_bench.json)
      timeout -k 10 420 $PY -m pytest -q -rA -p no:cacheprovider -m gpu --junitxml "$BENCH_OUT/checks.xml" \
          tests/test_gpu_kernels.py tests/test_gpu_pipeline.py 2>&1 | grep -E "PASS|FAIL|loss|Error|passed|failed|skipped" | tail -60
      timeout -k 10 240 $PY bench/kernel_bench.py --out "$BENCH_OUT" 2>&1 | grep -vE "Warning|warn\(" | tail -40
      ;;
    baselines)
      row hf_single 240 $PY $T --setup hf_single --micro-batch 4 --act-ckpt 1
      row hf_zero2 300 $TR $T --setup hf_zero2 --micro-batch 2 --act-ckpt 1
      ;;
    best)  # the trainer with its fastest settings, packed documents with the document mask
      pipe pipe_best 330 --micro-batch 2 --grad-accum 32 --attention torch_varlen --kernels liger
      ;;
    extra)  # the trainer's flex-attention backend; the ZeRO-2 baseline without the window mask
      pipe lever_m16_flex 200 --micro-batch 2 --grad-accum 16 --attention flex --kernels liger
      row hf_zero2_no_window 150 $TR $T --setup hf_zero2 --micro-batch 2 --act-ckpt 1 --sliding-window none
      ;;
    repeat)  # the headline row again in the same lease: run-to-run spread
      pipe pipe_best_rerun 330 --micro-batch 2 --grad-accum 32 --attention torch_varlen --kernels liger
      ;;
    causal)  # same, one plain causal document per row: what the document mask costs (or saves)
      pipe pipe_best_causal 330 --micro-batch 2 --grad-accum 32 --attention torch_varlen --kernels liger --docs causal
      ;;
    levers)  # one lever changed at a time against lever_m16 (16 micro-batches, to fit the lease)
      pipe lever_m16 240 --micro-batch 2 --grad-accum 16 --attention torch_varlen --kernels liger
      pipe lever_m16_no_liger 240 --micro-batch 2 --grad-accum 16 --attention torch_varlen --kernels none
      pipe lever_m16_sdpa_dense 240 --micro-batch 2 --grad-accum 16 --attention sdpa --kernels none
      pipe lever_m16_ckpt 240 --micro-batch 2 --grad-accum 16 --attention torch_varlen --kernels liger --act-ckpt 1
      ;;
    levers2)
      pipe lever_mb1_m32 240 --micro-batch 1 --grad-accum 32 --attention torch_varlen --kernels liger
      pipe lever_mb3_m22 300 --micro-batch 3 --grad-accum 22 --attention torch_varlen --kernels liger
      row hf_single_no_window 240 $PY $T --setup hf_single --micro-batch 4 --act-ckpt 1 --sliding-window none
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
echo "=== table"
$PY bench/report.py "$BENCH_OUT"
