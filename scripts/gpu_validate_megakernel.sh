#!/usr/bin/env bash
# Validates the forward megakernel on H200s in one go (one device call): builds the library (or
# uses $MOK_LIBRARY when that file exists), runs tests/megakernel (its GPU tests; the gpu2 tests
# when two GPUs are there), then times the forward at the Kimi-K2 shape (T = 4096, K = 8,
# H = 7168, I = 2048) next to the cuda backend: P = 1 with 192 and 6 experts per GPU, a few
# settings of the tunables (comm SMs, minibatch and ring, pair mode, group size), each checked
# against the cuda backend's output; with two GPUs also the layer benchmark under torchrun
# (megakernel and cuda backends, forward and backward).
#
#   scripts/gpu_validate_megakernel.sh [OUT_DIR]      (default: $OUT, else /tmp/mok-megakernel)
#
# Writes OUT_DIR/tests.log, OUT_DIR/timing-p1.log and, with two GPUs, OUT_DIR/layer-mk.*; the
# exit status is non-zero when a step failed. Every step has a time limit; the whole script
# stays under 10 minutes.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "${1:-}" /tmp/mok-megakernel
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
echo "GPUs: $gpus"

step "tests/megakernel"
# --maxfail bounds the time a broken kernel costs (each failing wait takes the tests' 20 s).
timeout 300 "$py" -m pytest -v -rs --timeout=150 --maxfail=4 tests/megakernel 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

step "timing, P = 1, Kimi-K2 shapes (T=4096, K=8, H=7168, I=2048)"
timeout 120 "$py" - <<'PY' 2>&1 | tee "$out/timing-p1.log"
import statistics
import sys

import torch

from megatron_mok import MegakernelTunables, MoKConfig
from megatron_mok.functional import check_errors, mok_moe

T, K, H, I = 4096, 8, 7168, 2048
flop = 6 * T * K * H * I
MAX_REL_DIFF = 2e-2  # bf16, as the tune command checks its candidates
failed = []


def median_ms(fn, iters=10, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


for L in (192, 6):
    g = torch.Generator(device="cuda").manual_seed(L)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T, L, device="cuda", generator=g).argsort(dim=1)[:, :K].contiguous() if L >= K else \
        torch.randint(0, L, (T, K), device="cuda", generator=g)
    w = torch.rand(T, K, device="cuda", generator=g)
    fc1 = (torch.randn(L, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(L, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    with torch.no_grad():
        ref = mok_moe(x, ids, w, fc1, fc2, backend="cuda")
        ms = median_ms(lambda: mok_moe(x, ids, w, fc1, fc2, backend="cuda"))
        print(f"L={L:4d} cuda backend           forward {ms:7.3f} ms  {flop / ms / 1e9:6.1f} TFLOP/s", flush=True)
        settings = [((comm, mb, ring), MegakernelTunables())
                    for comm, mb, ring in ((None, None, None), (4, None, None), (8, None, None), (16, None, None),
                                           (8, 1024, 4096), (16, 4096, 8192))]
        settings += [((None, None, None), MegakernelTunables(pairs=False)),
                     ((None, None, None), MegakernelTunables(group_blocks=16))]
        for (comm, mb, ring), mk in settings:
            cfg = MoKConfig(comm_sms_forward=comm, minibatch_rows=mb, ring_rows=ring, megakernel=mk)
            tunables = f"comm={comm!s:>4} mb={mb!s:>5} ring={ring!s:>5} pairs={mk.pairs!s:>5} group={mk.group_blocks!s:>4}"
            try:
                y = mok_moe(x, ids, w, fc1, fc2, config=cfg, backend="megakernel")
                torch.cuda.synchronize()
                check_errors()
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                ms = median_ms(lambda: mok_moe(x, ids, w, fc1, fc2, config=cfg, backend="megakernel"))
                check_errors()
            except Exception as e:  # report and go on with the next setting
                print(f"L={L:4d} megakernel {tunables}: FAILED {type(e).__name__}: {e}", flush=True)
                failed.append((L, tunables))
                continue
            wrong = not err <= MAX_REL_DIFF  # also catches NaN
            if wrong:
                failed.append((L, tunables))
            print(f"L={L:4d} megakernel {tunables} forward {ms:7.3f} ms  "
                  f"{flop / ms / 1e9:6.1f} TFLOP/s  rel. diff to cuda {err:.2e}{'  WRONG' if wrong else ''}", flush=True)
    del fc1, fc2
    torch.cuda.empty_cache()
sys.exit(1 if failed else 0)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

if [ "$gpus" -ge 2 ]; then
  step "layer benchmark, P = 2 (torchrun): megakernel and cuda backends, Kimi-K2, full and 6 experts/GPU"
  timeout 170 "$py" -m torch.distributed.run --nproc-per-node 2 -m megatron_mok.bench layer --shape kimi-k2 \
    --tokens 4096 --experts-per-gpu full 6 --backends mok-megakernel,mok-cuda --warmup 3 --iters 10 \
    --check-tokens 256 --out "$out" --name layer-mk 2>&1 | tail -n 60
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
fi

step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
