"""Input checks for :func:`megatron_mok.functional.mok_moe`, run before any GPU work.

Everything here reads shapes, dtypes, layouts and devices only, never tensor values, so it costs
no host-device synchronisation. The one value check, expert ids in range, is not an input check:
a bad id makes the call's output NaN on every rank and the next call raise, on every backend
(docs/contract.md, "Errors"; the schedule kernel records it on the GPU, the reference backend
on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("auto", "reference", "cuda", "megakernel")
MAX_WEIGHT_SEGMENTS = 2
"""fc1_weight / fc2_weight may each be a sequence of up to this many tensors (weight segments)."""
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


MAX_ROUTES = 2 ** 31 - 1
"""T * K of one rank must fit int32: the schedule table and the kernels index routes with int32."""


def check_backend_name(backend: str) -> None:
    """Raise :class:`MoKInputError` unless ``backend`` is one of :data:`BACKENDS`."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        kind = "" if isinstance(backend, str) else f" ({type(backend).__name__})"
        raise MoKInputError(f"backend={backend!r}{kind} is not one of {BACKENDS}")


def weight_segments(name: str, weight) -> tuple:
    """``weight`` (a tensor, or a tuple or list of 1 to :data:`MAX_WEIGHT_SEGMENTS` tensors) as a
    tuple of tensors; no checks of their shapes (see :func:`check_inputs`)."""
    if isinstance(weight, torch.Tensor):
        return (weight,)
    if isinstance(weight, (tuple, list)) and 1 <= len(weight) <= MAX_WEIGHT_SEGMENTS:
        for i, t in enumerate(weight):
            if not isinstance(t, torch.Tensor):
                raise MoKInputError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        return tuple(weight)
    raise MoKInputError(
        f"{name} must be a torch.Tensor or a tuple of 1 to {MAX_WEIGHT_SEGMENTS} tensors (weight segments), "
        f"got {type(weight).__name__}" + (f" of length {len(weight)}" if isinstance(weight, (tuple, list)) else ""))


def check_inputs(x, topk_ids, topk_weights, fc1_weight, fc2_weight) -> MoEShape:
    """Check the arguments of ``mok_moe`` against the contract and return their sizes.

    Args:
        x: [T, H] floating tokens.
        topk_ids: [T, K] int64 global expert ids.
        topk_weights: [T, K] float32 (float64 allowed when x is float64) router weights.
        fc1_weight: [L, 2I, H] in x's dtype; fc2_weight: [L, H, I] in x's dtype. Either may be a
            tuple of weight segments ([L_1, 2I, H], [L_2, 2I, H]; L = L_1 + L_2), the other then
            a tuple of the same length with the same L_i.

    Raises:
        MoKInputError: naming the argument, what it is and what is supported.
    """
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise MoKInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}"
                                + ("" if t is None else " (convert it with torch.as_tensor)"))
    fc1s, fc2s = weight_segments("fc1_weight", fc1_weight), weight_segments("fc2_weight", fc2_weight)
    if len(fc1s) != len(fc2s):
        raise MoKInputError(f"fc1_weight has {len(fc1s)} weight segments and fc2_weight {len(fc2s)}; "
                            "they must have the same number")
    named1 = [("fc1_weight" if len(fc1s) == 1 else f"fc1_weight[{i}]", w) for i, w in enumerate(fc1s)]
    named2 = [("fc2_weight" if len(fc2s) == 1 else f"fc2_weight[{i}]", w) for i, w in enumerate(fc2s)]
    for name, t in [("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)] + named1 + named2:
        if t.layout != torch.strided:
            raise MoKInputError(f"{name} has layout {t.layout}; MoK takes dense tensors (torch.strided): "
                                "convert it with .to_dense()")
    _expect_dims("x", x, 2, "[T, H]")
    _expect_dims("topk_ids", topk_ids, 2, "[T, K]")
    _expect_dims("topk_weights", topk_weights, 2, "[T, K]")
    for name, w in named1:
        _expect_dims(name, w, 3, "[E/P, 2I, H]")
    for name, w in named2:
        _expect_dims(name, w, 3, "[E/P, H, I]")

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
    for name, w in named1 + named2:
        if w.dtype != x.dtype:
            raise MoKInputError(f"{name} has dtype {w.dtype} but x has {x.dtype}; they must match")

    tokens, hidden = x.shape
    if hidden < 1:
        raise MoKInputError(f"x has shape {tuple(x.shape)}; the hidden size H (its second dimension) must be at "
                            "least 1")
    if topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise MoKInputError(
            f"x is {tuple(x.shape)} but topk_ids is {tuple(topk_ids.shape)} and topk_weights is "
            f"{tuple(topk_weights.shape)}; both must be [T, K] with T = {tokens}"
        )
    topk = topk_ids.shape[1]
    if topk < 1:
        raise MoKInputError(f"top-k is {topk} (topk_ids is {tuple(topk_ids.shape)}); it must be at least 1")
    if tokens * topk > MAX_ROUTES:
        raise MoKInputError(f"this call has {tokens} tokens x top-k {topk} = {tokens * topk} routes on this rank; "
                            f"MoK indexes routes with int32 (at most {MAX_ROUTES}): split the call")
    two_i = fc1s[0].shape[1]
    experts = 0
    for (name1, w1), (name2, w2) in zip(named1, named2):
        count, two_i1, h1 = w1.shape
        if count < 1:
            raise MoKInputError(f"{name1} holds no experts (shape[0] == 0)")
        if h1 != hidden or two_i1 % 2 or two_i1 == 0 or two_i1 != two_i:
            raise MoKInputError(
                f"{name1} is {tuple(w1.shape)}; it must be [E/P, 2I, H] with H = {hidden} "
                "and an even, non-zero 2I (gate rows then up rows)"
                + ("" if len(named1) == 1 else f", the same 2I = {two_i} in every segment")
            )
        if tuple(w2.shape) != (count, hidden, two_i // 2):
            raise MoKInputError(
                f"{name2} is {tuple(w2.shape)}; it must be [E/P, H, I] = "
                f"{(count, hidden, two_i // 2)} to match {name1} {tuple(w1.shape)}"
            )
        experts += count
    inter = two_i // 2
    devices = {t.device for t in (x, topk_ids, topk_weights, *fc1s, *fc2s)}
    if len(devices) != 1:
        raise MoKInputError(f"all arguments must be on one device, got {sorted(map(str, devices))}")
    if x.device.type == "meta":
        raise MoKInputError("the arguments are on the meta device, which holds no data; mok_moe computes on "
                            "the CPU (reference backend) or on CUDA devices")
    return MoEShape(tokens=tokens, hidden=hidden, topk=topk, experts_per_rank=experts, ffn_hidden=inter)


def _expect_dims(name: str, t: torch.Tensor, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise MoKInputError(f"{name} has shape {tuple(t.shape)}; it must be {dims}-D {layout}")
