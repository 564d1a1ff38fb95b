# Sourced by the GPU drivers (run_trainer_bench.sh, run_gpu_bench.sh, run_2gpu_bench.sh): one
# environment for every row, and the carried wheels installed once when DeepSpeed is missing.
#   in:  BENCH_OUT (default bench_out), WHEELS (default .whl), PYTHON (default python3),
#        DRY=1 for a CPU dry run (gloo, DS_ACCELERATOR=cpu)
#   out: PY, BENCH_OUT (created), the exported environment; returns 1 when the install fails
BENCH_OUT=${BENCH_OUT:-bench_out}
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
DRY=${DRY:-0}
mkdir -p "$BENCH_OUT"

# NVLink multicast stays off (shared hosts); the same allocator setting for every row; no hub.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ "$DRY" = 1 ]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
else
  export DS_ACCELERATOR=cuda OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi

# a warm machine keeps what an earlier call installed
[ -d /tmp/site/deepspeed ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import deepspeed, torchao" 2>/dev/null && [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
