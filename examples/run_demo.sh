#!/usr/bin/env bash
# The megatron-mok demo (the README's main command): sets up the environment from nothing,
# then trains the tiny GPT-MoE of configs/tiny.args with --moe-token-dispatcher-type mok.
#
#   bash examples/run_demo.sh
#
# With CUDA GPUs: Megatron's own training loop (python -m megatron_mok.pretrain_gpt) trains the
# tiny model for 30 iterations on mock data in bf16 on every local GPU (EP = GPU count), MoK
# backend "auto" (the fastest one available on this GPU).
# Without a GPU: the launcher parses and validates the same flags and builds the model (then
# says that Megatron's training loop needs a GPU), and examples/cpu_demo.py trains the tiny
# model on 2 CPU processes with the MoK layer (reference backend) next to Megatron's alltoall
# layer and checks that both train alike (same losses up to fp32 round-off). About a minute
# on 2 cores.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$("$root/scripts/ensure_env.sh" | tail -n 1)
cd "$root"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ngpus=$("$python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')

flags=(@configs/tiny.args @configs/local_no_te.args --moe-token-dispatcher-type mok
       --micro-batch-size 4 --train-iters 30 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
       --lr-warmup-iters 3 --seed 1234 --log-interval 5 --eval-iters 0 --eval-interval 1000
       --split 100,0,0 --no-bias-swiglu-fusion)

if [ "$ngpus" -gt 0 ]; then
  echo "== megatron-mok demo: tiny GPT-MoE, Megatron training loop, --moe-token-dispatcher-type mok, $ngpus GPU(s)"
  # Megatron wraps a few fused ops in torch.compile; for 30 tiny iterations compiling costs
  # more than it saves.
  export TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  # NVLink multicast stays off (the shared H200 hosts require it; MoK does not use multicast).
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
  export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
  exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$ngpus" -m megatron_mok.pretrain_gpt \
    "${flags[@]}" --bf16 --num-experts $(( 8 * ngpus )) --expert-model-parallel-size "$ngpus" \
    --global-batch-size $(( 4 * ngpus )) --mok-backend auto
fi

echo "== megatron-mok demo on a machine without a GPU"
echo "-- 1. the launcher: Megatron's flags parsed and validated, the model built with the MoK layer"
set +e
"$python" -m megatron_mok.pretrain_gpt "${flags[@]}" --global-batch-size 4 --mok-backend reference 2>/dev/null \
  | grep '^mok-pretrain-gpt:'
launcher=${PIPESTATUS[0]}
set -e
if [ "$launcher" -ne 1 ]; then
  echo "the launcher failed (exit status $launcher); rerun it without 2>/dev/null to see why" >&2
  exit 1
fi
echo
echo "-- 2. training on the CPU: Megatron's alltoall MoE layer vs the MoK layer (reference backend)"
"$python" examples/cpu_demo.py --steps 30 2> >(grep -v 'No CUDA runtime is found' >&2)
echo
cat <<'MSG'
What needs a GPU:
  * Megatron's training loop (pretrain: data loaders, DDP, optimizer, fused kernels) - run this
    script on a CUDA machine and it trains the same model with `python -m megatron_mok.pretrain_gpt`;
  * MoK's fast backends: `cuda` and `megakernel` run on sm_90 GPUs (H100/H200) in bf16; where
    they cannot run, training with --mok-backend auto stops at start-up and says why
    (--mok-backend reference runs the reference backend shown above on purpose);
  * the proxy and full-size models of configs/ (examples/gpu_pretrain_compare.sh,
    examples/pretrain_single_node.sh, examples/pretrain_nvl72.sh).
MSG
