"""Input checks for :func:`megatron_mok.functional.mok_moe`, run before any GPU work.

Everything here reads shapes, dtypes and devices only, never tensor values, so it costs no
host-device synchronisation. The one value check, expert ids in range, is done by the
reference backend on the host and by the CUDA backends on the device (the schedule kernel
records bad ids in the workspace's status word; see ``megatron_mok.functional.status``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("auto", "reference", "cuda", "megakernel")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class MoKInputError(ValueError):
    """An argument of ``mok_moe`` has a shape, dtype, device or value that is not supported."""


@dataclass(frozen=True)
class MoEShape:
    """The sizes of one ``mok_moe`` call, read off its arguments.

    T tokens on this rank, H hidden, K top-k, L experts on this rank, I expert FFN size.
    """

    tokens: int
    hidden: int
    topk: int
    experts_per_rank: int
    ffn_hidden: int


def check_backend_name(backend: str) -> None:
    """Raise :class:`MoKInputError` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise MoKInputError(f"backend={backend!r} is not one of {BACKENDS}")


def check_inputs(x, topk_ids, topk_weights, fc1_weight, fc2_weight) -> MoEShape:
    """Check the arguments of ``mok_moe`` against the contract and return their sizes.

    Args:
        x: [T, H] floating tokens.
        topk_ids: [T, K] int64 global expert ids.
        topk_weights: [T, K] float32 (float64 allowed when x is float64) router weights.
        fc1_weight: [L, 2I, H] in x's dtype; fc2_weight: [L, H, I] in x's dtype.

    Raises:
        MoKInputError: naming the argument, what it is and what is supported.
    """
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if not isinstance(t, torch.Tensor):
            raise MoKInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _expect_dims("x", x, 2, "[T, H]")
    _expect_dims("topk_ids", topk_ids, 2, "[T, K]")
    _expect_dims("topk_weights", topk_weights, 2, "[T, K]")
    _expect_dims("fc1_weight", fc1_weight, 3, "[E/P, 2I, H]")
    _expect_dims("fc2_weight", fc2_weight, 3, "[E/P, H, I]")

    if x.dtype not in FLOAT_DTYPES:
        raise MoKInputError(f"x has dtype {x.dtype}; supported: {FLOAT_DTYPES}")
    if topk_ids.dtype != torch.int64:
        raise MoKInputError(f"topk_ids has dtype {topk_ids.dtype}; it must be torch.int64")
    allowed_w = (torch.float32, torch.float64) if x.dtype == torch.float64 else (torch.float32,)
    if topk_weights.dtype not in allowed_w:
        raise MoKInputError(
            f"topk_weights has dtype {topk_weights.dtype}; it must be torch.float32"
            + (" or torch.float64" if x.dtype == torch.float64 else "")
        )
    for name, w in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if w.dtype != x.dtype:
            raise MoKInputError(f"{name} has dtype {w.dtype} but x has {x.dtype}; they must match")

    tokens, hidden = x.shape
    if topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise MoKInputError(
            f"x is {tuple(x.shape)} but topk_ids is {tuple(topk_ids.shape)} and topk_weights is "
            f"{tuple(topk_weights.shape)}; both must be [T, K] with T = {tokens}"
        )
    topk = topk_ids.shape[1]
    if topk < 1:
        raise MoKInputError(f"top-k is {topk}; it must be at least 1")
    experts, two_i, h1 = fc1_weight.shape
    if experts < 1:
        raise MoKInputError("fc1_weight holds no experts (shape[0] == 0)")
    if h1 != hidden or two_i % 2 or two_i == 0:
        raise MoKInputError(
            f"fc1_weight is {tuple(fc1_weight.shape)}; it must be [E/P, 2I, H] with H = {hidden} "
            "and an even, non-zero 2I (gate rows then up rows)"
        )
    inter = two_i // 2
    if tuple(fc2_weight.shape) != (experts, hidden, inter):
        raise MoKInputError(
            f"fc2_weight is {tuple(fc2_weight.shape)}; it must be [E/P, H, I] = "
            f"{(experts, hidden, inter)} to match fc1_weight {tuple(fc1_weight.shape)}"
        )
    devices = {t.device for t in (x, topk_ids, topk_weights, fc1_weight, fc2_weight)}
    if len(devices) != 1:
        raise MoKInputError(f"all arguments must be on one device, got {sorted(map(str, devices))}")
    return MoEShape(tokens=tokens, hidden=hidden, topk=topk, experts_per_rank=experts, ffn_hidden=inter)


def check_expert_ids_on_host(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise :class:`MoKInputError` if any id is outside [-1, num_experts). Reads the values
    (a host sync on GPU tensors), so only the reference backend calls it."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise MoKInputError(
            f"topk_ids holds expert id {bad}; ids must lie in [0, {num_experts}) "
            f"(E = experts per rank x EP size), or be -1 for an unused slot"
        )


def _expect_dims(name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise MoKInputError(f"{name} has shape {tuple(t.shape)}; it must be {dims}-D {layout}")
