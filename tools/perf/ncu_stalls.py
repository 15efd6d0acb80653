"""Where a kernel's warps wait, from Nsight Compute's warp-stall sampling: reads the CSV of

    ncu --clock-control none -k regex:KERNEL --launch-skip N --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --page source --csv --print-source sass \\
        python tools/perf/gemm_profile_case.py --kernels wgrad-fc1 > stalls.csv
    python tools/perf/ncu_stalls.py stalls.csv [--top 20]

and prints each stall reason's share of all samples, then the SASS lines with the most samples,
each with its share and its three largest reasons. A share is of the samples of every warp, the
producer's and the idle ones included, so read a line by its instruction: a `try_wait` branch of
a consumer is a wait for a full stage, a `WARPGROUP.DEPBAR` a wait for the wgmmas in flight.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from typing import Dict, List, Tuple

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_csv(text: str) -> Tuple[List[str], List[Dict[str, float]], List[Tuple[str, str]]]:
    """The SASS lines of an `ncu --page source --csv` output: (the stall reasons, per line a dict
    of reason -> samples with the total under :data:`ALL_SAMPLES`, per line (address, source)).
    Lines before the header (the program's output, ncu's notes, the kernel name) are skipped."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address" and ALL_SAMPLES in r), None)
    if start is None:
        raise ValueError(f"no source-page header (\"Address\" ... \"{ALL_SAMPLES}\"): run ncu with "
                         "--section SourceCounters --page source --csv --print-source sass")
    header = rows[start]
    reasons = [c for c in header if c.startswith("stall_") and "(Not Issued)" not in c]
    col = {c: header.index(c) for c in reasons + [ALL_SAMPLES]}
    src = header.index("Source")
    samples, lines = [], []
    for r in rows[start + 1:]:
        if len(r) != len(header):
            continue
        samples.append({c: _num(r[j]) for c, j in col.items()})
        lines.append((r[0], r[src]))
    return reasons, samples, lines


def summarize(reasons: List[str], samples: List[Dict[str, float]], lines: List[Tuple[str, str]], top: int) -> str:
    """The report described in the module docstring."""
    total = sum(s[ALL_SAMPLES] for s in samples)
    if total <= 0:
        raise ValueError("no warp-stall samples in the input")
    by_reason = sorted(((sum(s[c] for s in samples) / total, c) for c in reasons), reverse=True)
    out = [f"{len(lines)} SASS lines, {total:.0f} samples"]
    out.append("by reason: " + ", ".join(f"{c[len('stall_'):]} {100 * f:.1f}%" for f, c in by_reason if f >= 0.005))
    order = sorted(range(len(lines)), key=lambda i: -samples[i][ALL_SAMPLES])[:top]
    for i in order:
        s = samples[i]
        why = sorted(((s[c], c) for c in reasons), reverse=True)[:3]
        why_text = ", ".join(f"{c[len('stall_'):]} {100 * v / total:.1f}%" for v, c in why if v > 0)
        out.append(f"{100 * s[ALL_SAMPLES] / total:5.1f}%  {lines[i][0]}  {lines[i][1].strip()[:70]:70s}  {why_text}")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="the ncu --page source --csv output ('-' for standard input)")
    ap.add_argument("--top", type=int, default=20, help="SASS lines to print")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if args.csv == "-" else open(args.csv).read()
    print(summarize(*read_source_csv(text), top=args.top))


if __name__ == "__main__":
    main()
