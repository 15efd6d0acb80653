"""Reading Megatron's training log: per-iteration LM loss and time, and comparing two runs.

Megatron prints one line per logged iteration, e.g.::

    [2026-11-29 20:00:00.000000] iteration        7/      50 | consumed samples: 7 |
    elapsed time per iteration (ms): 812.3 | ... | lm loss: 1.034567E+01 | ...

Used by ``examples/compare_logs.py`` to put an ``alltoall`` run and a ``mok`` run side by side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Sequence

__all__ = ["IterationLog", "parse_training_log", "RunSummary", "summarize", "compare_losses"]

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_LM_LOSS = re.compile(r"\blm loss:\s*([0-9.Ee+-]+)")


@dataclass(frozen=True)
class IterationLog:
    """One logged iteration: its number, LM loss and wall time in milliseconds."""

    iteration: int
    lm_loss: float
    elapsed_ms: float


def parse_training_log(text: str) -> List[IterationLog]:
    """Every iteration line of a Megatron log that carries an LM loss, in order.

    Args:
        text: the log (stdout of rank 0, or every rank's output interleaved: lines without an
            LM loss are skipped).
    """
    out: List[IterationLog] = []
    for line in text.splitlines():
        it, loss, elapsed = _ITERATION.search(line), _LM_LOSS.search(line), _ELAPSED.search(line)
        if it and loss and elapsed:
            out.append(IterationLog(int(it.group(1)), float(loss.group(1)), float(elapsed.group(1))))
    return out


@dataclass(frozen=True)
class RunSummary:
    """First and last loss of a run and its throughput after warm-up."""

    iterations: int
    first_loss: float
    last_loss: float
    median_ms: float
    tokens_per_s: float


def summarize(log: Sequence[IterationLog], tokens_per_iteration: int, warmup: int = 5) -> RunSummary:
    """Summary of a run: first/last loss, median iteration time and tokens/s after ``warmup``
    iterations (the first ones include compilation and allocator warm-up).

    Args:
        log: parsed iterations (non-empty).
        tokens_per_iteration: global batch size x sequence length.
        warmup: iterations left out of the timing (fewer if the run is short).
    """
    if not log:
        raise ValueError("the log holds no iteration with an lm loss")
    timed = sorted(entry.elapsed_ms for entry in log[min(warmup, len(log) - 1):])
    median = timed[len(timed) // 2]
    return RunSummary(len(log), log[0].lm_loss, log[-1].lm_loss, median, tokens_per_iteration / (median / 1000.0))


def compare_losses(a: Sequence[IterationLog], b: Sequence[IterationLog]) -> tuple:
    """(iterations compared, max and mean relative loss difference |a - b| / |a|) over the
    iterations both runs logged."""
    by_iter = {entry.iteration: entry.lm_loss for entry in b}
    diffs = [abs(entry.lm_loss - by_iter[entry.iteration]) / abs(entry.lm_loss)
             for entry in a if entry.iteration in by_iter and entry.lm_loss != 0]
    if not diffs:
        return 0, float("nan"), float("nan")
    return len(diffs), max(diffs), sum(diffs) / len(diffs)
