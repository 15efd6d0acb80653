"""Gradient-accumulation fusion: the expert weight gradients added, in fp32, into per-expert
buffers the caller owns (Megatron's ``main_grad``), instead of returned in bf16.

A caller that passes ``main_grads`` to ``mok_moe`` gets, for each local expert e, ``fc1_main[e] +=
dL/d fc1[e]`` and ``fc2_main[e] += dL/d fc2[e]`` in fp32 during the backward. MoK's Hopper
weight-gradient kernel does the add in its epilogue (``grouped_gemm.weight_grad_into``: read,
add, write the fp32 tile, one pass; the accumulator is never rounded to bf16), which saves the
bf16 gradient's write and read and the separate fp32 add that Megatron's DDP would run per
parameter. Elsewhere (the reference backend, shapes outside MoK's Hopper GEMMs) the bf16
gradient is computed as without fusion and added here, as DDP would add it.

The weight inputs then receive placeholder gradients: uninitialised tensors of their shape
(``torch.empty``, never written), as Megatron's own fused linear layers return, so that
autograd still reaches every parameter (Megatron's DDP hooks run there, and with
``--overlap-grad-reduce`` they require a gradient). The caller reads ``main_grad``, never
those; Megatron's DDP skips its add for a parameter whose ``grad_added_to_main_grad`` is set.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .validate import MoEShape, MoKInputError

MainGrads = Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]
"""(fc1 buffers, fc2 buffers): one fp32 tensor per local expert, [2I, H] and [H, I], in local
expert order (the routed experts' segment first, then the second segment's)."""


def check_main_grads(main_grads, shape: MoEShape, device: torch.device) -> Optional[MainGrads]:
    """``main_grads`` (None, or a pair of sequences of per-expert fp32 buffers) as a
    :data:`MainGrads`, or :class:`MoKInputError` naming what is wrong. Reads no tensor values."""
    if main_grads is None:
        return None
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != 2:
        raise MoKInputError("main_grads must be a pair (fc1 buffers, fc2 buffers) of per-expert fp32 tensors, "
                            f"got {type(main_grads).__name__}")
    L, H, I = shape.experts_per_rank, shape.hidden, shape.ffn_hidden
    out = []
    for name, bufs, want in (("fc1", main_grads[0], (2 * I, H)), ("fc2", main_grads[1], (H, I))):
        if not isinstance(bufs, (tuple, list)) or len(bufs) != L:
            got = f"{len(bufs)} entries" if isinstance(bufs, (tuple, list)) else type(bufs).__name__
            raise MoKInputError(f"main_grads: the {name} buffers must be a sequence of one tensor per local expert "
                                f"(L = {L}), got {got}")
        spans = []
        for e, t in enumerate(bufs):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != want:
                what = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise MoKInputError(f"main_grads: {name} buffer {e} must be fp32 {list(want)}, got {what}")
            if t.device != device:
                raise MoKInputError(f"main_grads: {name} buffer {e} is on {t.device}, the tokens on {device}")
            if not t.is_contiguous() or (t.device.type == "cuda" and t.data_ptr() % 16):
                raise MoKInputError(f"main_grads: {name} buffer {e} must be contiguous and 16-byte aligned")
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * 4))
        spans.sort()
        if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            raise MoKInputError(f"main_grads: two {name} buffers overlap; each expert needs its own")
        out.append(tuple(bufs))
    return out[0], out[1]


def split_segments(bufs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The per-expert buffers of each weight segment (``weights``: [L_i, ...] each, in order)."""
    out, l0 = [], 0
    for w in weights:
        out.append(list(bufs[l0:l0 + w.shape[0]]))
        l0 += w.shape[0]
    return out


def placeholders(weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Uninitialised gradients of the weights' shapes and dtypes (never written or read)."""
    return [torch.empty_like(w) for w in weights]


def add_into(bufs: Sequence[torch.Tensor], grad: torch.Tensor) -> None:
    """bufs[e] += grad[e] in fp32 for a weight gradient [L, ...] of any dtype (DDP's add)."""
    for e, b in enumerate(bufs):
        b.add_(grad[e])


class _AddIntoMainGrads(torch.autograd.Function):
    """Identity on the weight segments; backward adds their gradients into the buffers and passes
    placeholders on. For backends that compute the bf16 gradient anyway."""

    @staticmethod
    def forward(ctx, bufs, n1, *weights):
        ctx.bufs, ctx.n1 = bufs, n1
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        fc1_bufs, fc2_bufs = ctx.bufs
        n1 = ctx.n1
        segs = (split_segments(fc1_bufs, grads[:n1]), split_segments(fc2_bufs, grads[n1:]))
        out = []
        for seg_bufs, seg_grads in ((segs[0], grads[:n1]), (segs[1], grads[n1:])):
            for bufs, g in zip(seg_bufs, seg_grads):
                if g is not None:
                    add_into(bufs, g)
                out.append(None if g is None else torch.empty_like(g))
        return (None, None, *out)


def add_into_after_backward(main_grads: MainGrads, fc1s: Tuple[torch.Tensor, ...], fc2s: Tuple[torch.Tensor, ...]
                            ) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
    """The weight segments through :class:`_AddIntoMainGrads`: (fc1s, fc2s) to compute with,
    whose gradients end up added into ``main_grads`` (the originals get placeholders)."""
    if not torch.is_grad_enabled() or not any(w.requires_grad for w in (*fc1s, *fc2s)):
        return fc1s, fc2s
    out = _AddIntoMainGrads.apply(main_grads, len(fc1s), *fc1s, *fc2s)
    return tuple(out[:len(fc1s)]), tuple(out[len(fc1s):])
