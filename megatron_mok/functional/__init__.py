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
from .groups import EPGroup, LocalEPGroup, LocalEPRank, check_ep_group, group_size_rank
from .validate import MoKInputError, check_backend_name, check_inputs, weight_segments
from .workspace import MoKCapacityError, MoKRuntimeError, MoKTimeoutError, check_errors

__all__ = ["mok_moe", "check_errors", "LocalEPGroup", "LocalEPRank", "EPGroup", "group_size_rank", "MoKInputError",
           "MoKConfig", "MegakernelTunables", "MoKConfigError", "MoKMismatchError", "MoKCapacityError",
           "MoKRuntimeError", "MoKTimeoutError", "BackendUnavailable"]


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

    Returns:
        y: [T, H] in ``x.dtype``.

    Raises:
        MoKInputError, MoKConfigError: for unsupported arguments, before any GPU work.
        MoKMismatchError: on every rank, when the ranks of the EP group call with different
            settings (config, sizes, dtype or backend), before any data is exchanged.
        BackendUnavailable: when the requested backend cannot run here, saying why.
        MoKCapacityError: more tokens than the GPU workspace was sized for.
        MoKRuntimeError, MoKTimeoutError: a problem a kernel recorded during an earlier call
            (a bad expert id, a peer that never arrived); see docs/architecture.md.
    """
    check_backend_name(backend)
    try:
        check_ep_group(ep_group)
    except TypeError as err:
        raise MoKInputError(str(err)) from None
    shape = check_inputs(x, topk_ids, topk_weights, fc1_weight, fc2_weight)
    if config is None:
        config = MoKConfig()
    elif not isinstance(config, MoKConfig):
        raise MoKConfigError(f"config must be a MoKConfig or None, got {type(config).__name__}")
    ep_size, _ = group_size_rank(ep_group)
    config.check_experts(ep_size, shape.experts_per_rank)
    spec = CallSpec(shape=shape, config=config, ep_group=ep_group, ep_size=ep_size, device=x.device, dtype=x.dtype)
    chosen = select_backend(backend, spec)
    agree_on_call(ep_group, config, shape, x.dtype, chosen.name)
    fc1s, fc2s = weight_segments("fc1_weight", fc1_weight), weight_segments("fc2_weight", fc2_weight)
    return chosen.run(spec, x, topk_ids, topk_weights, fc1s, fc2s)
