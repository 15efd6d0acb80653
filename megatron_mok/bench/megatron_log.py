"""Reading Megatron's training log: the arguments block and the per-iteration lines that
``megatron.training.training.training_log`` prints, e.g.

    ------------------------ arguments ------------------------
      seq_length ...................................... 4096
    -------------------- end of arguments ---------------------
     [2026-11-29 12:00:00.000000] iteration        5/      20 | consumed samples: 80 |
     elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 321.0 |
     learning rate: 1.0E-04 | global batch size:    16 | lm loss: 1.0E+01 | ...

(one line in the log). Megatron-Core 0.19.2 prints no tokens/s; it is derived from the global
batch size, the sequence length, the world size and the step time.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

_ARGS_BEGIN = re.compile(r"^-+ arguments -+$")
_ARGS_END = re.compile(r"^-+ end of arguments -+$")
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
_TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.]+)")
_BATCH = re.compile(r"global batch size:\s*(\d+)")
_LOSS = re.compile(r"\blm loss:\s*([-+0-9.eE]+)")
_TOKENS = re.compile(r"tokens per second per GPU[^:|]*:\s*([0-9.]+)")


class LogError(ValueError):
    """The log does not hold what the comparison needs; the message says what is missing."""


@dataclass(frozen=True)
class Iteration:
    """One logged training iteration.

    Attributes:
        iteration: its number (1-based, as Megatron counts).
        elapsed_ms: step time, ms (averaged over the log interval).
        global_batch_size: sequences per step.
        tflops_per_gpu: Megatron's throughput figure (with --log-throughput), else None.
        lm_loss: the language-model loss, else None.
        tokens_per_s_per_gpu: printed by the launcher, else None.
    """

    iteration: int
    elapsed_ms: float
    global_batch_size: Optional[int]
    tflops_per_gpu: Optional[float]
    lm_loss: Optional[float]
    tokens_per_s_per_gpu: Optional[float]


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
    """Every line with an iteration number and a step time, in log order."""
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
    losses = [it.lm_loss for it in iterations if it.lm_loss is not None]
    return {
        "step_ms": step_ms,
        "step_ms_per_iteration": [it.elapsed_ms for it in measured],
        "iterations_measured": len(measured),
        "tokens_per_s_per_gpu": tokens,
        "tflops_per_gpu": statistics.median(tflops) if tflops else None,
        "lm_loss_last": losses[-1] if losses else None,
        "world_size": world_size,
        "seq_length": seq_length,
        "global_batch_size": gbs,
    }
