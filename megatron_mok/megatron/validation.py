"""Start-up checks: which Megatron settings the MoK MoE layer cannot honour, and why.

The MoK layer computes exactly the contract of docs/contract.md: top-k routing without token
dropping, whole experts on their owner rank, a bias-free SwiGLU expert FFN in the model's
dtype, the router weight applied to each expert's output. :func:`unsupported_settings`
lists every setting of a ``TransformerConfig`` that asks for something else, each with the
reason and what to do instead; :func:`check_supported` raises them all at once, before any
parameter is allocated.

:func:`check_supported_args` runs the same checks on Megatron's parsed command line before
Megatron validates it, so that for a setting MoK refuses or replaces (``--moe-shared-expert-overlap``,
``--overlap-moe-expert-parallel-comm``, ``--moe-enable-deepep``, ``--recompute-modules moe_act``
without grouped GEMM, ...) the user reads MoK's reason and advice, not the assertion
Megatron's own checks (``validate_args``, ``TransformerConfig.__post_init__``) raise for a
dispatcher type other than alltoall/flex.
"""

from __future__ import annotations

from typing import Any, List

import torch.nn.functional as F

from .settings import MoKLayerSettings

__all__ = ["MoKUnsupportedError", "unsupported_settings", "check_supported", "check_supported_args",
           "config_view_of_args", "ignored_settings"]

_PREFIX = "--moe-token-dispatcher-type mok"
_EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
_MOE_GRAPH_MODULES = ("moe", "moe_router", "moe_preprocess")


class MoKUnsupportedError(ValueError):
    """The model configuration asks for something the MoK MoE layer does not do."""


def _name(value: Any) -> str:
    if isinstance(value, str):
        return value
    return getattr(value, "__name__", None) or getattr(value, "name", None) or repr(value)


def _graph_modules(config: Any) -> List[str]:
    """The modules per-layer CUDA graphs capture, as names; empty: the whole layer. Reads
    ``cuda_graph_modules`` (or its deprecated name ``cuda_graph_scope``) before or after
    ``__post_init__`` normalised it ("full" is the whole layer)."""
    value = getattr(config, "cuda_graph_scope", None) or getattr(config, "cuda_graph_modules", None) or []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        value = [value]
    names = [_name(m) for m in value]
    return [] if names == ["full"] else names


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
            "separate dispatch/combine stages for the 1F1B all-to-all overlap schedule; remove "
            "--overlap-moe-expert-parallel-comm")
    if getattr(config, "ep_overlap_early_attn_memory_release", False):
        bad("ep_overlap_early_attn_memory_release", True,
            "it belongs to the 1F1B all-to-all overlap schedule, which MoK does not use; remove "
            "--ep-overlap-early-attn-memory-release")
    if getattr(config, "moe_enable_deepep", False):
        bad("moe_enable_deepep", True,
            "DeepEP is a backend of Megatron's flex dispatcher; MoK does its own dispatch and combine "
            "(pull and push over NVLink inside its kernels); remove --moe-enable-deepep")
    modules = [_name(m) for m in (getattr(config, "recompute_modules", None) or [])]
    if (getattr(config, "recompute_granularity", None) == "selective" and "moe_act" in modules
            and not getattr(config, "moe_grouped_gemm", False)):
        bad("recompute_modules", modules,
            "'moe_act' recomputes the expert activation of Megatron's grouped-GEMM experts; the MoK "
            "layer keeps the SwiGLU activations inside its op, so it has nothing to recompute there; "
            "use --recompute-modules moe (recompute the whole MoE layer) or drop moe_act")
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
        modules = _graph_modules(config)
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


def ignored_settings(config: Any) -> List[str]:
    """Settings the MoK layer accepts but that have no effect on it, as messages (the layer
    prints them at start-up)."""
    modules = [_name(m) for m in (getattr(config, "recompute_modules", None) or [])]
    if getattr(config, "recompute_granularity", None) == "selective" and "moe_act" in modules:
        return ["megatron-mok: recompute_modules=moe_act has no effect on the MoK layer (the SwiGLU "
                "activations live inside the MoK op); use --recompute-modules moe to recompute the whole layer"]
    return []


_ARGS_ONLY = {
    # TransformerConfig field -> how the parsed (not yet validated) arguments give it.
    "num_moe_experts": lambda a: getattr(a, "num_experts", None) or None,
}


def config_view_of_args(args: Any) -> Any:
    """The ``TransformerConfig`` fields MoK's checks read, taken from Megatron's parsed command
    line as ``core_transformer_config_from_args`` would set them (before ``validate_args`` has
    filled in defaults): ``--swiglu`` gives ``gated_linear_unit`` and ``activation_func``,
    ``--expert-tensor-parallel-size`` defaults to the tensor-parallel size, a negative
    capacity factor means none. Every other field keeps the argument of the same name."""
    from types import SimpleNamespace

    view = SimpleNamespace(**vars(args))
    if getattr(args, "swiglu", False):
        view.gated_linear_unit, view.activation_func = True, F.silu
    elif getattr(args, "quick_geglu", False):
        view.gated_linear_unit, view.activation_func = True, "quick_gelu"
    elif getattr(args, "squared_relu", False):
        view.gated_linear_unit, view.activation_func = False, "squared_relu"
    else:
        view.gated_linear_unit, view.activation_func = False, F.gelu
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if getattr(args, "expert_tensor_parallel_size", None) is None:
        view.expert_tensor_parallel_size = tp
    capacity = getattr(args, "moe_expert_capacity_factor", None)
    if capacity is not None and capacity < 0:
        view.moe_expert_capacity_factor = None
    for field, value in _ARGS_ONLY.items():
        setattr(view, field, value(args))
    if getattr(args, "recompute_granularity", None) == "selective" and getattr(args, "recompute_modules", None) is None:
        view.recompute_modules = ["core_attn"]
    return view


def check_supported_args(args: Any, settings: MoKLayerSettings) -> None:
    """:func:`check_supported` on Megatron's parsed command line (:func:`config_view_of_args`),
    to run before Megatron's ``validate_args``: a setting MoK refuses is reported with MoK's
    reason even where Megatron's own checks would refuse it first for a dispatcher other
    than alltoall/flex.

    Raises:
        MoKUnsupportedError: listing every unsupported setting.
    """
    check_supported(config_view_of_args(args), settings)
