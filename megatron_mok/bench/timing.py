"""Timing: CUDA events on the GPU (host clock on the CPU), medians, and the slowest rank.

A persistent kernel that waits on a peer makes one rank's time meaningless alone, so every
figure is the median over iterations of each rank, then the maximum over ranks. The A/B
statistics of the performance experiments (paired and block timings, position correction) are
not part of the package: tools/perf/ab_stats.py.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


class Stopwatch:
    """Named time points of one iteration, on ``device``'s current stream.

    On a CUDA device each point is a CUDA event recorded on the current stream (no host
    synchronisation until :meth:`ms` is read); on the CPU it is ``time.perf_counter``.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: Dict[str, object] = {}

    def mark(self, name: str) -> None:
        """Record time point ``name`` (a later mark of the same name replaces it)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()

    def ms(self, start: str, end: str) -> float:
        """Milliseconds from point ``start`` to point ``end`` (synchronises on CUDA)."""
        return Stopwatch.between(self.points[start], self.points[end], torch.device("cuda" if self.cuda else "cpu"))

    @staticmethod
    def between(a: object, b: object, device: torch.device) -> float:
        """Milliseconds from recorded point ``a`` to ``b`` (of any stopwatches on ``device``)."""
        if device.type == "cuda":
            b.synchronize()  # type: ignore[union-attr]
            return float(a.elapsed_time(b))  # type: ignore[union-attr]
        return (b - a) * 1e3  # type: ignore[operator]


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def gather_floats(values: Sequence[float], group: Optional[dist.ProcessGroup], device: torch.device) -> List[List[float]]:
    """All-gather a fixed-length list of floats from every rank of ``group``.

    Returns:
        One list per rank, in rank order (just ``[values]`` without a process group).
    """
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [list(values)]
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return [o.cpu().tolist() for o in out]


def slowest_rank_medians(samples: Dict[str, Sequence[float]], group: Optional[dist.ProcessGroup],
                         device: torch.device) -> Dict[str, Dict[str, object]]:
    """For each timed quantity, the median over this rank's iterations, gathered from every
    rank; the reported figure is the largest (slowest rank).

    Args:
        samples: {quantity: per-iteration milliseconds on this rank}, same keys and at
            least one value each on every rank.

    Returns:
        {quantity: {"ms": slowest rank's median, "per_rank_ms": [median of each rank]}}.
    """
    names = sorted(samples)
    medians = [median(samples[n]) for n in names]
    per_rank = gather_floats(medians, group, device)
    return {n: {"ms": max(r[i] for r in per_rank), "per_rank_ms": [r[i] for r in per_rank]}
            for i, n in enumerate(names)}


def align_ranks(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Let every rank finish its queued work and meet, so that timed iterations start
    together (one small all-reduce; synchronises the device before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
