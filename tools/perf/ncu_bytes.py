"""DRAM and L2 bytes of the forward megakernel against torch._grouped_mm fc1 + fc2 alone, from
an `ncu --csv --page raw` run of `megakernel_timeline.py --gemms-alone` (P = 1, one GPU):

    bash tools/perf/ncu_bytes.sh 48 OUT_DIR     (runs ncu, then this script on its CSV)
    python tools/perf/ncu_bytes.py OUT_DIR/ncu-48.csv

Prints, per side, the median over its profiled calls of the kernel time, DRAM bytes read and
written, L2 bytes and the SM throughput (for torch: fc1 and fc2 apiece and their sum; its two
launches of a call share one kernel name, so they are told apart by their order, fc1 first).
Times under ncu are of kernels run one at a time, not in the card's steady state under the power
cap: compare bytes here, times with `megakernel_timeline.py --bound`.
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from typing import Dict, List

METRICS = {
    "time_ms": ("gpu__time_duration.sum", 1e-6),
    "dram_read_gb": ("dram__bytes_read.sum", 1e-9),
    "dram_write_gb": ("dram__bytes_write.sum", 1e-9),
    "l2_gb": ("lts__t_bytes.sum", 1e-9),
    "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
}
"""Our name -> (ncu metric, scale from ncu's base unit: ns, bytes, %)."""
CLOCK = ("clock_mhz", "sm__cycles_elapsed.avg.per_second", 1e-6)
"""Optional: the SM clock during the kernel (MHz), printed when the CSV has it."""
MEGAKERNEL = "forward_kernel"
TORCH_GEMM = "device_kernel"  # CUTLASS's kernel entry, as torch._grouped_mm launches it


def read_ncu_csv(text: str) -> List[Dict[str, object]]:
    """The kernels of an `ncu --csv --page raw` output: one dict per profiled launch with
    "name" (str) and the :data:`METRICS` keys (float), and "clock_mhz" when ncu measured it. Lines before the CSV header (the
    program's own output, ncu's notes) and the units row after it are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"') and "Kernel Name" in line), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\" that names \"Kernel Name\") in the input")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    missing = [metric for metric, _ in METRICS.values() if metric not in header]
    if missing:
        raise ValueError(f"ncu CSV lacks the metrics {missing}; run ncu with --metrics {','.join(m for m, _ in METRICS.values())}")
    name_col = header.index("Kernel Name")
    metrics = dict(METRICS)
    if CLOCK[1] in header:
        metrics[CLOCK[0]] = CLOCK[1:]
    kernels = []
    for row in rows[1:]:
        if len(row) != len(header) or row[header.index("ID")] == "":  # the units row has no ID
            continue
        kernel: Dict[str, object] = {"name": row[name_col]}
        for key, (metric, scale) in metrics.items():
            kernel[key] = float(row[header.index(metric)].replace(",", "")) * scale
        kernels.append(kernel)
    return kernels


def _median(kernels: List[Dict[str, object]]) -> Dict[str, float]:
    return {key: statistics.median(float(k[key]) for k in kernels) for key in kernels[0] if key != "name"}


def summarize(kernels: List[Dict[str, object]]) -> Dict[str, Dict[str, float]]:
    """Medians per side: "megakernel" (every forward_kernel launch), "torch fc1" and "torch fc2"
    (the CUTLASS launches in order, fc1 first) and "torch fc1 + fc2" (the pairs' sums; its
    sm_pct and clock_mhz are time-weighted means). A side with no launch is left out; an odd number of
    CUTLASS launches is an error (a call's fc2 is missing)."""
    out: Dict[str, Dict[str, float]] = {}
    mk = [k for k in kernels if MEGAKERNEL in str(k["name"])]
    if mk:
        out["megakernel"] = _median(mk)
    gemms = [k for k in kernels if TORCH_GEMM in str(k["name"])]
    if gemms:
        if len(gemms) % 2:
            raise ValueError(f"{len(gemms)} torch._grouped_mm launches: expected fc1 and fc2 of each call")
        fc1, fc2 = gemms[0::2], gemms[1::2]
        calls = []
        for a, b in zip(fc1, fc2):
            both = {key: float(a[key]) + float(b[key]) for key in METRICS}
            for key in ("sm_pct", CLOCK[0]):  # time-weighted means
                if key in a:
                    both[key] = (float(a[key]) * float(a["time_ms"]) + float(b[key]) * float(b["time_ms"])) / both["time_ms"]
            calls.append(both)
        out["torch fc1"] = _median(fc1)
        out["torch fc2"] = _median(fc2)
        out["torch fc1 + fc2"] = _median(calls)
    return out


def format_summary(summary: Dict[str, Dict[str, float]]) -> str:
    """One line per side: time, DRAM read / written, L2 bytes, SM throughput (and clock)."""
    return "\n".join(
        f"{side}: {m['time_ms']:.3f} ms, DRAM read {m['dram_read_gb']:.2f} GB, written {m['dram_write_gb']:.2f} GB, "
        f"L2 {m['l2_gb']:.1f} GB, SM throughput {m['sm_pct']:.1f}%"
        + (f", SM clock {m[CLOCK[0]]:.0f} MHz" if CLOCK[0] in m else "")
        for side, m in summary.items())


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="the output of `ncu --csv --page raw` (ncu_bytes.sh writes it)")
    args = ap.parse_args(argv)
    with open(args.csv) as f:
        print(format_summary(summarize(read_ncu_csv(f.read()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
