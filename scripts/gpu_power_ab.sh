#!/usr/bin/env bash
# Re-times on two H200s, in one device call, what the power cap hides from call-by-call A/B
# timings (docs/perf-notes.md, eleventh session): issue 7's first bound with each side in its
# own steady state (`--bound`), and pair mode against single CTAs in blocks A B B A B A A B
# (`--ab MOK_MEGAKERNEL_PAIRS=0,1 --blocks`), at the four expert loads of issue 7, without grad
# (the bound) and with it (training).
#
#   scripts/gpu_power_ab.sh [OUT_DIR]      (default: $OUT, else /tmp/mok-power-ab)
#
# Writes OUT_DIR/power-ab.log; the exit status is non-zero when a step failed. Every step has a
# time limit; the whole script stays under 10 minutes.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "${1:-}" /tmp/mok-power-ab
run() {  # one timeline call under torchrun; its result lines go to the log
  timeout 90 "$py" -m torch.distributed.run --nproc-per-node 2 scripts/megakernel_timeline.py "$@" 2>&1 \
    | grep -E "ratio|ms, |rror" | tee -a "$out/power-ab.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
}
: > "$out/power-ab.log"

step "issue 7's bound, each side in its own steady state (defaults)"
for experts in 192 128 48 6; do run --experts "$experts" --bound --rounds 30; done

step "pair mode off / on in blocks, without grad"
for experts in 6 48 192; do run --experts "$experts" --ab MOK_MEGAKERNEL_PAIRS=0,1 --blocks --rounds 30; done

step "pair mode off / on in blocks, with grad (the training forward)"
for experts in 6 192; do run --experts "$experts" --training --ab MOK_MEGAKERNEL_PAIRS=0,1 --blocks --rounds 30; done

step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
