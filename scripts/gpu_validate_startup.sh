#!/usr/bin/env bash
# What a Megatron user meets on day one, on H200s, in one device call (one GPU; the EP steps
# need two): start-up messages and refusals, the backend each MoE layer prints, the NVLink-domain
# check at argument validation, the Megatron baseline of the layer benchmark at P = 1 (it used
# to wait silently for a process-group timeout) and the end-to-end report (peak memory, loss
# curves).
#
#   scripts/gpu_validate_startup.sh [OUT_DIR] [PART]   (default: $OUT, else /tmp/mok-startup)
#
# PART is `all` (default), `1` (steps 1-3, start-up: about 3 minutes) or `2` (steps 4-5, the
# benchmarks: about 6 minutes), for when the whole would run past one 10-minute device call.
#
# Needs a prebuilt $MOK_LIBRARY to stay within one call (else the build runs first). Each step
# has a time limit and prints what it checks; the exit status is non-zero when a step failed.
set -uo pipefail
part=${2:-all}
case "$part" in all|1|2) ;; *) echo "gpu_validate_startup.sh: PART must be all, 1 or 2, got '$part'"; exit 2;; esac
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "${1:-}" /tmp/mok-startup
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
export CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_COMPILE_DISABLE=1
tiny=(@configs/tiny.args @configs/local_no_te.args --moe-token-dispatcher-type mok --micro-batch-size 2
      --lr 3e-3 --eval-iters 0 --eval-interval 1000 --split 100,0,0 --no-bias-swiglu-fusion --seed 1234)
expect() {  # expect FILE PATTERN: the step fails unless FILE has a line matching PATTERN
  if grep -q -- "$2" "$1"; then echo "  ok: $2"; else echo "  MISSING: $2"; failed=1; fi
}

if [ "$part" != 2 ]; then
step "1. --fp16 with --mok-backend auto: refused at start-up with one message (exit status 2)"
timeout 120 "$py" -m megatron_mok.pretrain_gpt "${tiny[@]}" --train-iters 2 --fp16 > "$out/fp16.log" 2>&1
code=$?
echo "  exit status $code"; [ "$code" -eq 2 ] || failed=1
expect "$out/fp16.log" "fp16=True (--fp16): MoK's GPU backends (megakernel, cuda) compute in bf16"
grep -q Traceback "$out/fp16.log" && { echo "  MISSING: no traceback"; failed=1; }

step "2. one GPU, bf16, --logging-level 40: every MoE layer says which backend it runs; training runs"
timeout 180 "$py" -m megatron_mok.pretrain_gpt "${tiny[@]}" --train-iters 5 --bf16 --logging-level 40 \
  --log-interval 1 > "$out/one_gpu.log" 2>&1 || failed=1
grep "megatron-mok" "$out/one_gpu.log" | head -n 5
# tiny.args has hidden 128: the cuda backend takes it, the megakernel (fc2 tiles of 256) does not
expect "$out/one_gpu.log" "the MoE of decoder layer 2 runs the cuda backend \[--mok-backend auto: the fastest"
expect "$out/one_gpu.log" "the MoE of MTP layer 1 runs the"
expect "$out/one_gpu.log" "iteration        5/       5"

if [ "$gpus" -ge 2 ]; then
  step "3. two GPUs of one host, EP = 2: the NVLink domain is checked at argument validation and passes"
  timeout 180 "$py" -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_mok.pretrain_gpt \
    "${tiny[@]}" --train-iters 5 --bf16 --num-experts 16 --expert-model-parallel-size 2 --global-batch-size 4 \
    --log-interval 1 > "$out/two_gpus.log" 2>&1 || failed=1
  expect "$out/two_gpus.log" "iteration        5/       5"
  "$py" - <<'PY' || failed=1
# The NVML fabric answer for each visible GPU (HGX H200: "not supported": one host, one domain).
import torch
from megatron_mok.megatron.peers import query_gpu_place
for i in range(torch.cuda.device_count()):
    print(" ", query_gpu_place(i))
PY
else
  step "3. skipped: needs two GPUs"
fi
fi

if [ "$part" != 1 ]; then
step "4. the issue's command: Megatron's layer at P = 1, Kimi-K2 with 48 experts, finishes with progress"
timeout 300 "$py" -m torch.distributed.run --nproc-per-node 1 -m megatron_mok.bench layer --shape kimi-k2 \
  --tokens 4096 --experts-per-gpu 48 --backends megatron-alltoall --warmup 3 --iters 5 \
  --out "$out" --name layer-p1 > "$out/layer-p1.log" 2>&1 || failed=1
grep "^\[layer\]\|megatron-alltoall" "$out/layer-p1.log" | tail -n 12
expect "$out/layer-p1.log" "megatron-alltoall (1/1): done: forward"

step "5. end to end, proxy DeepSeek-V3, alltoall and mok: step time, peak memory, loss curves"
timeout 420 "$py" -m megatron_mok.bench e2e --nproc-per-node "$gpus" --dispatchers alltoall,mok --iters 12 \
  --skip-iters 4 --args-file configs/proxy_deepseek_v3.args --args-file configs/local_no_te.args \
  --out "$out/e2e" --name e2e -- --num-experts $(( 8 * gpus )) --expert-model-parallel-size "$gpus" \
  --micro-batch-size 1 --global-batch-size "$gpus" --lr 1e-4 --bf16 --seed 1234 --mock-data --split 100,0,0 \
  --no-bias-swiglu-fusion > "$out/e2e.log" 2>&1 || failed=1
tail -n 8 "$out/e2e.log"
expect "$out/e2e/e2e.md" "peak GB (alloc/reserved)"
fi

step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
