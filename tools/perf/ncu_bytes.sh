#!/usr/bin/env bash
# DRAM and L2 bytes of the forward megakernel against torch._grouped_mm fc1 + fc2 alone on the
# same expert load (P = 1, one GPU, `ncu --clock-control none`): profiles the CUTLASS launches of
# `megakernel_timeline.py --gemms-alone` and the megakernel's, then prints ncu_bytes.py's
# summary. Needs ncu (on the H200 hosts: /usr/local/cuda/bin/ncu) and the CUDA library.
#
#   bash tools/perf/ncu_bytes.sh EXPERTS_PER_GPU [OUT_DIR]     (writes OUT_DIR/ncu-EXPERTS.csv)
set -uo pipefail
experts=${1:?usage: ncu_bytes.sh EXPERTS_PER_GPU [OUT_DIR]}
out=${2:-${OUT:-/tmp/mok-ncu}}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -z "$ncu" ]; then
  echo "ncu_bytes.sh: ncu (Nsight Compute) is not installed here"; exit 2
fi
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second
# 22 launches: the 16 CUTLASS ones of --gemms-alone (8 calls of fc1 + fc2), then 6 of the
# megakernel (untraced: the timeline traces its last launch only).
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 300 "$ncu" --clock-control none --csv --page raw \
  -k 'regex:forward_kernel|device_kernel' --launch-count 22 --metrics "$metrics" \
  "${MOK_PYTHON_BIN:-python3}" tools/perf/megakernel_timeline.py --experts "$experts" --gemms-alone --iters 2 \
  > "$out/ncu-$experts.csv" 2> "$out/ncu-$experts.err" || { echo "ncu failed:"; tail -n 5 "$out/ncu-$experts.err"; exit 1; }
"${MOK_PYTHON_BIN:-python3}" tools/perf/ncu_bytes.py "$out/ncu-$experts.csv"
