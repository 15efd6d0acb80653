"""The weights of Megatron's expert modules, in the layout ``mok_moe`` takes.

The MoK layer keeps Megatron's own expert module (``SequentialMLP`` from the local spec,
``TEGroupedMLP`` from the Transformer Engine spec) and its shared-expert module, so parameter
names, shapes, initialisation, the expert-data-parallel gradient buffer and
``sharded_state_dict`` are Megatron's. It never calls their ``forward``: every forward reads the
per-expert [2I, H] fc1 and [H, I] fc2 weights through :func:`local_expert_weights` and
:func:`shared_expert_weights`, after running the modules' forward pre-hooks
(:func:`run_forward_pre_hooks`). :mod:`.stacking` turns the per-expert lists into the
[L, 2I, H] and [L, H, I] tensors ``mok_moe`` takes (without a copy while they lie stacked).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["local_expert_weights", "shared_expert_weights", "run_forward_pre_hooks"]


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
        (fc1, fc2): lists of n tensors, fc1[k] [2I, H], fc2[k] [H, I]. For n = 1 the parameters
        themselves (no copy); for n > 1 fc1[k] is a copy (its gate and up rows are not adjacent
        in the parameter) and fc2[k] a column slice.
    """
    w1 = shared.linear_fc1.weight
    w2 = shared.linear_fc2.weight
    size = w1.shape[0] // 2
    if size % expert_ffn:
        raise ValueError(f"shared-expert size {size} is not a multiple of the expert FFN size {expert_ffn}")
    n = size // expert_ffn
    if n == 1:
        return [w1], [w2]
    gate, up = w1[:size], w1[size:]
    fc1 = [torch.cat([gate[k * expert_ffn:(k + 1) * expert_ffn], up[k * expert_ffn:(k + 1) * expert_ffn]])
           for k in range(n)]
    fc2 = [w2[:, k * expert_ffn:(k + 1) * expert_ffn] for k in range(n)]
    return fc1, fc2


def run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """Run the forward pre-hooks of ``module`` and of its submodules, whose ``forward`` the MoK
    layer never calls (it reads their weights). Megatron's DistributedDataParallel with
    ``--overlap-param-gather`` depends on them: the hook of a module waits for the all-gather of
    that module's parameters (and dispatches the next bucket's); without it the experts would
    be read while their all-gather may still be running, or never issued.

    Hooks are called as if the module had been called with no inputs: ``hook(m, ())``, or
    ``hook(m, (), {})`` for hooks registered ``with_kwargs``; what they return is ignored.
    Global hooks (``register_module_forward_pre_hook``) are not called.
    """
    for m in module.modules():
        hooks = m._forward_pre_hooks
        if not hooks:
            continue
        with_kwargs = m._forward_pre_hooks_with_kwargs
        for hook_id, hook in list(hooks.items()):
            if hook_id in with_kwargs:
                hook(m, (), {})
            else:
                hook(m, ())
