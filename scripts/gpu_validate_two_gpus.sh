#!/usr/bin/env bash
# The two-GPU validation in one device call on nvidia-h200-x2: the P = 2 tests of every layer
# (`-m gpu2`: the megakernel and cuda backends against the reference across two processes), the
# layer benchmark at P = 2 (megakernel, cuda, all_to_all + torch._grouped_mm and Megatron's
# alltoall; Kimi-K2, the full expert count and 6 per GPU) and the proxy DeepSeek-V3 pretrain with
# `alltoall` and `mok` (examples/gpu_pretrain_compare.sh). scripts/gpu_validate_all_gpus.sh is
# the one-process-per-GPU counterpart (`-m gpun`) for any GPU count.
#
#   scripts/gpu_validate_two_gpus.sh [OUT_DIR] [PART]   (default: $OUT, else /tmp/mok-two-gpus)
#
# PART is `all` (default), `1` (the tests, up to 150 s) or `2` (layer benchmark and pretrain, up
# to 390 s), for when the whole would run past one 10-minute device call.
#
# Needs two GPUs (says so and exits 2 otherwise) and a prebuilt $MOK_LIBRARY to stay within one
# call (the build alone takes minutes). Writes OUT_DIR/tests.log, OUT_DIR/layer-x2.* and
# OUT_DIR/pretrain/; the exit status is non-zero when a step failed. Each step has a time limit.
set -uo pipefail
part=${2:-all}
case "$part" in all|1|2) ;; *) echo "gpu_validate_two_gpus.sh: PART must be all, 1 or 2, got '$part'"; exit 2;; esac
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "${1:-}" /tmp/mok-two-gpus
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 2 ]; then
  echo "gpu_validate_two_gpus.sh: needs 2 GPUs, this machine has $gpus"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader || true

if [ "$part" != 2 ]; then
step "P = 2 tests (two processes, -m gpu2)"
timeout 150 "$py" -m pytest -q -rsf -p no:warnings --timeout=120 -m gpu2 tests 2>&1 | tail -n 15 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
fi

if [ "$part" != 1 ]; then
step "layer benchmark, P = 2, Kimi-K2 shape, full expert count and 6 per GPU"
timeout 150 "$py" -m torch.distributed.run --nproc-per-node 2 -m megatron_mok.bench layer --shape kimi-k2 \
  --tokens 4096 --experts-per-gpu full 6 --backends mok-megakernel,mok-cuda,a2a-grouped-mm,megatron-alltoall \
  --warmup 10 --iters 20 --out "$out" --name layer-x2 2>&1 | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

step "proxy DeepSeek-V3 pretrain, EP = 2, alltoall against mok"
timeout 240 bash examples/gpu_pretrain_compare.sh "$out/pretrain" 2>&1 | tail -n 20
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
fi

step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
