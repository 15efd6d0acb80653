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

__all__ = ["IterationLog", "parse_training_log", "RunSummary", "summarize", "compare_losses",
           "CurveComparison", "compare_curves"]

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


@dataclass(frozen=True)
class CurveComparison:
    """Two loss curves judged the way bf16 training allows.

    Two correct implementations that round differently follow the same trajectory for the
    first iterations and then decorrelate, fastest once the loss is small and noisy (mock data
    is memorised within tens of iterations): per-iteration relative differences late in a run
    measure that chaos, not correctness. So the verdict rests on (a) the early iterations,
    where a wrong layer shows at once, compared point by point, and (b) the whole run compared
    as means over windows of iterations, relative to the first loss (the scale of the curve).
    """

    early_iterations: int
    early_max_relative: float      # max |a - b| / |a| over the first iterations both logged
    windows: int
    window_max_shift: float        # max |mean_a - mean_b| / first loss over the windows

    def agree(self, early_bound: float = 0.03, window_bound: float = 0.02) -> bool:
        """True if both measures are within their bounds (and something was compared)."""
        return (self.early_iterations > 0 and self.early_max_relative <= early_bound
                and self.windows > 0 and self.window_max_shift <= window_bound)


def compare_curves(a: Sequence[IterationLog], b: Sequence[IterationLog], early: int = 10,
                   window: int = 10) -> CurveComparison:
    """Compare two runs' LM loss curves over the iterations both logged (see
    :class:`CurveComparison`): point by point over the first ``early`` of them, and as means over
    consecutive windows of ``window`` of them, relative to ``a``'s first loss."""
    by_iter = {entry.iteration: entry.lm_loss for entry in b}
    pairs = [(entry.lm_loss, by_iter[entry.iteration]) for entry in a if entry.iteration in by_iter]
    head = [abs(x - y) / abs(x) for x, y in pairs[:early] if x != 0]
    scale = abs(pairs[0][0]) if pairs and pairs[0][0] != 0 else float("nan")
    shifts = []
    for start in range(0, len(pairs) - window + 1, window):
        chunk = pairs[start:start + window]
        mean_a = sum(x for x, _ in chunk) / window
        mean_b = sum(y for _, y in chunk) / window
        shifts.append(abs(mean_a - mean_b) / scale)
    return CurveComparison(
        early_iterations=len(head),
        early_max_relative=max(head) if head else float("nan"),
        windows=len(shifts),
        window_max_shift=max(shifts) if shifts else float("nan"),
    )
