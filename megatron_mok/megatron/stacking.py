"""Zero-copy stacked expert weights: Megatron keeps one parameter per expert, ``mok_moe`` takes
one [L, ...] tensor.

:func:`stack_parameter_storage` (run when the MoK layer is built) moves the L per-expert
parameters into one contiguous [L, ...] buffer, each parameter's ``.data`` a view of its slice
(same parameter objects: names, attributes, values unchanged). :func:`expert_layout` checks, on
every forward and from pointers and strides only (no device work, no host sync), whether the
parameters still lie that way, and :func:`stack_experts` then returns the [L, ...] tensor as an
alias of their storage (:class:`_StackedView`: no copy forward, each parameter's gradient a
slice of the stacked gradient backward; the alias is not an autograd view, see there why).
Reverse order, as Megatron's distributed optimizer lays out ``TEGroupedMLP`` weights, is an
alias too (the layer renumbers the experts to match). Any other layout (parameters given
separate storage by code that replaces their ``.data``; Megatron's distributed optimizer
interleaving ``SequentialMLP``'s fc1 and fc2) falls back to ``torch.stack``, one copy, which is
correct in every layout. The alias saves that copy: 16.9 GB per layer forward at Kimi-K2's 192
experts per GPU, held until the backward.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .experts import local_expert_weights

__all__ = [
    "FORWARD", "REVERSED", "expert_layout", "stack_experts", "stacked", "stack_parameter_storage",
    "stack_expert_storage",
]

FORWARD = "forward"
"""Layout: weight i starts at base + i * size (the stacked [L, ...] order)."""
REVERSED = "reversed"
"""Layout: weight i starts at base + (L - 1 - i) * size (stacked, experts in reverse order, as
Megatron's distributed optimizer lays out ``TEGroupedMLP`` weights)."""


def expert_layout(weights: Sequence[torch.Tensor]) -> Optional[str]:
    """How the weights lie in memory, from pointers, shapes and strides (no device work).

    Returns:
        :data:`FORWARD` when they are, in order, equally spaced contiguous slices of one storage
        (weight i at ``weights[0].data_ptr() + i * nbytes``, so ``[L, ...]`` is a view of it);
        :data:`REVERSED` when the same holds in reverse order (weight i at slot L - 1 - i);
        ``None`` otherwise (different shapes, dtypes or devices, non-contiguous weights, gaps
        or other tensors between them, separate allocations that merely happen to be adjacent,
        tensor subclasses, meta or fake tensors). One weight is :data:`FORWARD`.
    """
    n = len(weights)
    if n == 0:
        return None
    first = weights[0]
    try:
        if torch.compiler.is_compiling() or first.device.type == "meta" or first.numel() == 0:
            return None
        shape, dtype = first.shape, first.dtype
        if not all(type(w) in _PLAIN_TENSOR_TYPES and w.dtype == dtype and w.shape == shape
                   and w.is_contiguous() for w in weights):
            return None
        step = first.numel() * first.element_size()
        ptrs = [w.data_ptr() for w in weights]
        start = ptrs[0]
        if ptrs == list(range(start, start + n * step, step)):
            layout, low = FORWARD, first
        elif ptrs == list(range(start, start - n * step, -step)):
            layout, low = REVERSED, weights[-1]
        else:
            return None
        # All n slices must lie inside ONE storage: the caching allocator may put separate
        # allocations next to each other, and a view may not reach outside its storage. (Inside
        # one storage also means on one device.)
        storage = low.untyped_storage()
        base = storage.data_ptr()
        if low.data_ptr() < base or low.data_ptr() + n * step > base + storage.nbytes():
            return None
    except (RuntimeError, NotImplementedError):  # tensors without storage (fake, functional)
        return None
    return layout


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _alias(first: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, *first.shape] tensor over ``first``'s storage that starts at ``first``: the memory
    of ``first.as_strided((n, ...))``, but a new tensor rather than a view (``set_`` on an empty
    tensor): no view metadata, its own version counter. No copy, no device work."""
    out = torch.empty((0,), dtype=first.dtype, device=first.device)
    out.set_(first.untyped_storage(), first.storage_offset(), (n, *first.shape),
             (first.numel(), *first.stride()))
    return out


class _StackedView(torch.autograd.Function):
    """[L, ...] alias of L weights that are stacked in storage (:data:`FORWARD` layout).

    Forward: a tensor over the first weight's storage spanning all L weights, no copy. It is
    NOT a view in autograd's eyes (:func:`_alias`) and has a version counter of its own, like a
    ``torch.stack`` result. It must not be a view: a view returned from a custom Function shares
    its base's version counter and carries ``CreationMeta.IN_CUSTOM_FUNCTION``, so any later
    bump of that counter makes every access to the view's ``grad_fn`` (e.g. unpacking it from
    another Function's ``ctx.saved_tensors``) raise "Output 0 of _StackedViewBackward is a view
    and its base ... has been modified inplace". The megakernel backend bumps it on every
    forward: ``mok::megakernel_forward`` is declared ``mutates_args="unknown"``, so the
    dispatcher's ADInplaceOrView kernel increments the version of every tensor argument, fc1
    and fc2 included, before ``_MegakernelMoE`` saves them; GPU training would fail in its first
    backward. With its own counter the alias behaves like a copy: such a bump happens before any
    consumer saves the tensor, and never reaches the parameters.

    Backward: weight i's gradient is slice i of the stacked gradient (a view, no copy), as
    ``torch.stack``'s backward gives. The weights are saved for backward only for autograd's
    version check: a weight modified in place (autograd-visibly) between forward and backward,
    which ``mok_moe`` read through the alias, raises the usual "modified by an inplace
    operation" error instead of giving silently wrong gradients. Writes through the alias itself
    are not tracked on the weights (as with any ``set_``/``data_ptr`` alias); ``mok_moe``
    backends only read their weights.
    """

    @staticmethod
    def forward(ctx, *weights):
        ctx.save_for_backward(*weights)
        return _alias(weights[0], len(weights))

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 (version check of every weight)
        return grad.unbind(0)


def stack_experts(weights: Sequence[torch.Tensor], layout: Optional[str], reverse: bool = False) -> torch.Tensor:
    """The weights as one differentiable [L, ...] tensor (in reverse order if ``reverse``).

    Args:
        weights: L same-shaped per-expert weights, expert 0 first.
        layout: :func:`expert_layout` of ``weights``.
        reverse: stack expert L - 1 first.

    Returns:
        A view of the weights' storage when ``layout`` is :data:`FORWARD` (or :data:`REVERSED`
        with ``reverse``), else ``torch.stack`` of them (a copy). Either way each weight gets
        its slice of the gradient.
    """
    ordered = list(weights)[::-1] if reverse else list(weights)
    if layout == (REVERSED if reverse else FORWARD):
        return _StackedView.apply(*ordered)
    return torch.stack(ordered)


def stacked(weights: List[torch.Tensor]) -> torch.Tensor:
    """[n, ...] stack of same-shaped weights, differentiable (each input gets its slice of the
    gradient): a view of their storage when they are stacked there, else a copy."""
    return stack_experts(weights, expert_layout(weights))


def stack_parameter_storage(params: Sequence[torch.nn.Parameter]) -> bool:
    """Move same-shaped parameters into one new contiguous [n, ...] buffer, in order.

    Each parameter stays the same ``nn.Parameter`` object (name, shape, dtype, value,
    ``requires_grad`` and every attribute Megatron set on it unchanged); only its ``.data``
    becomes slice i of the buffer, so :func:`expert_layout` finds :data:`FORWARD`. Needs one
    buffer's worth of extra memory while it runs (the old storages are released as the
    parameters move).

    Returns:
        True if the parameters were moved; False if there was nothing to do (fewer than two,
        already stacked) or they cannot share a buffer (different shapes, dtypes or devices,
        tensor subclasses such as quantized weights).
    """
    params = list(params)
    if len(params) < 2:
        return False
    first = params[0]
    for p in params:
        if (type(p.data) is not torch.Tensor or p.shape != first.shape or p.dtype != first.dtype
                or p.device != first.device):
            return False
    if expert_layout(params) == FORWARD:
        return False
    buffer = torch.empty((len(params), *first.shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for i, p in enumerate(params):
            if buffer.device.type != "meta":
                buffer[i].copy_(p.data)
            p.data = buffer[i]
    return True


def stack_expert_storage(experts, num_local_experts: int) -> bool:
    """:func:`stack_parameter_storage` for the fc1 weights and for the fc2 weights of a Megatron
    expert module (one [L, 2I, H] and one [L, H, I] buffer). An expert module whose layout MoK
    does not know is left alone (the forward reports it). Returns whether anything moved."""
    try:
        fc1, fc2 = local_expert_weights(experts, num_local_experts)
    except TypeError:
        return False
    moved1 = stack_parameter_storage(fc1)
    moved2 = stack_parameter_storage(fc2)
    return moved1 or moved2
