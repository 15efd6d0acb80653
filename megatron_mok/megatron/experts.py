"""The expert weights of Megatron's expert modules, in the layout ``mok_moe`` takes.

The MoK layer keeps Megatron's own expert module (``SequentialMLP`` from the local spec,
``TEGroupedMLP`` from the Transformer Engine spec) and its shared-expert module, so parameter
names, shapes, initialisation, the expert-data-parallel gradient buffer and
``sharded_state_dict`` are Megatron's. Every forward reads their weights through the functions
here: per-expert [2I, H] fc1 and [H, I] fc2 tensors stacked into [L, 2I, H] and [L, H, I]
(a differentiable stack, so each parameter gets its own gradient as in Megatron).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["local_expert_weights", "shared_expert_weights", "stacked"]


def _sequential_weights(experts) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    fc1 = [expert.linear_fc1.weight for expert in experts.local_experts]
    fc2 = [expert.linear_fc2.weight for expert in experts.local_experts]
    return fc1, fc2


def _grouped_weights(experts, num_local_experts: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    fc1 = [getattr(experts.linear_fc1, f"weight{i}") for i in range(num_local_experts)]
    fc2 = [getattr(experts.linear_fc2, f"weight{i}") for i in range(num_local_experts)]
    return fc1, fc2


def local_expert_weights(experts, num_local_experts: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The fc1 and fc2 weights of each local expert of a Megatron expert module.

    Args:
        experts: a ``SequentialMLP`` (``local_experts.{i}.linear_fc{1,2}.weight``) or a
            ``TEGroupedMLP`` (``linear_fc{1,2}.weight{i}``).
        num_local_experts: L.

    Returns:
        (fc1, fc2): lists of L tensors, fc1[i] [2I, H] (gate rows then up rows), fc2[i] [H, I].

    Raises:
        TypeError: for an expert module whose weight layout MoK does not know.
    """
    if hasattr(experts, "local_experts"):
        fc1, fc2 = _sequential_weights(experts)
    elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
        fc1, fc2 = _grouped_weights(experts, num_local_experts)
    else:
        raise TypeError(
            f"the MoK layer reads expert weights from SequentialMLP (local spec) or TEGroupedMLP "
            f"(Transformer Engine spec); {type(experts).__name__} has neither layout"
        )
    if len(fc1) != num_local_experts:
        raise TypeError(f"{type(experts).__name__} holds {len(fc1)} experts, expected {num_local_experts}")
    return fc1, fc2


def shared_expert_weights(shared, expert_ffn: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """A shared expert of intermediate size S = n * I, split into n experts of size I.

    SwiGLU is a sum over its intermediate channels, so the shared expert equals the sum of n
    experts: expert k takes gate rows k*I..(k+1)*I and up rows S+k*I..S+(k+1)*I of fc1 and
    columns k*I..(k+1)*I of fc2.

    Args:
        shared: Megatron's ``SharedExpertMLP`` (tensor-parallel size 1): ``linear_fc1.weight``
            [2S, H], ``linear_fc2.weight`` [H, S].
        expert_ffn: I, the routed experts' FFN size.

    Returns:
        (fc1, fc2): lists of n views/slices, fc1[k] [2I, H], fc2[k] [H, I].
    """
    w1 = shared.linear_fc1.weight
    w2 = shared.linear_fc2.weight
    size = w1.shape[0] // 2
    if size % expert_ffn:
        raise ValueError(f"shared-expert size {size} is not a multiple of the expert FFN size {expert_ffn}")
    n = size // expert_ffn
    gate, up = w1[:size], w1[size:]
    fc1 = [torch.cat([gate[k * expert_ffn:(k + 1) * expert_ffn], up[k * expert_ffn:(k + 1) * expert_ffn]])
           for k in range(n)]
    fc2 = [w2[:, k * expert_ffn:(k + 1) * expert_ffn] for k in range(n)]
    return fc1, fc2


def stacked(weights: List[torch.Tensor]) -> torch.Tensor:
    """[n, ...] contiguous stack of same-shaped weights; differentiable (each input gets its slice
    of the gradient)."""
    return torch.stack(weights)
