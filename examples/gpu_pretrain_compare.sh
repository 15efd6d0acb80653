#!/usr/bin/env bash
# Train DeepSeek-V3 proxies for 50 iterations on mock data, each once with Megatron's alltoall
# dispatcher and once with MoK, from the same seed, and compare the two loss curves, their
# tokens/s and their peak device memory.
#
# The proxies keep the MoE layer of DeepSeek-V3 (configs/proxy_deepseek_v3.args: hidden 7168,
# 8 experts of FFN 2048 per GPU, top-8, one shared expert) and differ in their layers:
#   deepseek-v3  the config as it is: 1 dense + 2 MoE layers + the MTP layer;
#   all-moe      the real model's mix, every layer MoE but the first: 1 dense + MOE_LAYERS MoE
#                layers + the MTP layer. MOE_LAYERS defaults to the most whose weights and
#                optimizer state fit WEIGHTS_GB per GPU, estimated from the config's widths at
#                18 bytes a parameter (bf16 weight, fp32 gradient, fp32 master copy, Adam's two
#                fp32 moments); the script prints the estimate of each proxy.
#
# Local spec (no Transformer Engine or Apex needed), bf16, EP = number of GPUs, TP = PP = 1,
# micro-batch 1 x 4096 tokens per GPU. About 2-3 minutes per deepseek-v3 run on one H200.
#
#   bash examples/gpu_pretrain_compare.sh [OUT_DIR]
#
# Environment: PYTHON (interpreter with torch + megatron-core; default python3), NGPUS
# (default: every visible GPU), ITERS (50), PROXY (deepseek-v3; all-moe; "all" or a list such as
# "deepseek-v3 all-moe" runs each in turn), MOE_LAYERS and WEIGHTS_GB (60) for all-moe,
# MOK_BACKEND (auto: the fastest MoK backend here; reference also works, slowly), DISPATCHERS
# ("alltoall mok"; "mok" alone compares with an alltoall.log already in OUT_DIR/PROXY), LAUNCHER
# (megatron_mok.pretrain_gpt: a module, or a .py script taking Megatron's pretrain_gpt flags),
# SHARE (0; 1: each run goes through tools/perf/moe_step_share.py, which times every MoE layer's
# forward and backward and Megatron's train_step with CUDA events, writes
# OUT_DIR/PROXY/DISPATCHER.share.json and prints the MoE layers' share of the step, median after
# SHARE_WARMUP iterations, default 5; the timed runs record four CUDA events per MoE layer per
# microbatch, so compare step times of runs made alike).
# Writes OUT_DIR/PROXY/{alltoall,mok}.log, prints a summary (per run: median step, tokens/s,
# peak memory from Megatron's memory reports) and each proxy's loss-curve comparison; exits
# non-zero when a run fails or the curves differ beyond bf16 noise.
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
proxies=${PROXY:-deepseek-v3}
proxies=${proxies//,/ }
[ "$proxies" = all ] && proxies="deepseek-v3 all-moe"
for proxy in $proxies; do
  case "$proxy" in
    deepseek-v3|all-moe) ;;
    *) echo "gpu_pretrain_compare.sh: PROXY '$proxy' is not one of deepseek-v3, all-moe, all" >&2; exit 2 ;;
  esac
done
launcher=${LAUNCHER:-megatron_mok.pretrain_gpt}
if [[ $launcher == *.py ]]; then launcher_cmd=("$launcher"); else launcher_cmd=(-m "$launcher"); fi
share=${SHARE:-0}
case "$share" in
  0|1) ;;
  *) echo "gpu_pretrain_compare.sh: SHARE must be 0 or 1, not '$share'" >&2; exit 2 ;;
esac
config="$root/configs/proxy_deepseek_v3.args"
experts_per_gpu=$(config_meta "$config" experts_per_gpu 8)
experts=$(( experts_per_gpu * ngpus ))
seq=4096
tokens_per_iteration=$(( ngpus * seq ))

# Parameters on one GPU of the proxy with LAYERS decoder layers, the first dense and the rest MoE,
# plus its MTP layers (built like the last decoder layer, with a 2H x H projection in front).
hidden=$(config_flag "$config" --hidden-size 0)
heads=$(config_flag "$config" --num-attention-heads 1)
kv=$(config_flag "$config" --kv-channels $(( hidden / heads )))
groups=$(config_flag "$config" --num-query-groups "$heads")
attention=$(( 2 * hidden * heads * kv + 2 * hidden * groups * kv ))
dense_layer=$(( attention + 3 * hidden * $(config_flag "$config" --ffn-hidden-size 0) ))
moe_layer=$(( attention + 3 * hidden * $(config_flag "$config" --moe-ffn-hidden-size 0) * experts_per_gpu
              + 3 * hidden * $(config_flag "$config" --moe-shared-expert-intermediate-size 0) + hidden * experts ))
mtp_layers=$(config_flag "$config" --mtp-num-layers 0)
embeddings=$(( 2 * $(config_flag "$config" --vocab-size 0) * hidden ))
params_per_gpu() {
  echo $(( dense_layer + ($1 - 1) * moe_layer + mtp_layers * (moe_layer + 2 * hidden * hidden) + embeddings ))
}
weights_gb() {  # 18 bytes a parameter, GB (10^9 bytes)
  awk -v p="$(params_per_gpu "$1")" 'BEGIN { printf "%.1f", p * 18 / 1e9 }'
}
budget_gb=${WEIGHTS_GB:-60}
if [ -n "${MOE_LAYERS:-}" ]; then
  all_moe_layers=$MOE_LAYERS
else
  all_moe_layers=1
  while awk -v p="$(params_per_gpu $(( all_moe_layers + 2 )))" -v b="$budget_gb" \
      'BEGIN { exit !(p * 18 <= b * 1e9) }'; do
    all_moe_layers=$(( all_moe_layers + 1 ))
  done
fi
[ "$all_moe_layers" -ge 1 ] || { echo "gpu_pretrain_compare.sh: MOE_LAYERS must be at least 1" >&2; exit 2; }

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
  --log-interval 1 --log-memory-interval "$iters" --eval-iters 0 --eval-interval "$(( iters + 1 ))"
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
runs=()
for proxy in $proxies; do
  if [ "$proxy" = all-moe ]; then
    layers=$(( all_moe_layers + 1 ))
    proxy_flags=(--num-layers "$layers" --moe-layer-freq "[0]*1+[1]*$all_moe_layers")
    mix="1 dense + $all_moe_layers MoE"
    [ -n "${MOE_LAYERS:-}" ] || mix="$mix, the most MoE layers within WEIGHTS_GB=$budget_gb"
  else
    layers=$(config_flag "$config" --num-layers 3)
    proxy_flags=()
    mix="--moe-layer-freq $(config_flag "$config" --moe-layer-freq '?')"
  fi
  mkdir -p "$out/$proxy"
  echo "=== proxy $proxy: $layers layers ($mix) + $mtp_layers MTP; weights and optimizer state" \
    "~$(weights_gb "$layers") GB per GPU ($(params_per_gpu "$layers") parameters x 18 bytes)"
  for dispatcher in ${DISPATCHERS:-alltoall mok}; do
    extra=$(dispatcher_flags "$dispatcher")
    [ "$dispatcher" = mok ] && extra="$extra --mok-backend ${MOK_BACKEND:-auto}"
    log="$out/$proxy/$dispatcher.log"
    run_cmd=("${launcher_cmd[@]}")
    if [ "$share" = 1 ]; then
      # The same launcher and flags, run in-process by the instrument after its hooks are in place.
      run_cmd=("$root/tools/perf/moe_step_share.py" --share-json "$out/$proxy/$dispatcher.share.json"
               --share-warmup "${SHARE_WARMUP:-5}" --share-launcher "$launcher" --)
    fi
    echo "=== $proxy, $dispatcher: $ngpus GPU(s), $experts experts, $iters iterations -> $log"
    start=$(date +%s)
    # shellcheck disable=SC2086
    if ! "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpus" "${run_cmd[@]}" \
        "${common[@]}" "${proxy_flags[@]}" $extra > "$log" 2>&1; then
      echo "$proxy, $dispatcher run failed; last lines of $log:" >&2
      tail -n 40 "$log" >&2
      status=1
    fi
    echo "    wall time $(( $(date +%s) - start )) s"
    if [ "$share" = 1 ]; then
      sed -n "s/^moe_step_share: MoE layers/    $proxy, $dispatcher: moe_step_share: MoE layers/p" "$log"
    fi
    runs+=("$proxy/$dispatcher")
  done
  if [[ " ${DISPATCHERS:-alltoall mok} " != *" alltoall "* ]] && [ -f "$out/$proxy/alltoall.log" ]; then
    runs+=("$proxy/alltoall")
  fi
done

echo "=== summary: after 5 warm-up iterations; tokens/s of all $ngpus GPU(s); peak memory: the largest" \
  "'max allocated' / 'max reserved' of Megatron's memory reports"
"$py" - "$out" "$tokens_per_iteration" "${runs[@]}" <<'PY' || status=1
import sys
from megatron_mok.megatron.training_log import losses, parse_log, parse_memory, summarize_run

out, tokens = sys.argv[1], int(sys.argv[2])
rows = [("proxy", "dispatcher", "iterations", "median ms", "tokens/s", "peak GB (alloc/reserved)")]
failed = []
for run in sys.argv[3:]:
    proxy, dispatcher = run.split("/")
    with open(f"{out}/{run}.log", errors="replace") as f:
        lines = f.read().splitlines()
    curve = losses(parse_log("\n".join(lines))[1])
    if not curve:
        rows.append((proxy, dispatcher, "failed", "-", "-", "-"))
        failed.append(f"{out}/{run}.log")
        continue
    s = summarize_run(curve, tokens)
    memory = parse_memory(lines)
    peak = (f"{memory['max_allocated_mb'] / 1024:.1f} / {memory['max_reserved_mb'] / 1024:.1f}"
            if memory else "-")
    rows.append((proxy, dispatcher, str(s.iterations), f"{s.median_ms:.1f}", f"{s.tokens_per_s:,.0f}", peak))
widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
for r in rows:
    print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
for path in failed:
    print(f"no iteration with an lm loss in {path}; see the log for the error")
sys.exit(1 if failed else 0)
PY

for proxy in $proxies; do
  if [ -f "$out/$proxy/alltoall.log" ] && [ -f "$out/$proxy/mok.log" ]; then
    echo "=== $proxy: loss curves, alltoall against mok"
    "$py" "$root/examples/compare_logs.py" "$out/$proxy/alltoall.log" "$out/$proxy/mok.log" \
      --tokens-per-iteration "$tokens_per_iteration" || status=1
  else
    echo "=== $proxy: no alltoall.log and mok.log pair in $out/$proxy to compare"
  fi
done
exit "$status"
