#!/usr/bin/env bash
# One-GPU throughput comparison on the one-stage slice of Mistral-7B (issue 17): 16 decoder layers
# + embedding + head (3.75 B parameters), seq 4096, micro-batch 2 x 16, plain causal rows unless a
# row says packed. All rows in one run, same model shape and rows:
#   bash bench/run_trainer_bench.sh [phase ...]    phases: main checks extra   (default: all)
# main:   the trainer (training/train.py's own setup + loader, fp32 grad accumulation) vs the plain
#         HF loop with Liger + window-free SDPA + no recompute, (a) pure bf16, (b) fp32 master weights
# checks: the GPU correctness checks against their limits (tests/test_gpu_checks.py)
# extra:  the trainer on packed documents; the trainer with bf16 gradient accumulation
# Results: $BENCH_OUT/row_*.json + logs, the table printed last (bench/report.py).
set -uo pipefail
cd "$(dirname "$0")/.."

BENCH_OUT=${BENCH_OUT:-bench_out}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-16}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-2}
mkdir -p "$BENCH_OUT"

# NVLink multicast stays off (shared hosts); the same allocator setting for every row.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if ! $PY -c "import deepspeed" 2>/dev/null && [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

T=bench/train_throughput.py
TR="$PY -m torch.distributed.run --standalone --nproc_per_node 1"
COMMON=(--model 7b --layers "$LAYERS" --seq-len 4096 --micro-batch 2 --grad-accum 16 --steps "$STEPS" --warmup "$WARMUP")
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

for phase in ${*:-main checks extra}; do
  case $phase in
    main)
      row trainer 200 $TR $T --setup trainer --stages 1 --docs causal --attention auto --kernels auto
      row hf_bf16 150 $PY $T "${HF[@]}" --master bf16
      row hf_fp32_master 150 $PY $T "${HF[@]}" --master fp32
      ;;
    checks)
      echo "=== checks ($(date +%T))"
      timeout -k 10 150 $PY -m pytest -q -p no:cacheprovider tests/test_gpu_checks.py 2>&1 | tail -4
      ;;
    extra)
      row trainer_packed 200 $TR $T --setup trainer --stages 1 --docs packed --attention auto --kernels auto
      row trainer_bf16_accum 200 $TR $T --setup trainer --stages 1 --docs causal --attention auto --kernels auto \
          --grad-accum-dtype bf16
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
echo "=== table"
$PY bench/report.py "$BENCH_OUT"
