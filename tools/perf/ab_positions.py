"""Paired block timings corrected for where their blocks ran.

`tools/perf/megakernel_timeline.py --ab ... --blocks` (and `--ab-settings`) runs two variants in
blocks A B B A B A A B and prints each variant's median per block. The blocks at some positions
run faster or slower whatever the variant, by as much as the changes being compared
(tools/perf/ab_stats.py). Given the output of several such runs at one load, this prints for
each run B - A on the block medians as they are, without the first block, and corrected by the
other runs' mean position profile (`ab_stats.position_corrected`).

    python tools/perf/ab_positions.py OUTPUT.txt [...]     (or the output on standard input)

Runs are grouped by their load (the `L=...` the line starts with, e.g. `L=48`; rename it, say to
`L=48-grad`, to keep runs of another kind apart); a load needs three runs or more. A run's profile
holds the other runs' own B - A too: give runs of several changes (or A/A runs) at a load, else
the correction takes the change itself out.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for ab_stats' imports

from ab_stats import BLOCK_ORDER, b_minus_a, blocks_by_position, position_corrected  # noqa: E402

BLOCKS = re.compile(r"(?:^|; )([^;]*?) by block ((?:\d+\.\d+ ?)+)")


def parse_runs(text: str) -> Dict[str, List[Tuple[str, List[float]]]]:
    """Timeline output -> {load: [(label "A against B", block medians in the order they ran)]}.
    A line is a run when it holds exactly two "NAME by block m1 m2 ..." lists whose lengths match
    the block order (A's first); the load is its leading `L=...` word, else "?". Bound lines (megakernel
    against torch alone) are skipped: their two sides are not variants of one launch."""
    runs: Dict[str, List[Tuple[str, List[float]]]] = defaultdict(list)
    n_a, n_b = BLOCK_ORDER.count("A"), BLOCK_ORDER.count("B")
    for line in text.splitlines():
        if "ratio" in line:
            continue
        found = BLOCKS.findall(line)
        if len(found) != 2:
            continue
        (name_a, a), (name_b, b) = [(name.strip(), [float(v) for v in values.split()]) for name, values in found]
        if (len(a), len(b)) != (n_a, n_b):
            continue
        blocks = blocks_by_position(a, b, 1)  # one "call" per block: its median
        load = re.match(r"\s*(L=[^\s:]+)", line)
        runs[load.group(1) if load else "?"].append((f"{name_a or '(default)'} against {name_b or '(default)'}",
                                                     blocks))
    return runs


def report(runs: Dict[str, List[Tuple[str, List[float]]]]) -> List[str]:
    """The table's lines: per load and run, B - A in ms four ways."""
    lines = ["load | run | B - A | without the first block | corrected | corrected, without the first block"]
    for load, items in runs.items():
        if len(items) < 3:
            lines.append(f"{load} | {len(items)} run(s): a position profile needs three or more")
            continue
        blocks = [b for _, b in items]
        corrected = position_corrected(blocks)
        corrected_skip = position_corrected(blocks, skip_first=True)
        for (label, run), c, cs in zip(items, corrected, corrected_skip):
            lines.append(f"{load} | {label} | {b_minus_a(run):+.3f} | {b_minus_a(run, skip_first=True):+.3f} | "
                         f"{c:+.3f} | {cs:+.3f}")
    return lines


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="timeline outputs (default: standard input)")
    args = ap.parse_args(argv)
    text = "\n".join(Path(f).read_text() for f in args.files) if args.files else sys.stdin.read()
    runs = parse_runs(text)
    if not runs:
        print("no paired block runs found (lines with two 'NAME by block m1 m2 ...' lists)")
        return 2
    print("\n".join(report(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
