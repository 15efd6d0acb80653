#!/usr/bin/env bash
# Train the DeepSeek-V3 proxy (configs/proxy_deepseek_v3.args: hidden 7168, 8 experts of FFN
# 2048 per GPU, top-8, one shared expert, 3 layers + MTP) for 50 iterations on mock data, once
# with Megatron's alltoall dispatcher and once with MoK, from the same seed, and compare the two
# loss curves and their tokens/s.
#
# Local spec (no Transformer Engine or Apex needed), bf16, EP = number of GPUs, TP = PP = 1,
# micro-batch 1 x 4096 tokens per GPU. About 2-3 minutes per run on one H200.
#
#   bash examples/gpu_pretrain_compare.sh [OUT_DIR]
#
# Environment: PYTHON (interpreter with torch + megatron-core; default python3), NGPUS
# (default: every visible GPU), ITERS (50), MOK_BACKEND (auto: the fastest MoK backend here;
# reference also works, slowly), DISPATCHERS ("alltoall mok"; "mok" alone compares with an
# alltoall.log already in OUT_DIR). Writes OUT_DIR/{alltoall,mok}.log and prints the comparison;
# exits non-zero when a run fails or the curves differ beyond bf16 noise.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/examples/lib.sh"
py=${PYTHON:-python3}
out=${1:-$root/.gpu/pretrain_compare}
iters=${ITERS:-50}
ngpus=${NGPUS:-$("$py" -c 'import torch; print(torch.cuda.device_count())')}
if [ "$ngpus" -lt 1 ]; then
  echo "gpu_pretrain_compare.sh: no CUDA GPU visible; this comparison trains on GPUs" >&2
  exit 1
fi
config="$root/configs/proxy_deepseek_v3.args"
experts=$(( $(config_meta "$config" experts_per_gpu 8) * ngpus ))
seq=4096
tokens_per_iteration=$(( ngpus * seq ))
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# Megatron wraps some fused ops in torch.compile; compiling them costs more than this short
# run gains, and both runs are treated alike.
export TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# NVLink multicast stays off (the shared H200 hosts require it; MoK does not use multicast).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}

common=(
  "@$config" "@configs/local_no_te.args"
  --num-experts "$experts" --expert-model-parallel-size "$ngpus"
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --seq-length "$seq" --max-position-embeddings "$seq"
  --micro-batch-size 1 --global-batch-size "$ngpus"
  --train-iters "$iters" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --init-method-std 0.02
  --bf16 --seed 1234 --mock-data --split 100,0,0
  --log-interval 1 --eval-iters 0 --eval-interval "$(( iters + 1 ))"
  --no-bias-swiglu-fusion
)

export PYTHONUNBUFFERED=1
# Build (or find in the cache) the MoK CUDA library once, before the timed runs; without it
# --mok-backend auto falls back to the reference backend (and says so in the log).
"$py" - <<'PY' || echo "MoK CUDA library unavailable: the mok run will use the reference backend" >&2
import time
from megatron_mok.ops.library import load_library
start = time.time()
load_library()
print(f"MoK CUDA library ready ({time.time() - start:.0f} s)")
PY

status=0
for dispatcher in ${DISPATCHERS:-alltoall mok}; do
  extra=$(dispatcher_flags "$dispatcher")
  [ "$dispatcher" = mok ] && extra="$extra --mok-backend ${MOK_BACKEND:-auto}"
  echo "=== $dispatcher: $ngpus GPU(s), $experts experts, $iters iterations -> $out/$dispatcher.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  if ! "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpus" -m megatron_mok.pretrain_gpt \
      "${common[@]}" $extra > "$out/$dispatcher.log" 2>&1; then
    echo "$dispatcher run failed; last lines of $out/$dispatcher.log:" >&2
    tail -n 40 "$out/$dispatcher.log" >&2
    status=1
  fi
  echo "    wall time $(( $(date +%s) - start )) s"
done
[ "$status" -eq 0 ] || exit "$status"
"$py" "$root/examples/compare_logs.py" "$out/alltoall.log" "$out/mok.log" \
  --tokens-per-iteration "$tokens_per_iteration"
