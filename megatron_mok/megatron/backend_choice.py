"""Which MoK backend the MoE layers of a Megatron job run, decided at start-up, and why.

``--mok-backend auto`` takes the first backend of :data:`megatron_mok.functional.backends.REGISTRY`
that runs the layer (the megakernel, else ``cuda``, else ``reference``). In Megatron training the
reference backend is not a training path: it all-gathers the tokens of the whole EP group and
computes in fp32, a correctness oracle. So when ``auto`` would end there on a CUDA machine (a
dtype other than bf16, a GPU that is not sm_90, a shape the GPU backends refuse, no CUDA
library), start-up fails with :class:`MoKBackendError`: one message listing why (dtype,
architecture, shape, library) and what to do, each as ``setting=value: why; what to do``.
``--mok-backend reference`` is the explicit way to run the slow path.

* :func:`choose_backend`: the backend a layer of this config runs on a device, and why (raises
  when it cannot run a GPU backend where one is expected, or when a requested backend cannot run);
* :func:`describe_layer_choice`: the start-up line rank 0 prints for each MoE layer.

Backends are chosen by :func:`megatron_mok.functional.backends.select_backend` and each
backend's ``unavailable_reason``; this module only asks them, at start-up, the question every
``mok_moe`` call asks, and turns the answer into a decision the user sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from ..functional.backends import (REGISTRY, BackendUnavailable, CallSpec, backend_named, gpu_unavailable_reason,
                                   select_backend)
from ..functional.validate import MoEShape
from .settings import MoKLayerSettings

__all__ = ["MoKBackendError", "BackendChoice", "choose_backend", "model_dtype", "layer_shape", "describe_layer_choice",
           "REFERENCE_IS_SLOW"]

_GPU_BACKENDS = tuple(b.name for b in REGISTRY if b.name != "reference")
REFERENCE_IS_SLOW = ("the pure-PyTorch reference backend (it all-gathers the tokens of the whole EP group and "
                     "computes in fp32: a correctness oracle, not a training path)")
_ON_PURPOSE = "or pass --mok-backend reference to run the reference backend on purpose (slow)"


class MoKBackendError(BackendUnavailable):
    """No MoK GPU backend can run the MoE layers of this job, and the reference backend was not
    asked for; the message lists why and what to do."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend a MoE layer runs and why.

    Attributes:
        requested: ``--mok-backend`` (``auto``, ``megakernel``, ``cuda``, ``reference``).
        backend: the backend that runs.
        why: one clause saying why, for the start-up line.
    """

    requested: str
    backend: str
    why: str


def model_dtype(config: Any) -> torch.dtype:
    """The dtype the MoE layers compute in: bf16 with ``bf16``, fp16 with ``fp16`` (Megatron's
    ``Float16Module`` casts the activations), else ``params_dtype`` (fp32 by default)."""
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return getattr(config, "params_dtype", None) or torch.float32


def _fused_shared_experts(config: Any, settings: MoKLayerSettings) -> int:
    shared = getattr(config, "moe_shared_expert_intermediate_size", None)
    ffn = getattr(config, "moe_ffn_hidden_size", None) or getattr(config, "ffn_hidden_size", None)
    if settings.fuse_shared_expert and shared and ffn and shared % ffn == 0:
        return shared // ffn
    return 0


def layer_shape(config: Any, settings: MoKLayerSettings, tokens: int = 1) -> MoEShape:
    """The sizes of the ``mok_moe`` call a MoE layer of ``config`` makes (the fused shared expert
    adds experts per rank and slots per token). ``tokens`` does not decide which backend runs."""
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    experts = getattr(config, "num_moe_experts", None) or 0
    shared = _fused_shared_experts(config, settings)
    return MoEShape(tokens=tokens, hidden=config.hidden_size,
                    topk=config.moe_router_topk + shared, experts_per_rank=experts // ep + shared,
                    ffn_hidden=getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size)


def _call_spec(config: Any, settings: MoKLayerSettings, device: torch.device, dtype: torch.dtype) -> CallSpec:
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    return CallSpec(shape=layer_shape(config, settings), config=settings.config, ep_group=None, ep_size=ep,
                    device=device, dtype=dtype)


def _dtype_setting(dtype: torch.dtype) -> str:
    if dtype == torch.float16:
        return "fp16=True (--fp16)"
    return f"params_dtype={dtype} (neither --bf16 nor --fp16)"


def _shape_setting(config: Any, settings: MoKLayerSettings) -> str:
    shape = layer_shape(config, settings)
    return (f"MoE layer shape (hidden_size={shape.hidden}, moe_ffn_hidden_size={shape.ffn_hidden}, "
            f"{shape.experts_per_rank} experts per rank, top-{shape.topk}, --mok-tile-rows "
            f"{settings.config.tile_rows})")


def no_gpu_backend_problems(config: Any, settings: MoKLayerSettings, *, device: Optional[torch.device],
                            dtype: torch.dtype) -> List[str]:
    """Why no MoK GPU backend can run a MoE layer of ``config``, each as ``setting=value: why;
    what to do``; empty when one can.

    Args:
        device: the CUDA device the layer runs on, or None on a machine without a CUDA GPU
            (then only what does not depend on the machine, the dtype, is checked).
        dtype: the dtype the layer computes in (:func:`model_dtype`).
    """
    fallback = f"so --mok-backend auto would run every MoE layer on {REFERENCE_IS_SLOW}"
    problems = []
    if dtype != torch.bfloat16:
        problems.append(f"{_dtype_setting(dtype)}: MoK's GPU backends ({', '.join(_GPU_BACKENDS)}) compute in "
                        f"bf16, {fallback}; train with --bf16, {_ON_PURPOSE}")
    if device is None:
        return problems
    if device.type != "cuda":
        problems.append(f"device={device}: MoK's GPU backends need a CUDA GPU, {fallback}; run on sm_90 GPUs "
                        f"(H100/H200), {_ON_PURPOSE}")
        return problems
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        problems.append(f"device={name} (sm_{major}{minor}, GPU {device.index}): MoK's GPU kernels are built for "
                        f"sm_90a (H100/H200) only, {fallback}; run on H100/H200 GPUs, or use Megatron's "
                        f"--moe-token-dispatcher-type alltoall (or flex) on these GPUs, {_ON_PURPOSE}")
    if problems:
        return problems
    library = gpu_unavailable_reason(device, torch.bfloat16)
    if library is not None:
        return [f"MoK CUDA library: {library}, {fallback}; build it with `python -m megatron_mok._build` "
                f"(needs nvcc from CUDA 12.8 or newer), {_ON_PURPOSE}"]
    spec = _call_spec(config, settings, device, torch.bfloat16)
    reasons = [(name, backend_named(name).unavailable_reason(spec)) for name in _GPU_BACKENDS]
    if all(reason is not None for _, reason in reasons):
        listed = "; ".join(f"{name}: {reason}" for name, reason in reasons)
        problems.append(f"{_shape_setting(config, settings)}: no GPU backend takes it ({listed}), {fallback}; "
                        f"change the size a reason names (the cuda backend takes hidden and expert FFN sizes "
                        f"that are multiples of 8), {_ON_PURPOSE}")
    return problems


def _error(problems: List[str]) -> MoKBackendError:
    listed = "\n  - ".join(problems)
    return MoKBackendError("--moe-token-dispatcher-type mok with --mok-backend auto: no MoK GPU backend can run "
                           f"the MoE layers of this job:\n  - {listed}")


def choose_backend(config: Any, settings: MoKLayerSettings, *, device: Optional[torch.device],
                   dtype: Optional[torch.dtype] = None) -> BackendChoice:
    """The backend the MoE layers of ``config`` run on ``device``, and why.

    Args:
        config: the layer's ``TransformerConfig`` (or anything with its MoE fields).
        settings: the layer's settings (``--mok-backend`` and the tunables).
        device: the layer's device: a CUDA device, the CPU (tests, the CPU demo: ``auto`` runs
            the reference backend there), or None at argument validation on a machine without a
            CUDA GPU (only the dtype is checked; the backend is decided on the GPU machine).
        dtype: the compute dtype (default :func:`model_dtype` of ``config``).

    Raises:
        MoKBackendError: ``auto``, and no GPU backend can run the layer on a CUDA device (or, on
            any machine, in this dtype).
        BackendUnavailable: ``megakernel`` or ``cuda`` was requested and cannot run here.
    """
    requested = settings.backend
    dtype = model_dtype(config) if dtype is None else dtype
    if requested == "reference":
        return BackendChoice(requested, "reference", f"--mok-backend reference: {REFERENCE_IS_SLOW}")
    if requested != "auto":
        if device is None or device.type != "cuda":
            raise BackendUnavailable(f"mok_backend={requested!r}: the {requested} backend needs a CUDA GPU (sm_90) "
                                     "and this machine has none; use --mok-backend reference on the CPU")
        try:
            select_backend(requested, _call_spec(config, settings, device, dtype))
        except BackendUnavailable as err:
            reason = str(err).split("cannot run: ", 1)[-1]
            raise BackendUnavailable(f"mok_backend={requested!r}: {reason}; use --mok-backend auto (the fastest "
                                     "backend that runs this layer) or change what the reason names") from None
        return BackendChoice(requested, requested, f"--mok-backend {requested}")
    if device is None:  # argument validation without a GPU: what the GPU machine would refuse anyway
        problems = no_gpu_backend_problems(config, settings, device=None, dtype=dtype)
        if problems:
            raise _error(problems)
        return BackendChoice(requested, "reference", "--mok-backend auto, no CUDA GPU on this machine (on sm_90 "
                                                     "GPUs: the fastest GPU backend that takes the layer)")
    if device.type != "cuda":  # a layer on the CPU (tests, the CPU demo): the reference is the only backend
        return BackendChoice(requested, "reference", f"--mok-backend auto on {device}: {REFERENCE_IS_SLOW}")
    spec = _call_spec(config, settings, device, dtype)
    chosen = select_backend("auto", spec)
    if chosen.name == "reference":
        raise _error(no_gpu_backend_problems(config, settings, device=device, dtype=dtype)
                     or [f"{b.name}: {b.unavailable_reason(spec)}" for b in REGISTRY if b.name != "reference"])
    skipped = []
    for backend in REGISTRY:
        if backend is chosen:
            break
        skipped.append(f"not {backend.name} ({backend.unavailable_reason(spec)})")
    why = "; ".join(["--mok-backend auto: the fastest backend that takes this layer"] + skipped)
    return BackendChoice(requested, chosen.name, why)


def describe_layer_choice(choice: BackendChoice, config: Any, settings: MoKLayerSettings, *,
                          layer_number: Optional[int], is_mtp_layer: bool, device: torch.device,
                          dtype: torch.dtype) -> str:
    """The start-up line of one MoE layer: which backend it runs and why, with the facts the
    choice rests on (dtype, device, shape)."""
    shape = layer_shape(config, settings)
    where = f"MTP layer {layer_number}" if is_mtp_layer else f"decoder layer {layer_number}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        device_text = f"sm_{major}{minor}"
    else:
        device_text = str(device)
    facts = (f"{str(dtype).replace('torch.', '')}, {device_text}, hidden {shape.hidden}, expert FFN {shape.ffn_hidden}, "
             f"{shape.experts_per_rank} experts per rank, top-{shape.topk}")
    return f"> megatron-mok: the MoE of {where} runs the {choice.backend} backend [{choice.why}] ({facts})"
