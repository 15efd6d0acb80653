#!/usr/bin/env bash
# The layer benchmark as measured for docs/benchmarks.md: Kimi-K2 and DeepSeek-V3 at 4096
# tokens per GPU, every available backend, in both regimes (weight-bound and compute-bound):
#   * 2 GPUs: the full expert count (192 / 128 experts per GPU) and 6 experts per GPU
#     (Kimi-K2's per-GPU load at EP=64);
#   * 1 GPU:  the per-GPU load of the full model on 2 GPUs (ep=2: 192 / 128 experts) and
#     8 experts per GPU (the fewest that top-8 routing allows on one GPU).
# Writes OUT_DIR/layer-h200xN.{json,png,md}; about 3-5 minutes.
#
# Usage: examples/bench_layer_h200.sh OUT_DIR [more flags for `python -m megatron_mok.bench layer`]
#   NGPU=1|2 picks the GPU count (default: 2 when two are visible, else 1).
set -euo pipefail
out=${1:?usage: $0 OUT_DIR [more layer flags]}
shift
python=${PYTHON:-python3}
visible=$("$python" -c 'import torch; print(torch.cuda.device_count())')
ngpu=${NGPU:-$(( visible >= 2 ? 2 : 1 ))}
if (( ngpu < 1 || ngpu > visible )); then
  echo "NGPU=$ngpu, but $visible GPU(s) are visible" >&2
  exit 2
fi
if (( ngpu >= 2 )); then
  per_gpu=(full 6)
else
  per_gpu=(ep=2 8)
fi
# NVLink multicast stays off (the shared H200 hosts do not allow it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
set -x
"$python" -m torch.distributed.run --nproc-per-node "$ngpu" -m megatron_mok.bench layer \
  --shape kimi-k2 deepseek-v3 --tokens 4096 --experts-per-gpu "${per_gpu[@]}" \
  --routing uniform --warmup 10 --iters 10 --check-tokens 256 \
  --out "$out" --name "layer-h200x$ngpu" "$@"
