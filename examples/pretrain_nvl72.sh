#!/usr/bin/env bash
# Pretrain a full-size GPT-MoE (DeepSeek-V3, Kimi-K2, Qwen3-235B-A22B) across the nodes of
# NVL72 racks, with Megatron's training loop and the MoK plugin. The node count, TP, PP and EP
# are in the config (configs/*_nvl72.args); every EP group stays inside one rack's NVLink
# domain, as MoK's peer loads and stores need.
#
# Slurm:    sbatch --nodes=64 examples/pretrain_nvl72.sh          (one task per node)
# torchrun: on every node, NNODES=64 NODE_RANK=<i> MASTER_ADDR=<node 0> bash examples/pretrain_nvl72.sh
#
# Environment: CONFIG (default configs/deepseek_v3_nvl72.args), DISPATCHER (below), PYTHON,
# DATA (Megatron --data-path value; default mock data), SAVE/LOAD (checkpoint directories),
# ITERS, GBS, LR, MASTER_PORT. Extra arguments go to Megatron.
#
# The full-size configs use multi-latent attention, which needs Transformer Engine, so this
# script uses the TE layers (--transformer-impl transformer_engine, grouped-GEMM experts).
# MoK's GPU backends are built for sm_90 (Hopper); on Blackwell NVL72 racks --mok-backend auto
# falls back to the reference implementation (correct, slow) until the sm_100 path exists,
# while alltoall and flex run at full speed there.
#SBATCH --job-name=mok-pretrain
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
root=${MOK_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
source "$root/examples/lib.sh"

DISPATCHER=${DISPATCHER:-mok}        # the one line to switch: mok | alltoall | flex-deepep | flex-hybridep
CONFIG=${CONFIG:-$root/configs/deepseek_v3_nvl72.args}
py=${PYTHON:-python3}
gpus_per_node=$(config_meta "$CONFIG" gpus_per_node 4)
nodes=$(config_meta "$CONFIG" nodes 1)
iters=${ITERS:-1000}; gbs=${GBS:-1024}; lr=${LR:-2e-4}

if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${MOK_IN_SRUN:-}" ]; then
  # The batch step: start this script once per node; each copy runs torchrun for its node.
  [ "${SLURM_JOB_NUM_NODES}" -eq "$nodes" ] || echo "warning: $CONFIG is laid out for $nodes nodes, the job has ${SLURM_JOB_NUM_NODES}" >&2
  master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  exec srun --kill-on-bad-exit=1 env MOK_IN_SRUN=1 MASTER_ADDR="$master" NNODES="$SLURM_JOB_NUM_NODES" \
    bash "$root/examples/pretrain_nvl72.sh" "$@"
fi
NNODES=${NNODES:-$nodes}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to node 0}
MASTER_PORT=${MASTER_PORT:-29500}

data_flags=(--mock-data)
[ -n "${DATA:-}" ] && data_flags=(--data-path "$DATA" --split 99,1,0)
ckpt_flags=()
[ -n "${SAVE:-}" ] && ckpt_flags+=(--save "$SAVE" --save-interval 500)
[ -n "${LOAD:-}" ] && ckpt_flags+=(--load "$LOAD")

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
cd "$root"
# shellcheck disable=SC2046
exec "$py" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$gpus_per_node" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m megatron_mok.pretrain_gpt "@$CONFIG" $(dispatcher_flags "$DISPATCHER") \
  --transformer-impl transformer_engine --moe-grouped-gemm --moe-permute-fusion \
  --micro-batch-size 1 --global-batch-size "$gbs" --train-iters "$iters" \
  --lr "$lr" --min-lr "$(python3 -c "print($lr / 10)")" --lr-decay-style cosine --lr-warmup-iters 100 \
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --init-method-std 0.006 --seed 1234 \
  --log-interval 1 --log-throughput --eval-interval 1000 --eval-iters 10 \
  --distributed-timeout-minutes 30 \
  "${data_flags[@]}" "${ckpt_flags[@]}" "$@"
