#!/usr/bin/env bash
# Pretrain a GPT-MoE on one node with any number of local GPUs (1 to 8), expert-parallel over
# all of them, with Megatron's training loop and the MoK plugin.
#
#   bash examples/pretrain_single_node.sh [extra Megatron flags...]
#
# Environment (all optional):
#   CONFIG      model config (default configs/proxy_deepseek_v3.args; the proxies keep the MoE
#               layer of the full-size models, --num-experts = experts_per_gpu x GPUs)
#   DISPATCHER  mok | alltoall | allgather | flex-deepep | flex-hybridep   (default mok)
#   NGPUS       GPUs to use (default: all visible)
#   PYTHON      interpreter with torch + megatron-core + this package (default python3)
#   TE=1        use Transformer Engine layers instead of local_no_te.args (needed for the
#               MLA attention of the full-size configs and for the flex dispatchers)
#   ITERS, MBS, SEQ, LR   training length, micro-batch, sequence length, learning rate
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/examples/lib.sh"

DISPATCHER=${DISPATCHER:-mok}        # the one line to switch: mok | alltoall | flex-deepep | flex-hybridep
CONFIG=${CONFIG:-$root/configs/proxy_deepseek_v3.args}
py=${PYTHON:-python3}
ngpus=${NGPUS:-$("$py" -c 'import torch; print(torch.cuda.device_count())')}
iters=${ITERS:-100}; mbs=${MBS:-1}; seq=${SEQ:-4096}; lr=${LR:-3e-4}
[ "$ngpus" -ge 1 ] || { echo "no CUDA GPU visible" >&2; exit 1; }

min_gpus=$(config_meta "$CONFIG" min_gpus 1)
[ "$ngpus" -ge "$min_gpus" ] || { echo "$CONFIG needs at least $min_gpus GPUs (top-k needs enough experts)" >&2; exit 1; }
experts_flags=()
epg=$(config_meta "$CONFIG" experts_per_gpu "")
if [ -n "$epg" ]; then
  experts_flags=(--num-experts $(( epg * ngpus )))
fi
backend_flags=("@$root/configs/local_no_te.args")
[ "${TE:-0}" = 1 ] && backend_flags=(--transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion)

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# NVLink multicast stays off (the shared H200 hosts require it; MoK does not use multicast).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
cd "$root"
# shellcheck disable=SC2046
exec "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpus" -m megatron_mok.pretrain_gpt \
  "@$CONFIG" "${backend_flags[@]}" "${experts_flags[@]}" $(dispatcher_flags "$DISPATCHER") \
  --expert-model-parallel-size "$ngpus" --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \
  --seq-length "$seq" --max-position-embeddings "$seq" \
  --micro-batch-size "$mbs" --global-batch-size $(( mbs * ngpus )) \
  --train-iters "$iters" --lr "$lr" --min-lr "$(python3 -c "print($lr / 10)")" --lr-decay-style cosine \
  --lr-warmup-iters $(( iters / 10 + 1 )) --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 \
  --init-method-std 0.02 --bf16 --seed 1234 --mock-data --split 100,0,0 \
  --log-interval 1 --log-throughput --eval-iters 0 --eval-interval $(( iters + 1 )) \
  "$@"
