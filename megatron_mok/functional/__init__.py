"""The public functional entry point of MoK: :func:`mok_moe`.

Usable without Megatron: any framework that has top-k routing and per-expert SwiGLU weights
in Megatron's layout can call it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import MegakernelTunables, MoKConfig, MoKConfigError
from .agreement import MoKMismatchError, agree_on_call
from .backends import BackendUnavailable, CallSpec, select_backend
from .faults import MoKCapacityError, MoKPeerError, MoKRuntimeError, MoKTimeoutError, announce_failure
from .groups import EPGroup, LocalEPGroup, LocalEPRank, check_ep_group, group_size_rank
from .main_grad import check_main_grads
from .validate import MoKInputError, check_backend_name, check_inputs, weight_segments
from .workspace import check_errors

__all__ = ["mok_moe", "check_errors", "LocalEPGroup", "LocalEPRank", "EPGroup", "group_size_rank", "MoKInputError",
           "MoKConfig", "MegakernelTunables", "MoKConfigError", "MoKMismatchError", "MoKCapacityError",
           "MoKRuntimeError", "MoKTimeoutError", "MoKPeerError", "BackendUnavailable"]

# Raised by a rank's own checks before its backend runs: the other ranks are told (faults.announce_failure).
_OWN_CHECK_ERRORS = (MoKInputError, MoKConfigError, BackendUnavailable, MoKCapacityError)


def mok_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    *,
    ep_group: EPGroup = None,
    config: Optional[MoKConfig] = None,
    backend: str = "auto",
    main_grads=None,
) -> torch.Tensor:
    """Routed-expert MoE: dispatch, SwiGLU expert FFN and weighted combine (docs/contract.md).

    ``y[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``, the sum over j in a
    fixed order, with ``FFN_e(v) = (silu(v G_e^T) * (v U_e^T)) D_e^T``. Autograd-enabled:
    gradients flow to ``x``, ``topk_weights``, ``fc1_weight`` and ``fc2_weight`` (each
    segment's to it).

    Args:
        x: [T, H] tokens of this rank, bf16 (the reference also takes fp16, fp32, fp64).
        topk_ids: [T, K] int64 global expert ids; expert e lives on rank e // (E/P) of the EP
            group as its local expert e % (E/P); -1 marks an unused slot.
        topk_weights: [T, K] fp32 router weights.
        fc1_weight: [E/P, 2I, H] local experts' fc1 (gate rows then up rows), as Megatron's
            fc1 Linear weight; or a tuple of two weight segments [L_1, 2I, H], [L_2, 2I, H]
            (L_1 + L_2 = E/P), local experts 0 .. L_1 - 1 and L_1 .. E/P - 1, e.g. the routed
            experts and a shared expert that lives in parameters of its own: the GPU backends
            read each where it lies (no copy), the reference backend concatenates them.
        fc2_weight: [E/P, H, I] local experts' fc2, as Megatron's fc2 Linear weight; a tuple of
            segments [L_1, H, I], [L_2, H, I] when fc1_weight is one.
        ep_group: the expert-parallel process group of P ranks; None means P = 1; a
            :class:`LocalEPRank` for virtual ranks on one GPU (GPU backends only). Every rank
            of the group must call ``mok_moe`` the same number of times, in the same order.
        config: tunables (:class:`megatron_mok.MoKConfig`); None takes the defaults.
        backend: "auto" (the fastest available), "reference" (pure PyTorch, any device),
            "cuda" (comm kernels + grouped GEMM, sm_90), "megakernel" (one persistent
            kernel, sm_90).
        main_grads: gradient-accumulation fusion (``functional/main_grad.py``): None, or a pair
            (fc1 buffers, fc2 buffers) of per-expert fp32 tensors, [2I, H] and [H, I], one per
            local expert in local expert order across the segments, contiguous, 16-byte aligned,
            anywhere in memory (Megatron's ``main_grad``). The backward then adds each expert's
            weight gradient into them in fp32 (MoK's Hopper GEMMs: in the weight-gradient
            kernel's epilogue) and gives ``fc1_weight`` and ``fc2_weight`` placeholder gradients
            (uninitialised, never to be read), as Megatron's fused linear layers do.

    Returns:
        y: [T, H] in ``x.dtype``.

    Raises:
        MoKInputError, MoKConfigError: for unsupported arguments, before any GPU work.
        MoKMismatchError: on every rank, when the ranks of the EP group call with different
            settings (config, sizes, dtype or backend), before any data is exchanged.
        BackendUnavailable: when the requested backend cannot run here, saying why.
        MoKCapacityError: more tokens than the workspace was sized for (at the first call, or
            ``MoKConfig.max_tokens_per_rank``).
        MoKPeerError: another rank of the EP group stopped this call (its own checks failed) or
            an earlier one (GPU backends: that call's output was NaN); names the rank.
        MoKRuntimeError, MoKTimeoutError: a problem recorded during an earlier call (a bad
            expert id: that call's output was NaN on every rank; a peer that did not arrive within
            ``MoKConfig.timeout_s``), or a peer that does not arrive at this call; see
            docs/contract.md ("Errors").

    A rank whose own checks fail (the errors above raised before its backend runs) tells the
    other ranks, so that none waits for it: they raise :class:`MoKPeerError` at this call
    (reference backend; GPU backends at the first call with new settings), or their output of
    this call is NaN and their next call raises it (GPU backends).
    """
    try:
        check_ep_group(ep_group)
    except TypeError as err:
        raise MoKInputError(str(err)) from None
    try:
        check_backend_name(backend)
        shape = check_inputs(x, topk_ids, topk_weights, fc1_weight, fc2_weight)
        if config is None:
            config = MoKConfig()
        elif not isinstance(config, MoKConfig):
            raise MoKConfigError(f"config must be a MoKConfig or None, got {type(config).__name__}; build one with "
                                 "megatron_mok.MoKConfig(...)")
        ep_size, _ = group_size_rank(ep_group)
        config.check_experts(ep_size, shape.experts_per_rank)
        mains = check_main_grads(main_grads, shape, x.device)
        spec = CallSpec(shape=shape, config=config, ep_group=ep_group, ep_size=ep_size, device=x.device,
                        dtype=x.dtype)
        chosen = select_backend(backend, spec)
    except _OWN_CHECK_ERRORS as err:
        announce_failure(ep_group, err)
        raise
    try:
        agree_on_call(ep_group, config, shape, x.dtype, chosen.name)
    except (MoKMismatchError, MoKPeerError) as err:
        # A process group raised it on every rank; a virtual rank found it alone: the ranks
        # issued before it are already queued and must be told.
        if isinstance(ep_group, LocalEPRank):
            announce_failure(ep_group, err, failed_rank=getattr(err, "failed_rank", None),
                             failed_code=getattr(err, "failed_code", None), compared=True)
        raise
    fc1s, fc2s = weight_segments("fc1_weight", fc1_weight), weight_segments("fc2_weight", fc2_weight)
    if chosen.name == "reference":  # it meets the other ranks at every call and tells them itself
        return chosen.run(spec, x, topk_ids, topk_weights, fc1s, fc2s, mains)
    try:
        return chosen.run(spec, x, topk_ids, topk_weights, fc1s, fc2s, mains)
    except (MoKCapacityError, MoKConfigError) as err:  # raised before any GPU work of this call
        announce_failure(ep_group, err, compared=True)
        raise

