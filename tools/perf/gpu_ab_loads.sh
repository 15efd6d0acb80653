#!/usr/bin/env bash
# One tunable A against B in paired blocks (A B B A B A A B) at several expert loads on two
# H200s, several runs each, then the readings corrected for the blocks' positions
# (tools/perf/ab_positions.py): what a default needs before it changes (differences under
# ~0.05 ms corrected are level).
#
#   tools/perf/gpu_ab_loads.sh FIELD=A,B [OUT_DIR] [LOADS] [RUNS] [-- TIMELINE_ARGS...]
#   e.g. tools/perf/gpu_ab_loads.sh group_blocks=8,16 "$OUT" "48 6 192" 3
#        tools/perf/gpu_ab_loads.sh pairs=off,on "$OUT" "6 192" 3 -- --training
#
# FIELD: a tunable of megakernel_timeline.py --ab (comm, minibatch, ring, pairs, group_blocks).
# LOADS: experts per GPU (default "48 6 192"); RUNS: runs per load (default 3; the correction
# needs three). TIMELINE_ARGS go to every megakernel_timeline.py call (e.g. --training, or
# --settings 8:: for the other fields). $PROFILE_RUNS: files with earlier output of this script
# (ab.txt) whose runs join the position profile. The profile of a load is the mean over its
# other runs, their own B - A included: it needs runs of other changes (or A/A runs, FIELD=A,A)
# at that load, else the correction takes the change itself out. Writes OUT_DIR/ab.txt (the
# timeline's lines) and OUT_DIR/ab-corrected.txt. About 30 s per run on the H200 machines: the
# defaults take ~5 minutes. Needs a prebuilt $MOK_LIBRARY to stay within one device call.
set -uo pipefail
usage="usage: tools/perf/gpu_ab_loads.sh FIELD=A,B [OUT_DIR] [LOADS] [RUNS] [-- TIMELINE_ARGS...]"
if [[ $# -lt 1 || "$1" != *=*,* ]]; then
  echo "$usage" >&2
  exit 2
fi
ab=$1; shift
positional=()
while [[ $# -gt 0 && "$1" != "--" ]]; do positional+=("$1"); shift; done
[[ $# -gt 0 ]] && shift  # the "--"
extra=("$@")
if [[ ${#positional[@]} -gt 3 ]]; then
  echo "$usage" >&2
  exit 2
fi
loads=${positional[1]:-48 6 192}
runs=${positional[2]:-3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/../../scripts/gpu_env.sh" "${positional[0]:-}" /tmp/mok-ab-loads
: > "$out/ab.txt"
for experts in $loads; do
  label=$experts
  [[ " ${extra[*]} " == *" --training "* ]] && label="$experts-grad"
  for ((i = 1; i <= runs; i++)); do
    step "$ab at $experts experts per GPU, run $i of $runs"
    timeout 90 "$py" -m torch.distributed.run --nproc-per-node 2 tools/perf/megakernel_timeline.py \
      --experts "$experts" --ab "$ab" --blocks --rounds 20 "${extra[@]}" 2>&1 \
      | grep -E "by block|rror" | sed "s/^L=$experts /L=$label /" | tee -a "$out/ab.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
  done
done
step "corrected for the blocks' positions"
# shellcheck disable=SC2086  # PROFILE_RUNS is a list of paths
"$py" tools/perf/ab_positions.py ${PROFILE_RUNS:-} "$out/ab.txt" | tee "$out/ab-corrected.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
step "done: $([ $failed -eq 0 ] && echo all steps passed || echo SOME STEP FAILED)"
exit $failed
