"""Start-up checks: which Megatron settings the MoK MoE layer cannot honour, and why.

The MoK layer computes exactly the contract of docs/contract.md: top-k routing without token
dropping, whole experts on their owner rank, a bias-free SwiGLU expert FFN in the model's
dtype, the router weight applied to each expert's output. :func:`unsupported_settings`
lists every setting of a ``TransformerConfig`` that asks for something else, each with the
reason and what to do instead; :func:`check_supported` raises them all at once, before any
parameter is allocated.
"""

from __future__ import annotations

import logging
from typing import Any, List

import torch.nn.functional as F

from .settings import MoKLayerSettings

__all__ = ["MoKUnsupportedError", "unsupported_settings", "check_supported", "warn_ignored_settings"]

log = logging.getLogger("megatron_mok")

_PREFIX = "--moe-token-dispatcher-type mok"
_EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
_MOE_GRAPH_MODULES = ("moe", "moe_router", "moe_preprocess")


class MoKUnsupportedError(ValueError):
    """The model configuration asks for something the MoK MoE layer does not do."""


def _name(value: Any) -> str:
    return getattr(value, "__name__", None) or getattr(value, "name", None) or repr(value)


def unsupported_settings(config: Any, settings: MoKLayerSettings) -> List[str]:
    """Every setting of ``config`` (a ``TransformerConfig``) that the MoK layer cannot run,
    as messages of the form "<setting>=<value>: <why>; <what to do>". Empty when supported.

    Args:
        config: the ``TransformerConfig`` the MoE layer is built from.
        settings: the layer's :class:`MoKLayerSettings` (the fused shared expert has its own
            requirements).
    """
    problems: List[str] = []

    def bad(setting: str, value: Any, why: str) -> None:
        problems.append(f"{setting}={value!r}: {why}")

    etp = getattr(config, "expert_tensor_parallel_size", 1) or 1
    if etp != 1:
        bad("expert_tensor_parallel_size", etp,
            "MoK keeps every expert whole on its owner rank (E/P experts per rank), while expert "
            "tensor parallelism splits each expert's FFN across ranks; set "
            "--expert-tensor-parallel-size 1 (attention keeps its own --tensor-model-parallel-size)")
    for setting in ("moe_expert_capacity_factor", "moe_expert_rank_capacity_factor"):
        value = getattr(config, setting, None)
        if value is not None:
            bad(setting, value,
                "MoK never drops tokens (its fixed-size ring buffer takes any routing skew), so "
                "capacity-factor token dropping has no meaning; remove "
                f"--{setting.replace('_', '-')}")
    for setting in ("moe_pad_expert_input_to_capacity", "moe_token_dropping",
                    "moe_pad_experts_for_cuda_graph_inference"):
        if getattr(config, setting, False):
            bad(setting, True, "MoK never drops or pads tokens to a capacity; remove this option")
    swiglu = "MoK's expert FFN is SwiGLU, (silu(x G) * (x U)) D; use --swiglu"
    if not getattr(config, "gated_linear_unit", False):
        bad("gated_linear_unit", getattr(config, "gated_linear_unit", None), swiglu)
    activation = getattr(config, "activation_func", None)
    if activation is not F.silu:
        problems.append(f"activation_func={_name(activation)}: {swiglu}")
    if getattr(config, "glu_linear_offset", 0.0):
        bad("glu_linear_offset", config.glu_linear_offset,
            "MoK's SwiGLU has no offset on the linear half; leave it at 0")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        bad("activation_func_clamp_value", config.activation_func_clamp_value,
            "MoK's SwiGLU does not clamp its inputs; leave it unset")
    if getattr(config, "add_bias_linear", False):
        bad("add_bias_linear", True,
            "MoK's experts have no bias (as DeepSeek-V3, Kimi-K2 and Qwen3 MoE); use --disable-bias-linear")
    if getattr(config, "moe_apply_probs_on_input", False):
        bad("moe_apply_probs_on_input", True,
            "MoK applies the router weight to each expert's output (after SwiGLU), which differs "
            "from scaling the input for a non-linear FFN; remove --moe-apply-probs-on-input")
    for setting in ("fp8", "fp4"):
        value = getattr(config, setting, None)
        if value:
            bad(setting, value,
                "MoK's experts compute in the model dtype (bf16); Transformer Engine's low-precision "
                f"recipes do not reach inside the MoK kernels; remove --{setting}")
    if getattr(config, "moe_router_padding_for_quantization", False):
        bad("moe_router_padding_for_quantization", True,
            "MoK pads expert segments itself (to the GEMM tile) and needs no router padding")
    if getattr(config, "moe_latent_size", None):
        bad("moe_latent_size", config.moe_latent_size,
            "MoK's experts take and return the model hidden size; latent MoE projections are not supported")
    if getattr(config, "moe_shared_expert_overlap", False):
        bad("moe_shared_expert_overlap", True,
            "overlapping the shared expert with the dispatcher's all-to-all is an alltoall/flex "
            "feature; use --mok-fuse-shared-expert to compute the shared expert inside the MoK call, "
            "or drop the flag to have Megatron compute it before the routed experts")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        bad("overlap_moe_expert_parallel_comm", True,
            "MoK overlaps communication with the expert GEMMs inside one kernel and has no "
            "separate dispatch/combine stages for the 1F1B all-to-all overlap schedule; remove the flag")
    for setting in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"):
        if getattr(config, setting, False):
            bad(setting, True,
                "MoK computes the expert weight gradients inside its backward; they cannot be "
                "deferred to a later backward_dw call")
    if getattr(config, "moe_mlp_glu_interleave_size", None) is not None:
        bad("moe_mlp_glu_interleave_size", config.moe_mlp_glu_interleave_size,
            "MoK reads fc1 as all gate rows then all up rows (Megatron's default layout)")
    for setting in ("moe_single_grouped_weight", "moe_single_grouped_bias"):
        if getattr(config, setting, False):
            bad(setting, True, "MoK reads the per-expert weights of SequentialMLP / TEGroupedMLP")
    if getattr(config, "moe_paged_stash", False):
        bad("moe_paged_stash", True, "the routed-expert activations live inside the MoK op")
    if getattr(config, "transformer_impl", "local") == "inference_optimized":
        bad("transformer_impl", "inference_optimized",
            "the inference-optimized MoE path has its own dispatchers; use 'local' or 'transformer_engine'")
    graph_impl = getattr(config, "cuda_graph_impl", "none")
    if graph_impl == "full_iteration":
        bad("cuda_graph_impl", graph_impl,
            "the MoK layer cannot be captured in a CUDA graph yet; use per-layer graphs of "
            "attention only (--cuda-graph-modules attn) or none")
    elif graph_impl in ("local", "transformer_engine"):
        modules = [_name(m) for m in (getattr(config, "cuda_graph_modules", None) or [])]
        captured = [m for m in modules if m in _MOE_GRAPH_MODULES]
        if not modules or captured:
            bad("cuda_graph_modules", modules or "whole layer",
                "the MoK layer cannot be captured in a CUDA graph yet; capture attention only "
                "(--cuda-graph-modules attn)")
    if getattr(config, "fine_grained_activation_offloading", False):
        offloaded = [m for m in (getattr(config, "offload_modules", None) or []) if m in _EXPERT_OFFLOAD_MODULES]
        if offloaded:
            bad("offload_modules", offloaded,
                "the routed-expert activations live inside the MoK op and cannot be offloaded")

    shared = getattr(config, "moe_shared_expert_intermediate_size", None)
    if settings.fuse_shared_expert and shared is not None:
        tp = getattr(config, "tensor_model_parallel_size", 1) or 1
        ffn = getattr(config, "moe_ffn_hidden_size", None)
        if tp != 1:
            bad("tensor_model_parallel_size", tp,
                "--mok-fuse-shared-expert runs the shared expert as a local expert, which needs its "
                "weights whole on every rank; use tensor-parallel size 1 or drop --mok-fuse-shared-expert")
        if ffn and shared % ffn:
            bad("moe_shared_expert_intermediate_size", shared,
                f"--mok-fuse-shared-expert splits the shared expert into experts of "
                f"--moe-ffn-hidden-size={ffn}, so it must be a multiple of it; drop --mok-fuse-shared-expert")
        if getattr(config, "use_grouped_gemm_for_shared_expert", False):
            bad("use_grouped_gemm_for_shared_expert", True,
                "--mok-fuse-shared-expert reads the weights of Megatron's SharedExpertMLP")
        if getattr(config, "moe_shared_expert_glu_interleave_size", None) is not None:
            bad("moe_shared_expert_glu_interleave_size", config.moe_shared_expert_glu_interleave_size,
                "--mok-fuse-shared-expert reads fc1 as all gate rows then all up rows")
    return problems


def check_supported(config: Any, settings: MoKLayerSettings) -> None:
    """Raise :class:`MoKUnsupportedError` listing every unsupported setting of ``config``.

    Args:
        config: the ``TransformerConfig`` of the MoE layer.
        settings: the layer's :class:`MoKLayerSettings`.
    """
    problems = unsupported_settings(config, settings)
    if problems:
        listed = "\n  - ".join(problems)
        raise MoKUnsupportedError(f"{_PREFIX} does not support these settings:\n  - {listed}")


def warn_ignored_settings(config: Any) -> None:
    """Log settings that the MoK layer accepts but that have no effect on it."""
    modules = getattr(config, "recompute_modules", None) or []
    if getattr(config, "recompute_granularity", None) == "selective" and "moe_act" in modules:
        _warn_once("megatron-mok: --recompute-modules moe_act has no effect on the MoK layer (the "
                   "SwiGLU activations live inside the MoK op); use 'moe' to recompute the whole layer")


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)
