"""The ``cuda`` backend: MoK's communication as separate kernels, the expert FFN through
grouped GEMMs on the expert-grouped, tile-padded layout. No host synchronisation anywhere in
forward or backward (every row count stays on the device), so a whole step can be captured
in a CUDA graph.

Forward, on every rank (P ranks, L local experts):

1. publish: copy x, topk_ids, topk_weights into this rank's workspace region; barrier;
2. schedule: the table of routes to this rank's experts, from every rank's ids (peer reads);
3. pull dispatch: x rows and router weights from their source ranks, grouped by expert;
4. fc1 (grouped GEMM), SwiGLU times the router weight, fc2 (grouped GEMM);
5. push combine: each output row to its (token, slot) on its home rank; barrier;
6. y[t] = sum over slots j = 0 .. K-1 (fixed order).

Steps 3-5 run chunk by chunk over the layout, and a forward with grad keeps the activations of
the training ring's rows only (functional/training.py). The expert FFN is functional/expert_ffn.py.

The router weight is applied inside the expert (on h, before fc2), as Megatron does; its
gradient comes out of the SwiGLU backward. Backward mirrors the forward
(:func:`training.moe_backward`): publish dy; reverse-combine pulls it; fc2 dgrad, SwiGLU backward
(d gate, d up, d router weight), fc1 dgrad and the weight gradients; reverse-dispatch pushes dX
and d router weight per slot; the fixed-order slot sum gives dx.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..config import GPU_TILE_ROWS, MoKConfig
from ..ops import comm as comm_ops
from . import training
from .backend import CallSpec, gpu_unavailable_reason
from .expert_ffn import ExpertCall, expert_call, weight_arguments
from .validate import MoEShape
from .workspace import Workspace, get_workspace

SITE_FWD_DISPATCH, SITE_FWD_COMBINE = 1, 2  # the backward's: training.SITE_BWD_*


def unsupported_reason(shape: MoEShape, config: MoKConfig) -> str | None:
    """Why the CUDA kernels cannot take this shape, or None."""
    if config.tile_rows not in GPU_TILE_ROWS:
        return f"tile_rows={config.tile_rows}; the GPU backends take {GPU_TILE_ROWS}"
    if shape.hidden % 8:
        return f"hidden size {shape.hidden} is not a multiple of 8 (16-byte row copies)"
    if shape.ffn_hidden % 8:
        return f"expert FFN size {shape.ffn_hidden} is not a multiple of 8 (16-byte vectors)"
    if shape.experts_per_rank * 4 > 48 * 1024:
        return f"{shape.experts_per_rank} experts per rank exceed the schedule kernel's 12288"
    return None


class _CudaMoE(torch.autograd.Function):
    """fc1_2 / fc2_2: None, or the second weight segment (local experts L1 ..), read in place."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, fc1, fc2, ws: Workspace, call: ExpertCall, spec: CallSpec,
                fc1_2=None, fc2_2=None, main_grads=None):
        ws.raise_if_failed(call.timeout_s)
        T = topk_ids.shape[0]
        table, counts, offsets, capacity = ws.dispatch(x, topk_ids, topk_weights, SITE_FWD_DISPATCH, call.timeout_s,
                                                       call.segment_rows)
        plan = training.training_plan(spec.config, spec.shape, capacity, call.segment_rows, call.hopper_gemms)
        training_call = any(ctx.needs_input_grad)
        kept = training.cuda_forward(ws, call, plan, table, offsets, counts, fc1, fc2, fc1_2, fc2_2, training_call)
        ws.barrier(SITE_FWD_COMBINE, call.timeout_s)
        y, _ = comm_ops.sum_slots(ws.slots[:T], topk_ids, call.num_experts, None, ws.status)
        ws.mirror_status()
        if training_call:
            # The workspace is shared by every layer: what the backward reads is kept outside it
            # (x and topk_weights are the caller's tensors, kept for replay).
            ctx.save_for_backward(x, topk_ids, topk_weights, fc1, fc2, fc1_2, fc2_2, table, offsets, counts,
                                  *[t for k in kept for t in k])
            ctx.ws, ctx.call, ctx.plan, ctx.main_grads = ws, call, plan, main_grads
        return y

    @staticmethod
    @once_differentiable  # a second derivative through MoK raises instead of being dropped
    def backward(ctx, dy):
        training.consume_kept(ctx)
        x, topk_ids, topk_weights, fc1, fc2, fc1_2, fc2_2, table, offsets, counts, *flat = ctx.saved_tensors
        kept = [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]
        dx, dw, d_fc1, d_fc2, d_fc1_2, d_fc2_2 = training.moe_backward(
            ctx.ws, ctx.call, ctx.plan, kept, dy, x, topk_ids, topk_weights, table, offsets, counts, fc1, fc2,
            fc1_2, fc2_2, ctx.main_grads)
        return dx, None, dw, d_fc1, d_fc2, None, None, None, d_fc1_2, d_fc2_2, None


class CudaBackend:
    """MoK's communication as separate kernels around grouped GEMMs (sm_90, bf16)."""

    name = "cuda"

    def unavailable_reason(self, spec: CallSpec) -> Optional[str]:
        return gpu_unavailable_reason(spec.device, spec.dtype) or unsupported_reason(spec.shape, spec.config)

    def run(self, spec: CallSpec, x, topk_ids, topk_weights, fc1s, fc2s, main_grads=None) -> torch.Tensor:
        """y bf16 [T, H] for x bf16 [T, H], topk_ids int64 [T, K], topk_weights fp32 [T, K] and
        the weight segments fc1s (bf16 [L_i, 2I, H]) and fc2s (bf16 [L_i, H, I]); ``main_grads``:
        see :class:`~megatron_mok.functional.backend.Backend`."""
        shape, config = spec.shape, spec.config
        ws = get_workspace(spec.ep_group, x.device, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                           experts_per_rank=shape.experts_per_rank, config=config)
        ws.timeout_s = float(config.timeout_s)
        # Segments padded to the GEMM tile: torch._grouped_mm tiles each group in 128-row blocks
        # anyway, and measured no faster with 8-row segments.
        call = expert_call(config, shape, spec.ep_size, config.tile_rows)
        fc1, fc2, fc1_2, fc2_2 = weight_arguments(fc1s, fc2s, call)
        return _CudaMoE.apply(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), fc1, fc2, ws, call,
                              spec, fc1_2, fc2_2, main_grads)
