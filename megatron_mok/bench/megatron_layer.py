"""Megatron-Core's own MoE layer, built with the ``alltoall`` or ``flex`` (DeepEP / HybridEP)
token dispatcher and fed the benchmark's routing instead of its router's.

Its experts are the ones Megatron users run: ``TEGroupedMLP`` (Transformer Engine's grouped
GEMM, ``--moe-grouped-gemm`` with the TE spec) when Transformer Engine is installed, else the
local spec's ``SequentialMLP`` (one GEMM per expert); :func:`expert_module_kind` decides, the
benchmark's ``--megatron-experts`` overrides, and every result names the module it ran.

Only the router differs from Megatron as trained: it is replaced by :class:`FixedRouting`,
which returns the benchmark's (probs, routing_map), so every backend runs the same routes and
the router GEMM is timed for none of them. Expert weights are copied from the benchmark's
``fc1_weight`` / ``fc2_weight``, which have Megatron's layout.

On a machine without a GPU the layer runs on the CPU over gloo inside
:func:`megatron_mok.megatron.cpu_compat.cpu_device_patches` (tests of the benchmark itself).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

MEGATRON_BACKENDS = {
    "megatron-alltoall": ("alltoall", None),
    "megatron-flex-deepep": ("flex", "deepep"),
    "megatron-flex-hybridep": ("flex", "hybridep"),
}
"""Benchmark backend name -> (moe_token_dispatcher_type, moe_flex_dispatcher_backend)."""

EXPERT_MODULES = ("auto", "te-grouped", "sequential")
"""``--megatron-experts`` choices."""


def transformer_engine_reason() -> Optional[str]:
    """Why Transformer Engine's grouped experts cannot be built here, or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed"
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # a broken TE install is a reason, not a crash
        return f"transformer_engine.pytorch does not import ({type(err).__name__}: {err})"
    return None


def expert_module_kind(choice: str, device: torch.device) -> str:
    """"TEGroupedMLP" or "SequentialMLP" for ``--megatron-experts`` ``choice``: auto takes
    Transformer Engine's grouped experts on a CUDA device where TE imports, else SequentialMLP.

    Raises:
        ValueError: te-grouped was asked for where TE cannot run (the message says why).
    """
    if choice not in EXPERT_MODULES:
        raise ValueError(f"--megatron-experts {choice!r} must be one of {', '.join(EXPERT_MODULES)}")
    if choice == "sequential":
        return "SequentialMLP"
    reason = "the layer runs on the CPU" if device.type != "cuda" else transformer_engine_reason()
    if reason is None:
        return "TEGroupedMLP"
    if choice == "te-grouped":
        raise ValueError(f"--megatron-experts te-grouped: {reason}; use auto or sequential")
    return "SequentialMLP"


def unavailable_reason(name: str, device: torch.device) -> Optional[str]:
    """Why Megatron backend ``name`` cannot run here, or None when it can be built."""
    if device.type != "cuda" and MEGATRON_BACKENDS[name][0] != "alltoall":
        return ("Megatron-Core's flex dispatcher runs DeepEP/HybridEP kernels, so it needs a CUDA device")
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
    group (one GPU or the CPU, whether or not torchrun started it) gets a one-rank group over an
    in-process store first.

    The in-process store matters under torchrun: there ``init_process_group`` with a
    ``tcp://`` address joins torchrun's agent store as a client (TORCHELASTIC_USE_AGENT_STORE),
    so a one-rank group on a fresh port would wait for a server that never comes (the default
    timeout: 10 minutes of silence).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if ep_size != 1:
            raise RuntimeError(f"EP size {ep_size} needs a process group; start with torchrun")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_expert_model_parallel_world_size()
        if have != ep_size:
            raise RuntimeError(f"Megatron's parallel state has EP size {have}, the benchmark needs {ep_size}")
        return
    with device_context(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep_size,
        )


def device_context(device: torch.device):
    """Megatron's CPU stand-ins (:func:`megatron_mok.megatron.cpu_compat.cpu_device_patches`)
    for a layer on the CPU; nothing on a CUDA device."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    from megatron_mok.megatron.cpu_compat import cpu_device_patches

    return cpu_device_patches()


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
                ep_size: int, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, experts: str = "auto"):
    """Megatron's MoELayer for backend ``name`` (a key of :data:`MEGATRON_BACKENDS`), with the
    given local expert weights copied in and :class:`FixedRouting` as its router.

    Args:
        hidden, ffn_hidden, num_experts, topk: H, I, E, K.
        ep_size: P; Megatron's parallel state is initialised with EP = P if it is not yet.
        fc1_weight: [L, 2I, H]; fc2_weight: [L, H, I] (L = E / P), on the layer's device.
        experts: ``--megatron-experts`` (:func:`expert_module_kind`).

    Returns:
        The layer (parameters in the weights' dtype on their device, training mode); its
        ``expert_module`` attribute names the expert module ("TEGroupedMLP" or "SequentialMLP").
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mok.megatron.experts import local_expert_weights

    device = fc1_weight.device
    kind = expert_module_kind(experts, device)
    grouped = kind == "TEGroupedMLP"
    dispatcher, flex_backend = MEGATRON_BACKENDS[name]
    ensure_parallel_state(ep_size)
    kwargs: Dict[str, object] = {}
    if flex_backend is not None:
        kwargs["moe_flex_dispatcher_backend"] = flex_backend
    dtype = fc1_weight.dtype
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
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=device.type == "cuda",
        add_bias_linear=False,
        expert_model_parallel_size=ep_size,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        perform_initialization=False,
        use_cpu_initialization=device.type != "cuda",
        gradient_accumulation_fusion=False,
        **kwargs,
    )
    with device_context(device):
        layer = get_moe_module_spec(use_te=grouped, num_experts=num_experts, moe_grouped_gemm=grouped)(config=config)
    fc1, fc2 = local_expert_weights(layer.experts, fc1_weight.shape[0])
    with torch.no_grad():
        for i in range(fc1_weight.shape[0]):
            fc1[i].copy_(fc1_weight[i])
            fc2[i].copy_(fc2_weight[i])
    layer.router = FixedRouting()
    layer.expert_module = kind
    layer.train()
    return layer


def expert_weight_grads(layer) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the layer's expert weights, stacked in the benchmark's layout:
    ([L, 2I, H], [L, H, I])."""
    from megatron_mok.megatron.experts import local_expert_weights

    fc1, fc2 = local_expert_weights(layer.experts, layer.num_local_experts)
    return torch.stack([w.grad for w in fc1]), torch.stack([w.grad for w in fc2])


def zero_expert_grads(layer) -> None:
    """Drop the accumulated gradients of the layer's parameters."""
    for p in layer.parameters():
        p.grad = None
