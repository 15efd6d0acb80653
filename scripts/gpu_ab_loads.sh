#!/usr/bin/env bash
# One launch switch A against B in paired blocks (A B B A B A A B) at several expert loads on
# two H200s, several runs each, then the readings corrected for the blocks' positions
# (scripts/ab_positions.py, with the earlier sessions' runs in docs/bench/ab-s*-h200x2.txt for
# the profile): what a default needs before it changes (docs/perf-notes.md, twentieth session,
# section 4: differences under ~0.05 ms corrected are level).
#
#   scripts/gpu_ab_loads.sh NAME=A,B [OUT_DIR] [LOADS] [RUNS]
#   e.g. scripts/gpu_ab_loads.sh MOK_MEGAKERNEL_GROUP_BLOCKS=8,16 "$OUT" "48 6 192" 3
#
# LOADS: experts per GPU (default "48 6 192"); RUNS: runs per load (default 3; the correction
# needs three). Writes OUT_DIR/ab.txt (the timeline's lines) and OUT_DIR/ab-corrected.txt. About
# 30 s per run on the H200 machines: the defaults take ~5 minutes. Needs a prebuilt $MOK_LIBRARY
# to stay within one device call.
set -uo pipefail
if [[ $# -lt 1 || "$1" != *=*,* ]]; then
  echo "usage: scripts/gpu_ab_loads.sh NAME=A,B [OUT_DIR] [LOADS] [RUNS]" >&2
  exit 2
fi
ab=$1
loads=${3:-48 6 192}
runs=${4:-3}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "${2:-}" /tmp/mok-ab-loads
: > "$out/ab.txt"
for experts in $loads; do
  for ((i = 1; i <= runs; i++)); do
    step "$ab at $experts experts per GPU, run $i of $runs"
    timeout 90 "$py" -m torch.distributed.run --nproc-per-node 2 scripts/megakernel_timeline.py \
      --experts "$experts" --ab "$ab" --blocks --rounds 20 2>&1 | grep -E "by block|rror" | tee -a "$out/ab.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
  done
done
step "corrected for the blocks' positions"
"$py" scripts/ab_positions.py docs/bench/ab-s*-h200x2.txt "$out/ab.txt" | tee "$out/ab-corrected.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
