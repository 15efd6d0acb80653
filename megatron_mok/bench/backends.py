"""The backends the layer benchmark compares, behind one small interface.

A backend is prepared for one rank's expert weights (:class:`Experts`) and then runs the
forward of any batch of tokens (:class:`TokenBatch`, :meth:`Runner.forward`); the caller runs
the backward on the returned tensor and reads the gradients with :meth:`Runner.grads`.
A backend that cannot run here raises :class:`Skip` with the reason, while being prepared
or on its first call.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import megatron_layer
from .a2a_baseline import Mark, a2a_grouped_mm_moe

MOK_BACKENDS = {"mok-megakernel": "megakernel", "mok-cuda": "cuda", "reference": "reference"}
"""Benchmark backend name -> ``mok_moe(backend=...)``."""

BACKENDS: Dict[str, str] = {
    "mok-megakernel": "MoK megakernel: dispatch, expert FFN and combine in one persistent kernel",
    "mok-cuda": "MoK cuda backend: comm kernels + grouped GEMM",
    "a2a-grouped-mm": "all_to_all_single (NCCL; gloo on CPU) + torch._grouped_mm, plain PyTorch",
    "megatron-alltoall": "Megatron-Core MoELayer, alltoall dispatcher; experts TEGroupedMLP (Transformer Engine) "
                         "where TE is installed, else SequentialMLP",
    "megatron-flex-deepep": "Megatron-Core MoELayer, flex dispatcher on DeepEP; experts as megatron-alltoall",
    "megatron-flex-hybridep": "Megatron-Core MoELayer, flex dispatcher on HybridEP; experts as megatron-alltoall",
    "reference": "MoK reference backend: pure PyTorch, the oracle (slow)",
}
"""Every backend the benchmark knows, in the order it runs and reports them."""

DEFAULT_GPU_BACKENDS = tuple(n for n in BACKENDS if n != "reference")
DEFAULT_CPU_BACKENDS = ("a2a-grouped-mm", "reference")


class Skip(RuntimeError):
    """The backend cannot run here; the message says why."""


@dataclass
class TokenBatch:
    """One rank's tokens and routing (leaves of the autograd graph where marked).

    Attributes:
        x: [T, H] tokens, requires grad.
        topk_ids: int64 [T, K] global expert ids.
        topk_weights: float32 [T, K], requires grad.
        dy: [T, H] the upstream gradient of the backward.
    """

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    dy: torch.Tensor

    def head(self, tokens: int) -> "TokenBatch":
        """The first ``tokens`` tokens, as new leaves."""
        leaf = lambda t: t[:tokens].detach().clone().requires_grad_(t.requires_grad)
        return TokenBatch(x=leaf(self.x), topk_ids=self.topk_ids[:tokens].clone(),
                          topk_weights=leaf(self.topk_weights), dy=self.dy[:tokens].clone())


@dataclass
class Experts:
    """This rank's expert weights and the EP group.

    Attributes:
        fc1_weight: [L, 2I, H], requires grad; fc2_weight: [L, H, I], requires grad.
        num_experts: E = L * P.
        group: the EP group (None for P = 1).
    """

    fc1_weight: torch.Tensor
    fc2_weight: torch.Tensor
    num_experts: int
    group: Optional[dist.ProcessGroup]
    main_grads: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = None
    """``--main-grad``: per-expert fp32 [2I, H] and [H, I] buffers, as Megatron's DDP holds the
    expert weights' ``main_grad`` (see :func:`main_grad_buffers`); None: bf16 gradients."""

    @property
    def ep_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)


Grads = Dict[str, torch.Tensor]
"""{"x": [T, H], "topk_weights": [T, K], "fc1_weight": [L, 2I, H], "fc2_weight": [L, H, I]}"""


class Runner(abc.ABC):
    """A backend prepared for one set of expert weights (``experts``); it runs any
    :class:`TokenBatch`."""

    name = ""
    experts: Experts

    @abc.abstractmethod
    def forward(self, batch: TokenBatch, mark: Mark = None) -> torch.Tensor:
        """Run the forward on ``batch``; returns y [T, H], attached to the autograd graph."""

    @abc.abstractmethod
    def grads(self, batch: TokenBatch) -> Grads:
        """Gradients accumulated by the backward(s) of ``batch`` since :meth:`zero_grad`."""

    @abc.abstractmethod
    def zero_grad(self, batch: TokenBatch) -> None:
        """Clear the gradients of ``batch``'s inputs and of the expert weights."""

    @abc.abstractmethod
    def grad_tensors(self, batch: TokenBatch) -> List[torch.Tensor]:
        """The gradient tensors the backward(s) of ``batch`` left on the autograd leaves the
        runner differentiates (inputs and expert weights), as stored (no copy, no reshaping):
        what the backward hands back, for the activation-memory figure."""

    def close(self) -> None:
        """Release what the runner holds (a Megatron layer's copy of the weights)."""

    def after_backward(self, batch: TokenBatch) -> None:
        """Inside the timed backward, with ``--main-grad``: what Megatron's DDP hook does after a
        backward that returned bf16 expert weight gradients: ``main_grad[e] += grad[e]`` for
        every expert weight, then the gradient dropped (MoK's runners accumulate inside the
        kernel and only drop the placeholders)."""
        mains = self.experts.main_grads
        if mains is None:
            return
        for w, bufs in zip(self._expert_leaves(), mains):
            if w.grad is not None:
                for e, b in enumerate(bufs):
                    b.add_(w.grad[e])
                w.grad = None

    def _expert_leaves(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.experts.fc1_weight, self.experts.fc2_weight

    def context(self):
        """A context manager to run each forward and backward in (Megatron's CPU stand-ins for
        a Megatron layer on the CPU; nothing else)."""
        return contextlib.nullcontext()


class _LeafGradsRunner(Runner):
    """A runner whose differentiable inputs are the batch's and the experts' leaves."""

    def __init__(self, experts: Experts):
        self.experts = experts

    def grads(self, batch: TokenBatch) -> Grads:
        return {"x": batch.x.grad, "topk_weights": batch.topk_weights.grad,
                "fc1_weight": self.experts.fc1_weight.grad, "fc2_weight": self.experts.fc2_weight.grad}

    def zero_grad(self, batch: TokenBatch) -> None:
        for t in (batch.x, batch.topk_weights, self.experts.fc1_weight, self.experts.fc2_weight):
            t.grad = None

    def grad_tensors(self, batch: TokenBatch) -> List[torch.Tensor]:
        leaves = (batch.x, batch.topk_weights, self.experts.fc1_weight, self.experts.fc2_weight)
        return [t.grad for t in leaves if t.grad is not None]


class MokRunner(_LeafGradsRunner):
    """``megatron_mok.functional.mok_moe`` with a fixed backend. Its communication workspace
    is sized for ``max_tokens`` per rank at the first call (the capacity cannot grow later on
    an EP group), so the benchmark passes the case's token count even when a check with fewer
    tokens runs first."""

    def __init__(self, name: str, experts: Experts, max_tokens: int, training_ring_rows: Optional[int] = None,
                 tile_rows: int = 128):
        super().__init__(experts)
        self.name = name
        self.backend = MOK_BACKENDS[name]
        try:
            from megatron_mok import MoKConfig
            from megatron_mok.functional import BackendUnavailable, mok_moe
        except ImportError as err:
            raise Skip(f"megatron_mok.functional does not import ({err})") from err
        self._mok_moe = mok_moe
        self._unavailable = BackendUnavailable
        self.config = MoKConfig(max_tokens_per_rank=max_tokens, training_ring_rows=training_ring_rows,
                                tile_rows=tile_rows)

    def forward(self, batch: TokenBatch, mark: Mark = None) -> torch.Tensor:
        e = self.experts
        try:
            return self._mok_moe(batch.x, batch.topk_ids, batch.topk_weights, e.fc1_weight,
                                 e.fc2_weight, ep_group=e.group, config=self.config,
                                 backend=self.backend, main_grads=e.main_grads)
        except self._unavailable as err:
            raise Skip(str(err)) from err
        except ImportError as err:
            raise Skip(f"backend {self.backend!r} is not part of this build ({err})") from err

    def after_backward(self, batch: TokenBatch) -> None:
        if self.experts.main_grads is not None:  # accumulated in the kernel: drop the placeholders
            self.experts.fc1_weight.grad = self.experts.fc2_weight.grad = None


class A2ARunner(_LeafGradsRunner):
    """:func:`megatron_mok.bench.a2a_baseline.a2a_grouped_mm_moe`."""

    name = "a2a-grouped-mm"

    def __init__(self, experts: Experts):
        super().__init__(experts)
        if not hasattr(torch, "_grouped_mm"):
            raise Skip(f"torch {torch.__version__} has no torch._grouped_mm")
        w = experts.fc1_weight
        if w.is_cuda and torch.cuda.get_device_capability(w.device)[0] < 9:
            raise Skip("torch._grouped_mm needs sm_90 or newer on CUDA")

    def forward(self, batch: TokenBatch, mark: Mark = None) -> torch.Tensor:
        e = self.experts
        return a2a_grouped_mm_moe(batch.x, batch.topk_ids, batch.topk_weights, e.fc1_weight,
                                  e.fc2_weight, ep_group=e.group, mark=mark)


class MegatronRunner(Runner):
    """Megatron-Core's MoELayer (:mod:`megatron_mok.bench.megatron_layer`), holding its own
    copy of the expert weights; ``expert_module`` names its experts ("TEGroupedMLP" or
    "SequentialMLP")."""

    def __init__(self, name: str, experts: Experts, topk: int, expert_module: str = "auto"):
        self.name = name
        self.experts = experts
        reason = megatron_layer.unavailable_reason(name, experts.fc1_weight.device)
        if reason is not None:
            raise Skip(reason)
        fc1, fc2 = experts.fc1_weight.detach(), experts.fc2_weight.detach()
        try:
            self.layer = megatron_layer.build_layer(
                name, hidden=fc1.shape[2], ffn_hidden=fc2.shape[2], num_experts=experts.num_experts,
                topk=topk, ep_size=experts.ep_size, fc1_weight=fc1, fc2_weight=fc2, experts=expert_module)
        except ValueError as err:  # --megatron-experts te-grouped where TE cannot run
            raise Skip(str(err)) from err
        self.expert_module = self.layer.expert_module
        self._device = fc1.device
        self._batch: Optional[TokenBatch] = None

    def _use(self, batch: TokenBatch) -> None:
        """Point the layer's fixed routing and input leaf at ``batch``."""
        if self._batch is batch:
            return
        if bool((batch.topk_ids < 0).any()):
            raise Skip("Megatron's routing map has no unused (-1) slots")
        if batch.topk_ids.shape[1] != self.layer.config.moe_router_topk:
            raise RuntimeError(f"the layer was built for top-{self.layer.config.moe_router_topk}, "
                               f"the batch has top-{batch.topk_ids.shape[1]}")
        self.x = batch.x.detach().clone().requires_grad_()
        self.probs, routing_map = megatron_layer.dense_routing(
            batch.topk_ids, batch.topk_weights, self.experts.num_experts)
        self.layer.router.set(self.probs, routing_map)
        self._batch = batch

    def context(self):
        return megatron_layer.device_context(self._device)

    def forward(self, batch: TokenBatch, mark: Mark = None) -> torch.Tensor:
        self._use(batch)
        T, H = self.x.shape
        with self.context():
            out, bias = self.layer(self.x.view(T, 1, H))
        if bias is not None:
            raise RuntimeError("Megatron's MoE layer returned a bias; the benchmark builds it without")
        return out.view(T, H)

    def grads(self, batch: TokenBatch) -> Grads:
        self._use(batch)
        fc1, fc2 = megatron_layer.expert_weight_grads(self.layer)
        return {"x": self.x.grad, "topk_weights": self.probs.grad.gather(1, batch.topk_ids),
                "fc1_weight": fc1, "fc2_weight": fc2}

    def zero_grad(self, batch: TokenBatch) -> None:
        self._use(batch)
        self.x.grad = None
        self.probs.grad = None
        megatron_layer.zero_expert_grads(self.layer)

    def after_backward(self, batch: TokenBatch) -> None:
        mains = self.experts.main_grads
        if mains is None:
            return
        from megatron_mok.megatron.experts import local_expert_weights

        for ws, bufs in zip(local_expert_weights(self.layer.experts, self.layer.num_local_experts), mains):
            for w, b in zip(ws, bufs):
                if w.grad is not None:
                    b.add_(w.grad)
                    w.grad = None

    def grad_tensors(self, batch: TokenBatch) -> List[torch.Tensor]:
        # The dense [T, E] router-probability gradient, as the backward leaves it (grads()
        # gathers a [T, K] copy of it).
        self._use(batch)
        leaves = [self.x, self.probs] + list(self.layer.parameters())
        return [t.grad for t in leaves if t.grad is not None]

    def close(self) -> None:
        self.layer = None
        self._batch = None
        if self.experts.fc1_weight.is_cuda:
            torch.cuda.empty_cache()


def main_grad_buffers(fc1_weight: torch.Tensor, fc2_weight: torch.Tensor
                      ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Zeroed fp32 ``main_grad`` buffers of the expert weights ([L, 2I, H], [L, H, I]) as
    Megatron's DDP lays them out for ``SequentialMLP``: one buffer, each expert's fc1 and fc2
    one after the other, experts in reverse order. Returns (fc1 views [2I, H], fc2 views [H, I])
    per expert."""
    L = fc1_weight.shape[0]
    n1, n2 = fc1_weight[0].numel(), fc2_weight[0].numel()
    buf = torch.zeros(L * (n1 + n2), dtype=torch.float32, device=fc1_weight.device)
    fc1, fc2 = [], []
    for e in range(L):
        at = (L - 1 - e) * (n1 + n2)
        fc1.append(buf[at:at + n1].view(fc1_weight.shape[1:]))
        fc2.append(buf[at + n1:at + n1 + n2].view(fc2_weight.shape[1:]))
    return fc1, fc2


def make_runner(name: str, experts: Experts, topk: int, max_tokens: int, megatron_experts: str = "auto",
                training_ring_rows: Optional[int] = None, tile_rows: int = 128) -> Runner:
    """Prepare backend ``name`` (a key of :data:`BACKENDS`) for ``experts``, top-``topk``
    routing and batches of at most ``max_tokens`` tokens per rank (``megatron_experts``: the
    expert module of the Megatron backends, ``--megatron-experts``; ``training_ring_rows`` and
    ``tile_rows``: MoK's ``MoKConfig`` fields, None for the ring's default).

    Raises:
        Skip: when the backend cannot run here, with the reason.
        ValueError: for an unknown name.
    """
    if name in MOK_BACKENDS:
        return MokRunner(name, experts, max_tokens, training_ring_rows, tile_rows)
    if name == "a2a-grouped-mm":
        return A2ARunner(experts)
    if name in megatron_layer.MEGATRON_BACKENDS:
        return MegatronRunner(name, experts, topk, megatron_experts)
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")


def parse_backends(text: str, device_type: str) -> Tuple[str, ...]:
    """``--backends`` value -> backend names in run order.

    "all" (every backend except the slow reference on a GPU; a2a-grouped-mm and reference on
    the CPU) or a comma-separated list of names from :data:`BACKENDS`.
    """
    if text.strip() == "all":
        return DEFAULT_GPU_BACKENDS if device_type == "cuda" else DEFAULT_CPU_BACKENDS
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"--backends {text!r}: unknown {unknown or 'empty list'}; choose 'all' or "
                         f"a comma-separated list of: {', '.join(BACKENDS)}")
    return tuple(n for n in BACKENDS if n in names)

