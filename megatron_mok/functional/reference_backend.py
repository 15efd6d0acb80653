"""The ``reference`` backend: the pure-PyTorch oracle of the contract (``megatron_mok/reference.py``),
on any device and dtype, exchanging data with ``torch.distributed`` collectives. Slow on purpose.

It follows the GPU backends' rules, so that a CPU run sees what a GPU run sees
(docs/contract.md, "Errors"):

* **Capacity**: a token capacity per rank, fixed at the first call of a (group, device, H, K, L)
  (``MoKConfig.max_tokens_per_rank``, else the largest token count of any rank then); a later
  call with more tokens raises :class:`MoKCapacityError` on that rank (the GPU backends'
  message) and :class:`MoKPeerError` on the others. One rank (P = 1) grows instead.
* **Bad expert ids**: the call returns NaN on every rank, and every rank's next call (the
  backward of that call included) and ``check_errors()`` raise :class:`MoKRuntimeError` naming
  the rank that held the id; the workspace stays failed, as on the GPU.
* **Rendezvous with a timeout** (``faults.rendezvous``) before each cross-rank step (forward
  dispatch and combine, backward dispatch and combine): a rank that does not arrive within
  ``MoKConfig.timeout_s`` is named in a :class:`MoKTimeoutError` on every rank that waited, and
  the one that opens each call carries every rank's settings, token count, bad ids and whether
  it stopped the call (its own checks failed: then every other rank raises
  :class:`MoKPeerError` at that call). No gloo or NCCL collective is entered before every rank
  is known to be there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.autograd.function import once_differentiable

from ..reference import reference_moe
from .agreement import call_signature
from .backend import CallSpec
from .faults import (SITE_FWD_DISPATCH, MoKCapacityError, MoKPeerError, MoKRuntimeError, bad_id_message,
                     capacity_message, exchange, group_state, peer_failed_message, renew, FAILURE_CAPACITY)
from .groups import EPGroup, LocalEPRank, group_size_rank
from .main_grad import MainGrads, add_into_after_backward


@dataclass
class _ReferenceWorkspace:
    """What the reference backend keeps per (EP group, device, H, K, L), as the GPU backends keep
    a workspace: the token capacity and the failure recorded in it (sticky)."""

    capacity: int
    ep_group: EPGroup
    failure: Optional[BaseException] = None


_workspaces: Dict[tuple, _ReferenceWorkspace] = {}


def reference_failures(ep_group: EPGroup = None) -> List[BaseException]:
    """The failures recorded in the reference backend's workspaces (of ``ep_group``, or all)."""
    return [ws.failure for ws in _workspaces.values()
            if ws.failure is not None and (ep_group is None or ws.ep_group is ep_group)]


def release_reference_workspaces() -> None:
    _workspaces.clear()


def first_bad_id(topk_ids: torch.Tensor, num_experts: int) -> Optional[int]:
    """An id of ``topk_ids`` outside [-1, num_experts), or None. Reads the values (a host sync
    for GPU tensors: only the reference backend does)."""
    if topk_ids.numel() == 0:
        return None
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < -1:
        return lo
    if hi >= num_experts:
        return hi
    return None


class _FailedCall(torch.autograd.Function):
    """The output of a call that failed on the device's terms (a bad expert id on some rank):
    NaN, as the GPU backends return; its backward raises the recorded error (the next MoK
    call)."""

    @staticmethod
    def forward(ctx, workspace, x, *differentiable):
        ctx.workspace = workspace
        return torch.full_like(x, float("nan"))

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        raise renew(ctx.workspace.failure)


class ReferenceBackend:
    """Runs wherever ``torch.distributed`` does, except on virtual ranks (one process)."""

    name = "reference"

    def unavailable_reason(self, spec: CallSpec) -> Optional[str]:
        if isinstance(spec.ep_group, LocalEPRank):
            return ("the reference backend exchanges data with torch.distributed collectives; "
                    "virtual ranks (LocalEPGroup) run only the GPU backends")
        return None

    def run(self, spec: CallSpec, x, topk_ids, topk_weights, fc1s, fc2s,
            main_grads: Optional[MainGrads] = None) -> torch.Tensor:
        """y [T, H] in x's dtype; weight segments are concatenated (a copy). With ``main_grads``
        the weights' gradients are added into them after the backward (main_grad.py)."""
        shape, config, group = spec.shape, spec.config, spec.ep_group
        P, rank = group_size_rank(group)
        key = ("single" if group is None else group.group_name, str(x.device), shape.hidden, shape.topk,
               shape.experts_per_rank)
        ws = _workspaces.get(key)
        if ws is not None and ws.failure is not None:
            raise renew(ws.failure)
        E = shape.experts_per_rank * P
        bad = first_bad_id(topk_ids, E)
        timeout_s = float(config.timeout_s)
        if P > 1:
            signature = call_signature(config, shape.hidden, shape.topk, shape.experts_per_rank, shape.ffn_hidden,
                                       spec.dtype, self.name)
            payloads = exchange(group, SITE_FWD_DISPATCH, "call", timeout_s, signature=signature,
                                tokens=shape.tokens, bad_id=bad)
            group_state(group).last_path = "reference"
            tokens = [int(p["tokens"]) for p in payloads]
            bad_ids = [(r, p["bad_id"]) for r, p in enumerate(payloads) if p["bad_id"] is not None]
        else:
            tokens = [shape.tokens]
            bad_ids = [(0, bad)] if bad is not None else []

        # Capacity, as the GPU workspace: fixed at the first call, one rank grows.
        if ws is None:
            if P == 1:
                capacity = max(shape.tokens, config.max_tokens_per_rank or 0)
            else:
                capacity = config.max_tokens_per_rank or max(tokens)
            ws = _workspaces[key] = _ReferenceWorkspace(capacity=max(capacity, 1), ep_group=group)
        elif P == 1 and shape.tokens > ws.capacity:
            ws.capacity = shape.tokens
        over = [r for r, t in enumerate(tokens) if t > ws.capacity]
        if over:
            if rank in over:
                raise MoKCapacityError(capacity_message(group, rank, tokens[rank], ws.capacity))
            r = over[0]
            raise MoKPeerError(peer_failed_message(group, rank, r, FAILURE_CAPACITY,
                                                   capacity_message(group, r, tokens[r], ws.capacity),
                                                   at_this_call=True))
        if bad_ids:
            ws.failure = MoKRuntimeError(bad_id_message(group, bad_ids, E))
            return _FailedCall.apply(ws, x, topk_weights, *fc1s, *fc2s)

        if main_grads is not None:
            fc1s, fc2s = add_into_after_backward(main_grads, fc1s, fc2s)
        fc1, fc2 = (fc1s[0], fc2s[0]) if len(fc1s) == 1 else (torch.cat(fc1s), torch.cat(fc2s))

        def checkpoint(site: int) -> None:  # the later cross-rank steps: every rank there, or a clear error
            exchange(group, site, f"site {site}", timeout_s)

        return reference_moe(x, topk_ids, topk_weights, fc1, fc2, ep_group=group, tile_rows=config.tile_rows,
                             checkpoint=checkpoint if P > 1 else None)
