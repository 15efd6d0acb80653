"""Correctness first: a backend's output and gradients compared with the reference backend
on the same inputs, before it is timed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .backends import Grads, Runner, TokenBatch
from .timing import gather_floats

COMPARED = ("y", "x", "topk_weights", "fc1_weight", "fc2_weight")
"""The output and the gradients compared: y, dx, d topk_weights, d fc1_weight, d fc2_weight."""

DEFAULT_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-9}
"""Largest accepted relative error ||a - b|| / ||b|| (Frobenius, over all ranks) per dtype."""


@dataclass
class Outcome:
    """A backend's output and gradients on one batch (references held, not copied)."""

    y: torch.Tensor
    grads: Grads


def run_once(runner: Runner, batch: TokenBatch) -> Outcome:
    """Forward and backward of ``runner`` on ``batch`` from zeroed gradients."""
    runner.zero_grad(batch)
    with runner.context():
        y = runner.forward(batch)
        y.backward(batch.dy)
    grads = runner.grads(batch)
    runner.zero_grad(batch)  # the outcome keeps its own references
    return Outcome(y=y.detach(), grads=grads)


def _sq_norms(a: torch.Tensor, b: torch.Tensor, chunk_elems: int = 1 << 24) -> tuple[float, float]:
    """(||a - b||^2, ||b||^2) in float64, reading large tensors about 16M elements at a time."""
    diff = ref = 0.0
    a2 = a.reshape(a.shape[0], -1) if a.dim() > 1 else a.reshape(-1, 1)
    b2 = b.reshape(b.shape[0], -1) if b.dim() > 1 else b.reshape(-1, 1)
    chunk_rows = max(1, chunk_elems // max(1, a2.shape[1]))
    for lo in range(0, a2.shape[0], chunk_rows):
        ac = a2[lo:lo + chunk_rows].double()
        bc = b2[lo:lo + chunk_rows].double()
        diff += float(((ac - bc) ** 2).sum())
        ref += float((bc ** 2).sum())
    return diff, ref


@dataclass
class CheckResult:
    """Relative errors of a backend against the reference over all ranks.

    Attributes:
        tokens: tokens per rank the check ran on.
        errors: {name in :data:`COMPARED`: ||a - b|| / ||b||}, NaN where the backend gave no
            gradient or a wrong shape.
        tol: the accepted error.
    """

    tokens: int
    tol: float
    errors: Dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(math.isfinite(e) and e <= self.tol for e in self.errors.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {v:.2e}" for k, v in self.errors.items())

    def to_json(self) -> Dict[str, object]:
        return {"tokens_per_gpu": self.tokens, "tol": self.tol, "passed": self.passed,
                "rel_errors": {k: (v if math.isfinite(v) else None) for k, v in self.errors.items()}}


def compare(got: Outcome, want: Outcome, *, tokens: int, tol: float,
            group: Optional[dist.ProcessGroup], device: torch.device) -> CheckResult:
    """Relative Frobenius errors of ``got`` against ``want``, summed over the ranks of
    ``group`` (a collective when it has more than one rank)."""
    pairs = {"y": (got.y, want.y)}
    for name in COMPARED[1:]:
        pairs[name] = (got.grads.get(name), want.grads.get(name))
    sums = []
    for name in COMPARED:
        a, b = pairs[name]
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            sums += [math.nan, 1.0]
        else:
            sums += list(_sq_norms(a, b))
    per_rank = gather_floats(sums, group, device)
    errors = {}
    for i, name in enumerate(COMPARED):
        diff = sum(r[2 * i] for r in per_rank)
        ref = sum(r[2 * i + 1] for r in per_rank)
        errors[name] = math.sqrt(diff / ref) if ref > 0 else (0.0 if diff == 0 else math.inf)
    return CheckResult(tokens=tokens, tol=tol, errors=errors)
