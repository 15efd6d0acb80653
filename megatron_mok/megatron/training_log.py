"""Reading Megatron's training log: the arguments block and the per-iteration lines that
``megatron.training.training.training_log`` prints, e.g.::

    ------------------------ arguments ------------------------
      seq_length ...................................... 4096
    -------------------- end of arguments ---------------------
     [2026-11-29 12:00:00.000000] iteration        5/      20 | consumed samples: 80 |
     elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 321.0 |
     learning rate: 1.0E-04 | global batch size:    16 | lm loss: 1.0E+01 | ...

(one line per iteration in the log). One parser (:func:`parse_log`, :func:`parse_iterations`)
serves two readers:

* the end-to-end benchmark (``python -m megatron_mok.bench e2e``): :func:`summarize`, step time
  and tokens/s per GPU after warm-up. Megatron-Core 0.19.2 prints no tokens/s; it is derived
  from the global batch size, the sequence length, the world size and the step time;
* ``examples/compare_logs.py``, an ``alltoall`` run next to a ``mok`` run: :func:`summarize_run`,
  :func:`compare_losses` and :func:`compare_curves` over the iterations that carry an LM loss.

:func:`parse_memory` reads the memory reports Megatron prints (``[Rank 0] (after 30 iterations)
memory (MB) | allocated: ... | max allocated: ... | reserved: ... | max reserved: ...``, after
the first logged iteration and every ``--log-memory-interval`` iterations): the peak over the
run and the ranks that report.

The parser is plain Python: it imports no Megatron code.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "LogError", "Iteration", "parse_log", "parse_args_block", "parse_iterations", "losses", "parse_memory",
    "summarize", "RunSummary", "summarize_run", "compare_losses", "CurveComparison", "compare_curves",
]

_ARGS_BEGIN = re.compile(r"^-+ arguments -+$")
_ARGS_END = re.compile(r"^-+ end of arguments -+$")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.]+)")
_BATCH = re.compile(r"global batch size:\s*(\d+)")
_LOSS = re.compile(r"\blm loss:\s*([-+0-9.eE]+)")
_TOKENS = re.compile(r"tokens per second per GPU[^:|]*:\s*([0-9.]+)")
_MEMORY = re.compile(r"\[Rank (\d+)\].*memory \(MB\).*\| max allocated:\s*([0-9.]+).*\| max reserved:\s*([0-9.]+)")


class LogError(ValueError):
    """The log does not hold what the comparison needs; the message says what is missing."""


@dataclass(frozen=True)
class Iteration:
    """One logged training iteration.

    Attributes:
        iteration: its number (1-based, as Megatron counts).
        elapsed_ms: step time, ms (averaged over the log interval).
        global_batch_size: sequences per step, else None.
        tflops_per_gpu: Megatron's throughput figure (with --log-throughput), else None.
        lm_loss: the language-model loss, else None.
        tokens_per_s_per_gpu: printed by the launcher, else None.
    """

    iteration: int
    elapsed_ms: float
    global_batch_size: Optional[int] = None
    tflops_per_gpu: Optional[float] = None
    lm_loss: Optional[float] = None
    tokens_per_s_per_gpu: Optional[float] = None


# ----------------------------------------------------------------------------------------------
# Parsing.


def parse_args_block(lines: Sequence[str]) -> Dict[str, str]:
    """The first ``arguments`` block of the log: {argument name: printed value}."""
    out: Dict[str, str] = {}
    inside = False
    for line in lines:
        text = line.strip()
        if not inside:
            inside = bool(_ARGS_BEGIN.match(text))
            continue
        if _ARGS_END.match(text):
            break
        parts = text.split(None, 1)
        if len(parts) == 2:
            out[parts[0]] = parts[1].lstrip(".").strip()
        elif parts:
            out[parts[0]] = ""
    return out


def _group(pattern: re.Pattern, line: str, kind):
    m = pattern.search(line)
    return kind(m.group(1)) if m else None


def parse_iterations(lines: Sequence[str]) -> List[Iteration]:
    """Every line with an iteration number and a step time, in log order (other lines, e.g.
    other ranks' output interleaved, are skipped)."""
    out = []
    for line in lines:
        it = _ITERATION.search(line)
        elapsed = _ELAPSED.search(line)
        if not it or not elapsed:
            continue
        out.append(Iteration(
            iteration=int(it.group(1)),
            elapsed_ms=float(elapsed.group(1)),
            global_batch_size=_group(_BATCH, line, int),
            tflops_per_gpu=_group(_TFLOPS, line, float),
            lm_loss=_group(_LOSS, line, float),
            tokens_per_s_per_gpu=_group(_TOKENS, line, float),
        ))
    return out


def parse_log(text: str) -> Tuple[Dict[str, str], List[Iteration]]:
    """(arguments, iterations) of a whole log."""
    lines = text.splitlines()
    return parse_args_block(lines), parse_iterations(lines)


def parse_memory(lines: Sequence[str]) -> Optional[Dict[str, object]]:
    """The peak device memory Megatron's memory reports show, or None when the log has none.

    Returns:
        {"max_allocated_mb": largest "max allocated" of any report, "max_reserved_mb": largest
        "max reserved", "ranks": the ranks that reported, sorted}. PyTorch's "max" figures are
        peaks since the process started, so the last report of a rank holds its peak.
    """
    allocated = reserved = 0.0
    ranks = set()
    for line in lines:
        m = _MEMORY.search(line)
        if m:
            ranks.add(int(m.group(1)))
            allocated = max(allocated, float(m.group(2)))
            reserved = max(reserved, float(m.group(3)))
    if not ranks:
        return None
    return {"max_allocated_mb": allocated, "max_reserved_mb": reserved, "ranks": sorted(ranks)}


def losses(iterations: Sequence[Iteration]) -> List[Iteration]:
    """The iterations that carry an LM loss, in order (the loss curve)."""
    return [it for it in iterations if it.lm_loss is not None]


# ----------------------------------------------------------------------------------------------
# Throughput (the end-to-end benchmark).


def _int_arg(args: Dict[str, str], name: str) -> Optional[int]:
    try:
        return int(args[name])
    except (KeyError, ValueError):
        return None


def summarize(args: Dict[str, str], iterations: Sequence[Iteration], *, skip: int,
              world_size: Optional[int] = None, seq_length: Optional[int] = None) -> Dict[str, object]:
    """Step time and throughput of the iterations after the first ``skip``.

    Args:
        args: the arguments block (gives seq_length and world_size when not passed).
        iterations: the logged iterations.
        skip: iterations (by number) counted as warm-up and left out.
        world_size, seq_length: override what the arguments block says.

    Returns:
        {"step_ms": median step time, "step_ms_per_iteration", "iterations_measured",
        "tokens_per_s_per_gpu" (global batch * seq length / step time / world size, or the
        launcher's printed figure), "tflops_per_gpu" (median, or None), "lm_loss_last",
        "world_size", "seq_length", "global_batch_size"}.

    Raises:
        LogError: no iteration after the warm-up, or no sequence length / world size.
    """
    measured = [it for it in iterations if it.iteration > skip]
    if not measured:
        raise LogError(f"no logged iteration after the first {skip} (warm-up); the log has "
                       f"{len(iterations)} iteration line(s)")
    world_size = world_size or _int_arg(args, "world_size")
    seq_length = seq_length or _int_arg(args, "seq_length")
    step_ms = statistics.median(it.elapsed_ms for it in measured)
    gbs = measured[-1].global_batch_size or _int_arg(args, "global_batch_size")
    printed = [it.tokens_per_s_per_gpu for it in measured if it.tokens_per_s_per_gpu is not None]
    if printed:
        tokens = statistics.median(printed)
    else:
        missing = [n for n, v in (("world_size", world_size), ("seq_length", seq_length),
                                  ("global batch size", gbs)) if not v]
        if missing:
            raise LogError(f"cannot compute tokens/s: the log gives no {', '.join(missing)}")
        tokens = gbs * seq_length / (step_ms * 1e-3) / world_size
    tflops = [it.tflops_per_gpu for it in measured if it.tflops_per_gpu is not None]
    curve = losses(iterations)
    return {
        "step_ms": step_ms,
        "step_ms_per_iteration": [it.elapsed_ms for it in measured],
        "iterations_measured": len(measured),
        "tokens_per_s_per_gpu": tokens,
        "tflops_per_gpu": statistics.median(tflops) if tflops else None,
        "lm_loss_last": curve[-1].lm_loss if curve else None,
        "world_size": world_size,
        "seq_length": seq_length,
        "global_batch_size": gbs,
    }


# ----------------------------------------------------------------------------------------------
# Loss curves (two runs side by side).


@dataclass(frozen=True)
class RunSummary:
    """First and last loss of a run and its throughput after warm-up."""

    iterations: int
    first_loss: float
    last_loss: float
    median_ms: float
    tokens_per_s: float


def summarize_run(curve: Sequence[Iteration], tokens_per_iteration: int, warmup: int = 5) -> RunSummary:
    """Summary of a loss curve: first/last loss, median iteration time and tokens/s after
    ``warmup`` iterations (the first ones include compilation and allocator warm-up).

    Args:
        curve: parsed iterations that carry an LM loss (:func:`losses`; non-empty).
        tokens_per_iteration: global batch size x sequence length.
        warmup: iterations left out of the timing (fewer if the run is short).
    """
    if not curve:
        raise ValueError("the log holds no iteration with an lm loss")
    timed = sorted(entry.elapsed_ms for entry in curve[min(warmup, len(curve) - 1):])
    median = timed[len(timed) // 2]
    return RunSummary(len(curve), curve[0].lm_loss, curve[-1].lm_loss, median,
                      tokens_per_iteration / (median / 1000.0))


def _common_losses(a: Sequence[Iteration], b: Sequence[Iteration]) -> List[Tuple[float, float]]:
    """(loss of a, loss of b) for every iteration both runs logged a loss for, in a's order."""
    by_iter = {entry.iteration: entry.lm_loss for entry in b if entry.lm_loss is not None}
    return [(entry.lm_loss, by_iter[entry.iteration]) for entry in a
            if entry.lm_loss is not None and entry.iteration in by_iter]


def compare_losses(a: Sequence[Iteration], b: Sequence[Iteration]) -> Tuple[int, float, float]:
    """(iterations compared, max and mean relative loss difference |a - b| / |a|) over the
    iterations both runs logged."""
    diffs = [abs(x - y) / abs(x) for x, y in _common_losses(a, b) if x != 0]
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


def compare_curves(a: Sequence[Iteration], b: Sequence[Iteration], early: int = 10,
                   window: int = 10) -> CurveComparison:
    """Compare two runs' LM loss curves over the iterations both logged (see
    :class:`CurveComparison`): point by point over the first ``early`` of them, and as means over
    consecutive windows of ``window`` of them, relative to ``a``'s first loss."""
    pairs = _common_losses(a, b)
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
