"""Run Megatron-Core's MoE layers on a CPU-only machine (tests and the CPU demo).

Megatron-Core assumes a CUDA device in a few places that have nothing to do with the
arithmetic: ``TopKRouter.gating`` moves its weight to ``torch.cuda.current_device()``,
buffers and sequence-parallel gathers are allocated there, and the alltoall dispatcher
creates a side ``torch.cuda.Stream`` for its device-to-host copies. :func:`cpu_device_patches`
replaces exactly those entry points with CPU equivalents for the duration of a ``with``
block, so that Megatron's own layer and the MoK layer both run on the CPU over gloo.

It changes nothing on a machine with a GPU unless it is entered, and it is never entered by
the MoK layer or the launcher themselves.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional
from unittest import mock

import torch

__all__ = ["cpu_device_patches", "initialize_cpu_model_parallel"]


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``; there is one (implicit) CPU stream."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


_THE_STREAM = _CpuStream()


def _split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``maybe_move_tensor_to_cpu`` converts split sizes to numpy only for CUDA
    tensors; gloo's all-to-all needs them as host numbers for CPU tensors too."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


@contextlib.contextmanager
def cpu_device_patches() -> Iterator[None]:
    """Inside the block, ``torch.cuda.is_available()`` is False, ``torch.cuda.current_device()``
    is the CPU device and CUDA streams and events are inert stand-ins, so Megatron-Core's MoE
    code paths run on CPU tensors.

    Use only where there is no GPU (tests, the CPU demo): any real CUDA work inside the block
    would be misdirected to the CPU.
    """
    cpu = torch.device("cpu")
    patches = [
        # Code that asks whether to use the GPU (the MoK layer's backend check among it) gets the
        # CPU answer, also on a machine that has a GPU.
        mock.patch("torch.cuda.is_available", lambda: False),
        mock.patch("torch.cuda.current_device", lambda: cpu),
        mock.patch("torch.cuda.Stream", _CpuStream),
        mock.patch("torch.cuda.Event", _CpuEvent),
        mock.patch("torch.cuda.current_stream", lambda device=None: _THE_STREAM),
        mock.patch("torch.cuda.stream", lambda stream=None: contextlib.nullcontext()),
        mock.patch("torch.cuda.synchronize", lambda device=None: None),
        mock.patch("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
                   _split_sizes_to_host),
        # Megatron's RNG tracker forks "CUDA" generator states around dropout; on the CPU the
        # CPU generator plays that role.
        mock.patch("torch.cuda.get_rng_state", lambda device="cuda": torch.get_rng_state()),
        mock.patch("torch.cuda.manual_seed", lambda seed: torch.manual_seed(seed)),
        mock.patch("megatron.core.tensor_parallel.random._get_cuda_rng_state",
                   lambda *args, **kwargs: torch.get_rng_state()),
        mock.patch("megatron.core.tensor_parallel.random._set_cuda_rng_state",
                   lambda state, *args, **kwargs: torch.set_rng_state(state)),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def initialize_cpu_model_parallel(*, tensor_parallel: int = 1, expert_parallel: int = 1,
                                  pipeline_parallel: int = 1, expert_tensor_parallel: Optional[int] = None,
                                  virtual_pipeline_parallel: Optional[int] = None, context_parallel: int = 1,
                                  seed: int = 1234) -> None:
    """Megatron's model-parallel groups and RNG tracker over an initialised gloo default group.

    Call inside :func:`cpu_device_patches`, after ``torch.distributed.init_process_group("gloo")``.
    ``torch.compile`` is switched off in this process: Megatron wraps its fused kernels in
    ``torch.compile``, whose CPU compilation takes far longer than the tiny models it serves.

    Args:
        tensor_parallel, expert_parallel, pipeline_parallel, context_parallel: group sizes (the
            world size must be divisible by tensor_parallel * context_parallel * pipeline_parallel
            and by expert_tensor_parallel * expert_parallel * pipeline_parallel).
        expert_tensor_parallel: the expert layers' tensor-parallel size (Megatron's default,
            None, is the tensor-parallel size; MoK needs 1).
        virtual_pipeline_parallel: virtual pipeline stages per rank (None: no interleaving).
        seed: Megatron's model-parallel RNG seed.
    """
    import torch._dynamo

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch._dynamo.config.disable = True
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline_parallel,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )
    model_parallel_cuda_manual_seed(seed)
