#!/usr/bin/env bash
# Everything that needs one process per GPU on all the machine's GPUs, in one device call
# (written for nvidia-h200-x4 / -x8; it runs on any count from 2 up):
#   1. the GPU tests with one process per GPU (tests/test_all_gpus.py, `-m gpun`): both
#      backends against the oracle, bitwise determinism, CUDA graph replay, the barrier timeout;
#   2. the layer benchmark on all GPUs: Kimi-K2 and DeepSeek-V3, 4096 tokens per GPU, the full
#      expert count and 6 experts per GPU, megakernel, cuda and NCCL all_to_all +
#      torch._grouped_mm, with the floors;
#   3. the proxy DeepSeek-V3 pretrain at EP = the GPU count, 50 iterations, `alltoall` and `mok`
#      (default backend), with the loss-curve comparison.
#
#   scripts/gpu_validate_all_gpus.sh [OUT_DIR]      (default: $OUT, else /tmp/mok-all-gpus)
#
# $MOK_LIBRARY, when it names a file, is the prebuilt library; else the library is built.
# Writes OUT_DIR/tests-gpun.log, OUT_DIR/layer-h200xN.{json,md,png}, OUT_DIR/e2e-h200xN.{json,md,png}
# and OUT_DIR/e2e-compare.txt; the exit status is non-zero when a step failed. Each step has a
# time limit (the whole stays under 10 minutes on 8 H200s).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "${1:-}" /tmp/mok-all-gpus
n=$("$py" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
echo "GPUs: $n"
if (( n < 2 )); then echo "needs at least two GPUs"; exit 2; fi

step "1. tests, one process per GPU (P = $n)"
timeout 240 "$py" -m pytest -q -rs -p no:warnings --timeout=200 -m gpun tests/test_all_gpus.py 2>&1 \
  | tee "$out/tests-gpun.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

step "2. layer benchmark on $n GPUs"
timeout 180 "$py" -m torch.distributed.run --nproc-per-node "$n" -m megatron_mok.bench layer \
  --shape kimi-k2 deepseek-v3 --tokens 4096 --experts-per-gpu full 6 --routing uniform \
  --backends mok-megakernel,mok-cuda,a2a-grouped-mm --warmup 10 --iters 10 --check-tokens 256 \
  --out "$out" --name "layer-h200x$n" 2>&1 | grep -v "Warning\|warnings.warn" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

step "3. proxy DeepSeek-V3 pretrain, EP = $n, alltoall and mok"
DISPATCHERS=alltoall,mok ITERS=50 GLOBAL_BATCH=$n timeout 300 bash examples/bench_e2e_h200.sh "$out/e2e" \
  configs/proxy_deepseek_v3.args -- --num-experts $(( 8 * n )) --mock-data --split 100,0,0 \
  --no-bias-swiglu-fusion 2>&1 | grep -v "^+\|Warning\|warnings.warn" | tail -6
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
cp "$out"/e2e/e2e-h200x"$n".* "$out"/ 2>/dev/null
"$py" examples/compare_logs.py "$out"/e2e/*alltoall*.log "$out"/e2e/*mok*.log \
  --tokens-per-iteration $(( n * 4096 )) 2>&1 | grep -v "Warning\|warnings.warn" | tee "$out/e2e-compare.txt" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
