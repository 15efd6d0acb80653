"""The expert weights of Megatron's expert modules, in the layout ``mok_moe`` takes.

The MoK layer keeps Megatron's own expert module (``SequentialMLP`` from the local spec,
``TEGroupedMLP`` from the Transformer Engine spec) and its shared-expert module, so parameter
names, shapes, initialisation, the expert-data-parallel gradient buffer and
``sharded_state_dict`` are Megatron's. Every forward reads their weights through the functions
here: per-expert [2I, H] fc1 and [H, I] fc2 tensors as one [L, 2I, H] and one [L, H, I] tensor.

Zero-copy stacking: Megatron keeps one parameter per expert, ``mok_moe`` takes one stacked
tensor. :func:`stack_parameter_storage` (run when the MoK layer is built) moves the L per-expert
parameters into one contiguous [L, ...] buffer, each parameter's ``.data`` a view of its slice
(same parameter objects: names, attributes, values unchanged). :func:`expert_layout` checks, on
every forward and from pointers and strides only (no device work, no host sync), whether the
parameters still lie that way, and :func:`stack_experts` then returns the [L, ...] tensor as an
alias of their storage (:class:`_StackedView`: no copy forward, each parameter's gradient a
slice of the stacked gradient backward; the alias is not an autograd view, see there why).
Reverse order, as Megatron's distributed optimizer lays out ``TEGroupedMLP`` weights, is an
alias too (the layer renumbers the experts to match). Any other
layout (parameters given separate storage by code that replaces their ``.data``; Megatron's
distributed optimizer interleaving ``SequentialMLP``'s fc1 and fc2) falls back to
``torch.stack``, one copy, which is correct in every layout.
"""

from __future__ import annotations

import os

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "ZERO_COPY_ENV",
    "zero_copy_enabled",
    "run_forward_pre_hooks",
    "FORWARD", "REVERSED", "expert_layout", "local_expert_weights", "shared_expert_weights",
    "stack_expert_storage", "stack_experts", "stack_parameter_storage", "stacked",
]

FORWARD = "forward"
"""Layout: weight i starts at base + i * size (the stacked [L, ...] order)."""
REVERSED = "reversed"
"""Layout: weight i starts at base + (L - 1 - i) * size (stacked, experts in reverse order, as
Megatron's distributed optimizer lays out ``TEGroupedMLP`` weights)."""


def _sequential_weights(experts) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    fc1 = [expert.linear_fc1.weight for expert in experts.local_experts]
    fc2 = [expert.linear_fc2.weight for expert in experts.local_experts]
    return fc1, fc2


def _grouped_weights(experts, num_local_experts: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    fc1 = [getattr(experts.linear_fc1, f"weight{i}") for i in range(num_local_experts)]
    fc2 = [getattr(experts.linear_fc2, f"weight{i}") for i in range(num_local_experts)]
    return fc1, fc2


def local_expert_weights(experts, num_local_experts: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The fc1 and fc2 weights of each local expert of a Megatron expert module.

    Args:
        experts: a ``SequentialMLP`` (``local_experts.{i}.linear_fc{1,2}.weight``) or a
            ``TEGroupedMLP`` (``linear_fc{1,2}.weight{i}``).
        num_local_experts: L.

    Returns:
        (fc1, fc2): lists of L tensors, fc1[i] [2I, H] (gate rows then up rows), fc2[i] [H, I].

    Raises:
        TypeError: for an expert module whose weight layout MoK does not know.
    """
    if hasattr(experts, "local_experts"):
        fc1, fc2 = _sequential_weights(experts)
    elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):
        fc1, fc2 = _grouped_weights(experts, num_local_experts)
    else:
        raise TypeError(
            f"the MoK layer reads expert weights from SequentialMLP (local spec) or TEGroupedMLP "
            f"(Transformer Engine spec); {type(experts).__name__} has neither layout"
        )
    if len(fc1) != num_local_experts:
        raise TypeError(f"{type(experts).__name__} holds {len(fc1)} experts, expected {num_local_experts}")
    return fc1, fc2


def shared_expert_weights(shared, expert_ffn: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """A shared expert of intermediate size S = n * I, split into n experts of size I.

    SwiGLU is a sum over its intermediate channels, so the shared expert equals the sum of n
    experts: expert k takes gate rows k*I..(k+1)*I and up rows S+k*I..S+(k+1)*I of fc1 and
    columns k*I..(k+1)*I of fc2.

    Args:
        shared: Megatron's ``SharedExpertMLP`` (tensor-parallel size 1): ``linear_fc1.weight``
            [2S, H], ``linear_fc2.weight`` [H, S].
        expert_ffn: I, the routed experts' FFN size.

    Returns:
        (fc1, fc2): lists of n tensors, fc1[k] [2I, H], fc2[k] [H, I]. For n = 1 the parameters
        themselves (no copy); for n > 1 fc1[k] is a copy (its gate and up rows are not adjacent
        in the parameter) and fc2[k] a column slice.
    """
    w1 = shared.linear_fc1.weight
    w2 = shared.linear_fc2.weight
    size = w1.shape[0] // 2
    if size % expert_ffn:
        raise ValueError(f"shared-expert size {size} is not a multiple of the expert FFN size {expert_ffn}")
    n = size // expert_ffn
    if n == 1:
        return [w1], [w2]
    gate, up = w1[:size], w1[size:]
    fc1 = [torch.cat([gate[k * expert_ffn:(k + 1) * expert_ffn], up[k * expert_ffn:(k + 1) * expert_ffn]])
           for k in range(n)]
    fc2 = [w2[:, k * expert_ffn:(k + 1) * expert_ffn] for k in range(n)]
    return fc1, fc2


# ----------------------------------------------------------------------------------------------
# Zero-copy stacking.


ZERO_COPY_ENV = "MOK_ZERO_COPY_EXPERT_WEIGHTS"
"""On unless set to "0": the layer passes an alias of the stacked expert parameters' storage
instead of a ``torch.stack`` copy (16.9 GB per layer forward at Kimi-K2's 192 experts per GPU).
Validated on H200s with both GPU backends (docs/megatron.md, "Known costs and limits"): proxy
DeepSeek-V3 at EP = 2 with ``--mok-backend megakernel`` and on one GPU with ``auto`` (the
``cuda`` backend), 50 iterations each, loss curves agreeing with ``alltoall``. History: the
first version (an autograd view made in a custom Function) failed in the first backward of GPU
training, because ``mok::megakernel_forward`` (``mutates_args="unknown"``) bumped the version
of its weight arguments; the non-view alias of :class:`_StackedView` fixed it."""


def zero_copy_enabled() -> bool:
    """Whether zero-copy expert weights are on (``MOK_ZERO_COPY_EXPERT_WEIGHTS`` is not "0")."""
    return os.environ.get(ZERO_COPY_ENV, "1") != "0"


def run_forward_pre_hooks(module: torch.nn.Module) -> None:
    """Run the forward pre-hooks of ``module`` and of its submodules, whose ``forward`` the MoK
    layer never calls (it reads their weights). Megatron's DistributedDataParallel with
    ``--overlap-param-gather`` depends on them: the hook of a module waits for the all-gather of
    that module's parameters (and dispatches the next bucket's); without it the experts would
    be read while their all-gather may still be running, or never issued.

    Hooks are called as if the module had been called with no inputs: ``hook(m, ())``, or
    ``hook(m, (), {})`` for hooks registered ``with_kwargs``; what they return is ignored.
    Global hooks (``register_module_forward_pre_hook``) are not called.
    """
    for m in module.modules():
        hooks = m._forward_pre_hooks
        if not hooks:
            continue
        with_kwargs = m._forward_pre_hooks_with_kwargs
        for hook_id, hook in list(hooks.items()):
            if hook_id in with_kwargs:
                hook(m, (), {})
            else:
                hook(m, ())


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
    deliberately NOT a view in autograd's eyes (:func:`_alias`), and has a version counter of
    its own, exactly like the ``torch.stack`` result it replaces. A view returned from a custom
    Function shares its base's version counter and carries ``CreationMeta.IN_CUSTOM_FUNCTION``;
    any later bump of that counter makes every access to the view's ``grad_fn`` (e.g. unpacking
    it from another Function's ``ctx.saved_tensors``) raise "Output 0 of _StackedViewBackward is
    a view and its base ... has been modified inplace". The megakernel backend bumps it on every
    forward: ``mok::megakernel_forward`` is declared ``mutates_args="unknown"``, so the
    dispatcher's ADInplaceOrView kernel increments the version of every tensor argument, fc1
    and fc2 included, before ``_MegakernelMoE`` saves them (that was the first-backward failure
    of GPU training). With its own counter the alias behaves like the copy: such a bump happens
    before any consumer saves the tensor, and never reaches the parameters.

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
