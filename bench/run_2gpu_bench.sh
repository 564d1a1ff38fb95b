#!/usr/bin/env bash
# Issue 16 in one command, one lease, on 2 x H200: Mistral-7B (random bf16 weights), seq 4096,
# global batch 2 x 32 x 4096 = 262,144 tokens per step in every row.
#   bash bench/run_2gpu_bench.sh [phase ...]     phases: env trainer peers legacy   (default: all,
#                                                ~25 min; trainer = trainer_causal + trainer_rest)
#   The device tool stops a command at 10 minutes: in one lease, run it as four calls (each < 9 min):
#     env trainer_causal | trainer_rest | peers | legacy      (the model and artifact in $BENCH_WORK
#     are reused by later calls on the same warm machine, and made again on a fresh one)
#   bash bench/run_2gpu_bench.sh env smoke1      one GPU: ZeRO-2, FSDP2 and the trainer (with its
#                                                checkpoint + resume) at world size 1 on a $LAYERS-layer
#                                                slice of Mistral-7B, to prove the CUDA paths run
#   DRY=1 bash bench/run_2gpu_bench.sh           the same rows on CPU (gloo, 2 processes, tiny Mistral,
#                                                seq 128, no Liger: Triton needs a GPU) — code paths only
# trainer: training/train.py's own path (make_plan + Trainer.setup + its loader over a train-ready
#          artifact), 2 pipeline stages, attention/kernels auto (torch_varlen + Liger on GPU),
#          (a) causal rows (b) packed multi-document rows with the document mask, fp32 gradient
#          accumulation on and off; trainer_causal also does one checkpoint save (stall timed) + resume
# peers:   DeepSpeed ZeRO-2 and FSDP2 (fully_shard, bf16 params / fp32 reduce) with the HF model +
#          Liger + window-free SDPA + no recomputation + fp32 master weights, same rows
# legacy:  the earlier, handicapped baselines (4096 sliding-window mask, recomputation, no Liger;
#          the 1-GPU one in pure bf16), relabelled as such
# Results: $BENCH_OUT/row_<name>.json + log_<name>.txt per row; the markdown table printed last.
# Needs python3 with torch, transformers, deepspeed, liger-kernel, pydantic, nvidia-ml-py (wheels in
# $WHEELS, default .whl/, are installed to /tmp/site when deepspeed is missing).
set -uo pipefail
cd "$(dirname "$0")/.."

source bench/gpu_env.sh || exit 1

if [ "$DRY" = 1 ]; then
  WORK=${BENCH_WORK:-$BENCH_OUT/work}
  STORE=${BENCH_STORE:-$WORK/store}
  STEPS=${STEPS:-2} WARMUP=${WARMUP:-1}
  BASE=(--model tiny --device cpu --seq-len 128)
  MB=1 M_PIPE=4 M_PEER=2
  LIGER=()
  KEEP_WINDOW=(--sliding-window none)  # the tiny model's window (4096) is above seq 128 anyway
else
  # staging (the local save the stall measures) in RAM; the store (upload target) on disk:
  # one full checkpoint with optimizer states is ~101 GB and is held twice during the push
  WORK=${BENCH_WORK:-/dev/shm/mft-bench}
  STORE=${BENCH_STORE:-/tmp/mft-bench-store}
  STEPS=${STEPS:-4} WARMUP=${WARMUP:-2}
  BASE=(--model 7b --device cuda --seq-len 4096)
  # same global batch in every row: MB x M_PIPE (1 data-parallel rank) = MB x M_PEER x 2 ranks
  MB=${MB:-2} M_PIPE=${M_PIPE:-32} M_PEER=${M_PEER:-16}
  LIGER=(--hf-liger)
  KEEP_WINDOW=()
fi
mkdir -p "$WORK" "$STORE"

T=bench/train_throughput.py
TR2="$PY -m torch.distributed.run --standalone --nproc_per_node 2"
TR1="$PY -m torch.distributed.run --standalone --nproc_per_node 1"
TIMING=(--steps "$STEPS" --warmup "$WARMUP")

row() {  # row NAME TIMEOUT_S LAUNCHER... ARGS...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout -k 10 "$limit" "$@" "${BASE[@]}" "${TIMING[@]}" --label "$name" --out "$BENCH_OUT/row_$name.json" \
      > "$BENCH_OUT/log_$name.txt" 2>&1
  local rc=$?
  grep -E "^RESULT|Error|error:|OOM|out of memory" "$BENCH_OUT/log_$name.txt" | grep -v Warning | head -5
  [ $rc -ne 0 ] && { echo "row $name: exit $rc"; tail -12 "$BENCH_OUT/log_$name.txt"; }
  return 0
}

# the checkpoint needs room for itself twice (staging + store); without it the row runs without one
ckpt_flag() {
  local need_gb=${CKPT_NEED_GB:-110}
  [ "$DRY" = 1 ] && { echo --checkpoint; return; }
  local work_gb store_gb
  work_gb=$(df -BG --output=avail "$WORK" | tail -1 | tr -dc 0-9)
  store_gb=$(df -BG --output=avail "$STORE" | tail -1 | tr -dc 0-9)
  if [ "$work_gb" -ge "$need_gb" ] && [ "$store_gb" -ge "$need_gb" ]; then echo --checkpoint
  else echo "no room for a checkpoint (work ${work_gb}G, store ${store_gb}G, need ${need_gb}G each)" >&2; fi
}

trainer() {  # trainer NAME DOCS ACCUM_DTYPE [extra]
  local name=$1 docs=$2 accum=$3; shift 3
  row "$name" 600 $TR2 $T --setup trainer --stages 2 --micro-batch $MB --grad-accum $M_PIPE --docs "$docs" \
      --attention auto --kernels auto --grad-accum-dtype "$accum" --work "$WORK" --store "$STORE" "$@"
  rm -rf "$WORK/staging" "$STORE/runs"  # the next row starts a fresh run with the disk free again
}

peer() {  # peer NAME SETUP DOCS
  local name=$1 setup=$2 docs=$3 pos=()
  [ "$docs" = packed ] && pos=(--hf-position-ids)  # HF derives the per-document mask from position_ids
  row "$name" 420 $TR2 $T --setup "$setup" --micro-batch $MB --grad-accum $M_PEER --docs "$docs" \
      "${LIGER[@]}" --sliding-window none --act-ckpt 0 "${pos[@]}"
}

run_phase() {
  local phase=$1
  case $phase in
    env)
      [ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv
      [ "$DRY" = 1 ] || nvidia-smi topo -m 2>/dev/null | head -4
      df -h "$WORK" "$STORE" | tail -2
      $PY -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
      ;;
    trainer) set -- trainer_causal trainer_rest; for sub; do run_phase "$sub"; done ;;
    trainer_causal)  # the headline row, with the one checkpoint save + resume (~7 min on 2 x H200)
      # shellcheck disable=SC2046
      trainer trainer_causal causal fp32 $(ckpt_flag)
      ;;
    trainer_rest)
      trainer trainer_causal_bf16_accum causal bf16
      trainer trainer_packed packed fp32
      trainer trainer_packed_bf16_accum packed bf16
      ;;
    peers)
      peer zero2_causal hf_zero2 causal
      peer fsdp2_causal fsdp2 causal
      peer zero2_packed hf_zero2 packed
      peer fsdp2_packed fsdp2 packed
      ;;
    legacy)  # old settings: Mistral's 4096 window mask (SDPA off its flash kernel), recompute, no Liger
      row legacy_zero2_window_ckpt 420 $TR2 $T --setup hf_zero2 --micro-batch $MB --grad-accum $M_PEER \
          --docs causal --act-ckpt 1 "${KEEP_WINDOW[@]}"
      row legacy_single_bf16_window_ckpt 420 $PY $T --setup hf_single --micro-batch $((MB * 2)) \
          --grad-accum $M_PEER --docs causal --act-ckpt 1 --master bf16 "${KEEP_WINDOW[@]}"
      ;;
    smoke1)  # world size 1, a slice: same setups, so the 2-GPU lease finds no CUDA-only surprise
      BASE+=(--layers "${LAYERS:-4}")
      row smoke1_zero2 200 $TR1 $T --setup hf_zero2 --micro-batch 1 --grad-accum 2 --docs packed \
          "${LIGER[@]}" --sliding-window none --act-ckpt 0 --hf-position-ids
      row smoke1_fsdp2 200 $TR1 $T --setup fsdp2 --micro-batch 1 --grad-accum 2 --docs packed \
          "${LIGER[@]}" --sliding-window none --act-ckpt 0 --hf-position-ids
      row smoke1_trainer 200 $TR1 $T --setup trainer --stages 1 --micro-batch 1 --grad-accum 2 --docs packed \
          --attention auto --kernels auto --work "$WORK" --store "$STORE" --checkpoint
      rm -rf "$WORK/staging" "$STORE/runs"
      BASE=("${BASE[@]:0:${#BASE[@]}-2}")
      ;;
    *) echo "unknown phase $phase (env trainer trainer_causal trainer_rest peers legacy smoke1)"; exit 2 ;;
  esac
}

for phase in ${*:-env trainer peers legacy}; do run_phase "$phase"; done
echo "=== table"
$PY bench/report.py "$BENCH_OUT"
