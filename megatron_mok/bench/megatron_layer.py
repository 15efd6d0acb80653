"""Megatron-Core's own MoE layer (``MoELayer`` with the local spec's ``SequentialMLP``
experts), built with the ``alltoall`` or ``flex`` (DeepEP / HybridEP) token dispatcher and fed
the benchmark's routing instead of its router's.

Only the router differs from Megatron as trained: it is replaced by :class:`FixedRouting`,
which returns the benchmark's (probs, routing_map), so every backend runs the same routes and
the router GEMM is timed for none of them. Expert weights are copied from the benchmark's
``fc1_weight`` / ``fc2_weight``, which have Megatron's layout.
"""

from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

MEGATRON_BACKENDS = {
    "megatron-alltoall": ("alltoall", None),
    "megatron-flex-deepep": ("flex", "deepep"),
    "megatron-flex-hybridep": ("flex", "hybridep"),
}
"""Benchmark backend name -> (moe_token_dispatcher_type, moe_flex_dispatcher_backend)."""


def unavailable_reason(name: str, device: torch.device) -> Optional[str]:
    """Why Megatron backend ``name`` cannot run here, or None when it can be built."""
    if device.type != "cuda":
        return ("Megatron-Core's MoE token dispatchers create CUDA streams and events, so they "
                "need a CUDA device")
    try:
        importlib.import_module("megatron.core.transformer.moe.moe_layer")
    except ImportError as err:
        return f"megatron-core does not import ({err})"
    _, flex_backend = MEGATRON_BACKENDS[name]
    if flex_backend == "deepep":
        try:
            importlib.import_module("deep_ep")
        except ImportError as err:
            return f"DeepEP is not installed (import deep_ep: {err})"
    if flex_backend == "hybridep":
        try:
            module = importlib.import_module("deep_ep")
        except ImportError as err:
            return f"HybridEP is not installed (import deep_ep: {err})"
        if not hasattr(module, "HybridEPBuffer"):
            return "the installed deep_ep has no HybridEPBuffer (HybridEP is DeepEP's hybrid-ep branch)"
    return None


def ensure_parallel_state(ep_size: int) -> None:
    """Initialise Megatron's parallel state with TP = PP = 1 and EP = ``ep_size`` over the
    default process group, or check that it already is. A single process without a process
    group (one GPU, not started by torchrun) gets a one-rank NCCL group first."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if ep_size != 1:
            raise RuntimeError(f"EP size {ep_size} needs a process group; start with torchrun")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_expert_model_parallel_world_size()
        if have != ep_size:
            raise RuntimeError(f"Megatron's parallel state has EP size {have}, the benchmark needs {ep_size}")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep_size,
    )


class FixedRouting(torch.nn.Module):
    """Stands in for Megatron's router: returns the (probs, routing_map) it was given.

    ``probs``: float32 [T, E], the router weight of each chosen expert and zero elsewhere;
    ``routing_map``: bool [T, E], True where the token goes to the expert.
    """

    def __init__(self) -> None:
        super().__init__()
        self.probs: Optional[torch.Tensor] = None
        self.routing_map: Optional[torch.Tensor] = None

    def forward(self, hidden_states, padding_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.probs is None or self.routing_map is None:
            raise RuntimeError("FixedRouting.set() was not called before the layer's forward")
        return self.probs, self.routing_map

    def set(self, probs: torch.Tensor, routing_map: torch.Tensor) -> None:
        self.probs, self.routing_map = probs, routing_map

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron calls this on routers; nothing to record."""


def dense_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's routing format from top-k form.

    Args:
        topk_ids: int64 [T, K] distinct expert ids per token (no -1).
        topk_weights: float32 [T, K].

    Returns:
        probs: float32 [T, E], a leaf that requires grad; routing_map: bool [T, E].
    """
    tokens = topk_ids.shape[0]
    probs = torch.zeros(tokens, num_experts, dtype=torch.float32, device=topk_ids.device)
    probs.scatter_(1, topk_ids, topk_weights.detach().float())
    routing_map = torch.zeros(tokens, num_experts, dtype=torch.bool, device=topk_ids.device)
    routing_map.scatter_(1, topk_ids, True)
    return probs.requires_grad_(), routing_map


def build_layer(name: str, *, hidden: int, ffn_hidden: int, num_experts: int, topk: int,
                ep_size: int, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor):
    """Megatron's MoELayer for backend ``name`` (a key of :data:`MEGATRON_BACKENDS`), with the
    given local expert weights copied in and :class:`FixedRouting` as its router.

    Args:
        hidden, ffn_hidden, num_experts, topk: H, I, E, K.
        ep_size: P; Megatron's parallel state is initialised with EP = P if it is not yet.
        fc1_weight: [L, 2I, H] bf16; fc2_weight: [L, H, I] bf16 (L = E / P).

    Returns:
        The layer (bf16 parameters on the current CUDA device, training mode).
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dispatcher, flex_backend = MEGATRON_BACKENDS[name]
    ensure_parallel_state(ep_size)
    kwargs: Dict[str, object] = {}
    if flex_backend is not None:
        kwargs["moe_flex_dispatcher_backend"] = flex_backend
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        ffn_hidden_size=ffn_hidden,
        moe_ffn_hidden_size=ffn_hidden,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        expert_model_parallel_size=ep_size,
        bf16=True,
        params_dtype=torch.bfloat16,
        perform_initialization=False,
        use_cpu_initialization=False,
        **kwargs,
    )
    layer = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)(config=config)
    local = layer.experts.local_experts
    if len(local) != fc1_weight.shape[0]:
        raise RuntimeError(f"Megatron built {len(local)} local experts, the benchmark has {fc1_weight.shape[0]}")
    with torch.no_grad():
        for i, expert in enumerate(local):
            expert.linear_fc1.weight.copy_(fc1_weight[i])
            expert.linear_fc2.weight.copy_(fc2_weight[i])
    layer.router = FixedRouting()
    layer.train()
    return layer


def expert_weight_grads(layer) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the layer's expert weights, stacked in the benchmark's layout:
    ([L, 2I, H], [L, H, I])."""
    local = layer.experts.local_experts
    return (torch.stack([e.linear_fc1.weight.grad for e in local]),
            torch.stack([e.linear_fc2.weight.grad for e in local]))


def zero_expert_grads(layer) -> None:
    """Drop the accumulated gradients of the layer's parameters."""
    for p in layer.parameters():
        p.grad = None
