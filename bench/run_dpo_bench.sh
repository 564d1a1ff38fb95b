#!/usr/bin/env bash
# DPO vs SFT training throughput on one GPU (issue 30), in one call: the one-stage 16-layer slice of
# Mistral-7B, seq 4096, the same random pair rows (chosen + rejected, 2,048 tokens each, the last
# two thirds of each document trained) through training/train.py's own setup and loader:
#   sft  train.objective sft (token-mean cross-entropy, Liger's fused linear+CE)
#   dpo  train.objective dpo (per-document log-probs from hidden states, chunked, no logits kept);
#        its reference pass (forward only over every row) is timed separately, before the steps
#   bash bench/run_dpo_bench.sh        (DRY=1 LAYERS=2 MODEL=tiny SEQ=256: a CPU dry run)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
T=bench/train_throughput.py
TR="$PY -m torch.distributed.run --standalone --nproc_per_node 1"
DEVICE=cuda; [ "$DRY" = 1 ] && DEVICE=cpu
ATTN=${ATTN:-torch_varlen}; [ "$DRY" = 1 ] && ATTN=sdpa
COMMON=(--setup trainer --device "$DEVICE" --model "${MODEL:-7b}" --layers "${LAYERS:-16}" --seq-len "${SEQ:-4096}"
        --micro-batch "${MB:-2}" --grad-accum "${GA:-4}" --steps "${STEPS:-3}" --warmup "${WARMUP:-1}" --stages 1
        --docs pairs --kernels "${KERNELS:-auto}" --attention "$ATTN" --work "${WORK:-/dev/shm/mft-bench-dpo}")
for obj in sft dpo; do
  timeout "${ROW_TIMEOUT:-400}" $TR $T "${COMMON[@]}" --objective "$obj" --label "${obj}_pairs" \
    --out "$BENCH_OUT/dpo_bench_$obj.json" > "$BENCH_OUT/dpo_bench_$obj.log" 2>&1 \
    || { echo "row $obj failed:"; tail -40 "$BENCH_OUT/dpo_bench_$obj.log"; }
done
$PY - "$BENCH_OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {o: json.loads((out / f"dpo_bench_{o}.json").read_text()) for o in ("sft", "dpo")
        if (out / f"dpo_bench_{o}.json").exists()}
for o, r in rows.items():
    print(f"{o}: {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, MFU {r['mfu']:.3f}, median step {r['step_time_median_s']:.3f}s, "
          f"peak {r['peak_alloc_gib_max']} GiB, losses {[round(x, 4) for x in r['losses']]}")
if len(rows) == 2:
    s, d = rows["sft"]["tokens_per_s_per_gpu"], rows["dpo"]["tokens_per_s_per_gpu"]
    ref = rows["dpo"]["settings"]["extra"]["reference_pass"]
    print(f"DPO / SFT training tokens/s: {d / s:.3f} (target >= 0.9)")
    print(f"reference pass (first, cold): {ref['rows']} rows, {ref['time_s']:.2f} s, {ref['tokens_per_s']:.0f} tok/s = "
          f"{ref['tokens_per_s'] / s:.2f} x SFT training")
    print(f"reference pass (warm): {ref['warm_rows']} rows, {ref['warm_time_s']:.2f} s, {ref['warm_tokens_per_s']:.0f} "
          f"tok/s = {ref['warm_tokens_per_s'] / s:.2f} x SFT training (target >= 2.5)")
PY
