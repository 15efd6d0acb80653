"""Expert weights reach ``mok_moe`` without a copy when they lie stacked in memory.

The MoK layer moves each expert module's per-expert parameters into one [L, 2I, H] and one
[L, H, I] buffer when it is built (``stacking.stack_expert_storage``); every forward checks the
layout from pointers and strides (``expert_layout``) and passes an alias of that storage
(``stack_experts``), falling back to ``torch.stack`` for any other layout. These tests check
that the alias shares storage with the parameters, that outputs and gradients equal those of
copied weights (SequentialMLP through the whole layer and Megatron's training step, a grouped
``weight{i}`` layout through ``mok_moe``), the fallbacks, the reverse order Megatron's
distributed optimizer produces, and that parameters keep their names, values and attributes.
"""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megatron_mok.functional import mok_moe
from megatron_mok.megatron.experts import local_expert_weights
from megatron_mok.megatron.stacking import (
    FORWARD,
    REVERSED,
    expert_layout,
    stack_expert_storage,
    stack_experts,
    stack_parameter_storage,
    stacked,
)
from megatron_mok.megatron.routing import reverse_local_expert_ids
from tests.megatron.megatron_utils import (
    batch, build_gpt, loss_and_grads, megatron_ranks, megatron_train_steps, moe_layers, tiny_config,
)

L, I, H, T, K = 4, 8, 16, 12, 2


def _params(n=L, shape=(2 * I, H), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64)) for _ in range(n)]


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------------------
# Unit level: layout detection, the view, its gradients, the fallbacks.


def test_stacking_keeps_parameter_objects_values_and_attributes():
    params = _params()
    params[1].requires_grad_(False)
    for i, p in enumerate(params):
        p.allreduce, p.sequence_parallel, p.tensor_model_parallel, p.partition_dim = False, False, True, 0
        p._megatron_private = ("expert", i)
    values = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    attrs = [dict(vars(p)) for p in params]
    assert expert_layout(params) is None  # separate allocations
    assert stack_parameter_storage(params)
    assert expert_layout(params) == FORWARD
    assert [id(p) for p in params] == ids
    assert [dict(vars(p)) for p in params] == attrs
    assert [p.requires_grad for p in params] == [True, False, True, True]
    assert all(type(p) is torch.nn.Parameter and p.is_leaf and p._base is None for p in params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert len({_storage_ptr(p) for p in params}) == 1
    assert not stack_parameter_storage(params)  # already stacked: nothing to do


def test_view_shares_storage_and_gradients_equal_torch_stack():
    params = _params()
    stack_parameter_storage(params)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    view = stacked(params)
    want = torch.stack(copies)
    assert view.data_ptr() == params[0].data_ptr() and _storage_ptr(view) == _storage_ptr(params[0])
    assert view.shape == (L, 2 * I, H) and view.is_contiguous()
    assert torch.equal(view, want)
    grad = torch.randn_like(want)
    view.backward(grad)
    want.backward(grad)
    for p, c in zip(params, copies):
        assert torch.equal(p.grad, c.grad)
    # Each gradient is a slice of the stacked gradient (no copy), as with torch.stack.
    assert all(_storage_ptr(p.grad) == _storage_ptr(params[0].grad) for p in params)
    # An alias of the storage, not an autograd view (a view made in a custom Function breaks
    # under version bumps; see test_alias_survives_ops_that_declare_their_inputs_mutated).
    alias = stacked(params)
    assert not alias._is_view() and alias._base is None and alias.data_ptr() == params[0].data_ptr()


@torch.library.custom_op("mok_tests::reads_expert_weights", mutates_args="unknown")
def _reads_expert_weights(fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """Reads the weights; declared like ``mok::megakernel_forward`` (``mutates_args="unknown"``),
    so the dispatcher bumps the version counter of both arguments on every call."""
    return fc1.sum() + fc2.sum()


class _SavesWeightsLikeTheGpuBackends(torch.autograd.Function):
    """Identity on x that, like ``_MegakernelMoE``, passes fc1/fc2 to an op declared
    ``mutates_args="unknown"`` and then keeps them with ``ctx.save_for_backward``."""

    @staticmethod
    def forward(ctx, x, fc1, fc2):
        _reads_expert_weights(fc1, fc2)
        ctx.save_for_backward(fc1, fc2)
        return x.clone()

    @staticmethod
    def backward(ctx, dx):
        ctx.saved_tensors  # noqa: B018 (where a view's version mismatch would raise)
        return dx, None, None


def test_alias_survives_ops_that_declare_their_inputs_mutated():
    """What the megakernel backend does to its weights, in miniature: the stacked weights go
    through an op whose schema marks them mutable (the version counter is bumped) and are then
    saved for backward. An autograd view of the parameters would raise in the backward."""
    w1, w2 = _params(), _params(shape=(H, I), seed=1)
    stack_parameter_storage(w1)
    stack_parameter_storage(w2)
    c1, c2 = [[torch.nn.Parameter(p.detach().clone()) for p in ws] for ws in (w1, w2)]
    versions = [p._version for p in w1 + w2]
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    grads = []
    for ws1, ws2, stack in ((w1, w2, stacked), (c1, c2, torch.stack)):
        fc1, fc2 = stack(ws1), stack(ws2)
        y = _SavesWeightsLikeTheGpuBackends.apply(x, fc1, fc2)
        out = torch.einsum("th,lih->tli", y, fc1).sum() + torch.einsum("lhi,th->tli", fc2, y).square().sum()
        out.backward()
        grads.append([p.grad for p in ws1 + ws2])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert [p._version for p in w1 + w2] == versions  # the bump stays on the alias


def test_weight_modified_in_place_between_forward_and_backward_raises():
    params = _params()
    stack_parameter_storage(params)
    out = (stacked(params) * 2).sum()
    with torch.no_grad():
        params[3].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_reversed_layout_gives_reversed_view():
    params = _params()
    buffer = torch.stack([p.detach() for p in params[::-1]])
    for i, p in enumerate(params):
        p.data = buffer[L - 1 - i]
    assert expert_layout(params) == REVERSED
    view = stack_experts(params, REVERSED, reverse=True)
    assert view.data_ptr() == buffer.data_ptr() and torch.equal(view, buffer)
    assert torch.equal(stack_experts(params, REVERSED), torch.stack(params))  # forward order: a copy
    assert stack_experts(params, REVERSED).data_ptr() != buffer.data_ptr()
    grad = torch.randn_like(buffer)
    view.backward(grad)
    for i, p in enumerate(params):
        assert torch.equal(p.grad, grad[L - 1 - i])


def _strided_slices(n, stride_rows):
    """n [2I, H] tensors at equal spacing ``stride_rows`` rows apart in one buffer."""
    buffer = torch.randn(n * stride_rows, H, dtype=torch.float64)
    return [buffer[i * stride_rows:i * stride_rows + 2 * I] for i in range(n)]


@pytest.mark.parametrize("case", ["separate", "gaps", "permuted", "transposed", "shapes", "dtypes",
                                  "adjacent_storages", "meta"])
def test_fallback_to_torch_stack_when_not_stacked(case):
    if case == "separate":
        weights = [p.detach() for p in _params()]
    elif case == "gaps":  # equally spaced, other data between them (as Megatron's DDP interleaves fc1/fc2)
        weights = _strided_slices(L, 3 * I)
    elif case == "permuted":
        weights = list(torch.randn(L, 2 * I, H, dtype=torch.float64).unbind(0))
        weights[1], weights[2] = weights[2], weights[1]
    elif case == "transposed":
        weights = list(torch.randn(L, H, 2 * I, dtype=torch.float64).transpose(1, 2).unbind(0))
    elif case == "shapes":
        buffer = torch.randn(L * 2 * I * H, dtype=torch.float64)
        weights = [buffer[i * 2 * I * H:(i + 1) * 2 * I * H].view(2 * I, H) for i in range(L - 1)]
        weights.append(buffer[(L - 1) * 2 * I * H:].view(4 * I, H // 2))
    elif case == "dtypes":
        weights = list(torch.randn(L, 2 * I, H, dtype=torch.float64).unbind(0))
        weights[-1] = weights[-1].view(torch.int64)
    elif case == "adjacent_storages":  # right spacing, but L separate storages: no view may span them
        nbytes = 2 * I * H * 8
        raw = bytearray(torch.randn(L * 2 * I * H, dtype=torch.float64).numpy().tobytes())
        weights = [torch.frombuffer(raw, dtype=torch.float64, count=2 * I * H, offset=i * nbytes).view(2 * I, H)
                   for i in range(L)]
        assert [w.data_ptr() - weights[0].data_ptr() for w in weights] == [i * nbytes for i in range(L)]
    else:
        weights = list(torch.empty(L, 2 * I, H, device="meta").unbind(0))
    assert expert_layout(weights) is None
    if case in ("shapes", "dtypes", "meta"):
        return
    out = stacked(weights)
    assert torch.equal(out, torch.stack(weights))
    assert not any(_storage_ptr(out) == _storage_ptr(w) for w in weights)


def test_a_single_expert_and_unbind_are_stacked():
    weights = list(torch.randn(L, 2 * I, H).unbind(0))
    assert expert_layout(weights) == FORWARD and expert_layout(weights[:1]) == FORWARD
    assert stacked(weights[2:3]).data_ptr() == weights[2].data_ptr()


# ----------------------------------------------------------------------------------------------
# Through mok_moe: a grouped (TEGroupedMLP-style ``linear_fc{1,2}.weight{i}``) expert module.


def _grouped_module(seed=3):
    gen = torch.Generator().manual_seed(seed)
    fc1 = SimpleNamespace(**{f"weight{i}": torch.nn.Parameter(0.2 * torch.randn(2 * I, H, generator=gen,
                                                                                dtype=torch.float64))
                             for i in range(L)})
    fc2 = SimpleNamespace(**{f"weight{i}": torch.nn.Parameter(0.2 * torch.randn(H, I, generator=gen,
                                                                                dtype=torch.float64))
                             for i in range(L)})
    return SimpleNamespace(linear_fc1=fc1, linear_fc2=fc2)


def _routing(seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(L, generator=gen)[:K] for _ in range(T)]).sort(1).values
    ids[0, 1] = -1
    weights = torch.rand(T, K, generator=gen, dtype=torch.float64)
    return x, ids, weights


def _moe_grads(module, reverse=False):
    """Output and gradients (x, router weights, every expert weight) of mok_moe on the module's
    weights, stacked by stack_experts (a view when the layout allows)."""
    x, ids, weights = _routing()
    x.requires_grad_(True)
    weights.requires_grad_(True)
    fc1, fc2 = local_expert_weights(module, L)
    for w in fc1 + fc2:
        w.grad = None
    w1 = stack_experts(fc1, expert_layout(fc1), reverse)
    w2 = stack_experts(fc2, expert_layout(fc2), reverse)
    y = mok_moe(x, reverse_local_expert_ids(ids, L) if reverse else ids, weights, w1, w2, backend="reference")
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
    grads = [x.grad, weights.grad] + [w.grad for w in fc1 + fc2]
    return y.detach(), grads, (w1, w2)


def test_grouped_layout_view_matches_torch_stack_through_mok_moe():
    scattered = _grouped_module()
    want_y, want_grads, (w1, w2) = _moe_grads(scattered)
    fc1, fc2 = local_expert_weights(scattered, L)
    assert expert_layout(fc1) is None and not any(_storage_ptr(w1) == _storage_ptr(w) for w in fc1)

    module = _grouped_module()
    assert stack_expert_storage(module, L)
    fc1, fc2 = local_expert_weights(module, L)
    assert expert_layout(fc1) == FORWARD and expert_layout(fc2) == FORWARD
    y, grads, (w1, w2) = _moe_grads(module)
    assert w1.data_ptr() == fc1[0].data_ptr() and w2.data_ptr() == fc2[0].data_ptr()
    assert torch.equal(y, want_y)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)

    # Reverse order (Megatron's distributed optimizer): stacked backwards, ids renumbered.
    for ws in (fc1, fc2):
        buffer = torch.stack([w.detach() for w in ws[::-1]])
        for i, w in enumerate(ws):
            w.data = buffer[L - 1 - i]
    assert expert_layout(fc1) == REVERSED and expert_layout(fc2) == REVERSED
    y, grads, (w1, w2) = _moe_grads(module, reverse=True)
    assert w1.data_ptr() == fc1[-1].data_ptr() and w2.data_ptr() == fc2[-1].data_ptr()
    assert torch.equal(y, want_y)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


def test_reverse_local_expert_ids():
    ids = torch.tensor([[0, 3, -1], [4, 6, 7]])
    assert reverse_local_expert_ids(ids, 4).tolist() == [[3, 0, -1], [7, 5, 4]]
    assert torch.equal(reverse_local_expert_ids(reverse_local_expert_ids(ids, 4), 4), ids)


# ----------------------------------------------------------------------------------------------
# The MoK layer (SequentialMLP, local spec) on gloo ranks.


def _settings():
    from megatron_mok.megatron import MoKLayerSettings

    return MoKLayerSettings(backend="reference")


def _expert_lists(layer):
    return local_expert_weights(layer.experts, layer.num_local_experts)


def _scatter(layer):
    """Give every expert parameter its own storage (a layout the layer can only copy)."""
    for w in sum(_expert_lists(layer), []):
        w.data = w.data.clone()


def _reverse(layer):
    """Lay the expert parameters out in reverse order, as Megatron's distributed optimizer does
    for TEGroupedMLP."""
    for ws in _expert_lists(layer):
        buffer = torch.stack([w.detach() for w in ws[::-1]])
        for i, w in enumerate(ws):
            w.data = buffer[len(ws) - 1 - i]


def _recording_mok_moe(calls):
    import megatron_mok.megatron.layer as layer_module

    real = layer_module.mok_moe

    def wrapper(x, topk_ids, topk_weights, fc1, fc2, **kwargs):
        calls.append((fc1, fc2, topk_ids))
        return real(x, topk_ids, topk_weights, fc1, fc2, **kwargs)

    return mock.patch.object(layer_module, "mok_moe", wrapper)


def _copied(weights):
    """One [n, ...] copy of a weight tensor or of a tuple of weight segments (differentiable)."""
    return torch.cat(list(weights) if isinstance(weights, tuple) else [weights])


def _copying_mok_moe():
    """The reference for zero-copy: ``mok_moe`` handed one copy of all the layer's weights,
    segments concatenated, instead of the aliases and segments the layer passes."""
    import megatron_mok.megatron.layer as layer_module

    real = layer_module.mok_moe

    def wrapper(x, topk_ids, topk_weights, fc1, fc2, **kwargs):
        return real(x, topk_ids, topk_weights, _copied(fc1), _copied(fc2), **kwargs)

    return mock.patch.object(layer_module, "mok_moe", wrapper)


def _layer_zero_copy(rank, world, variant):
    import megatron_mok

    megatron_mok.register()
    config = tiny_config("mok", world, mok_settings=_settings())
    stock = build_gpt(tiny_config("alltoall", world), seed=5)
    model = build_gpt(config, seed=5)
    assert model.state_dict().keys() == stock.state_dict().keys()
    for (name, p), (stock_name, q) in zip(model.named_parameters(), stock.named_parameters()):
        assert name == stock_name and p.shape == q.shape and p.dtype == q.dtype
        assert p.requires_grad == q.requires_grad and sorted(vars(p)) == sorted(vars(q)), name
        assert all(getattr(p, a) == getattr(q, a) for a in vars(q) if not torch.is_tensor(getattr(q, a))), name
        if ".experts." in name:  # the same initial values as Megatron's layer (same seed)
            assert torch.equal(p, q), name
    layers = [m for _, m in moe_layers(model)]
    for layer in layers:
        assert [expert_layout(ws) for ws in _expert_lists(layer)] == [FORWARD, FORWARD]

    reference = build_gpt(config, seed=6)
    reference.load_state_dict(model.state_dict(), strict=True)
    for _, layer in moe_layers(reference):
        _scatter(layer)
        assert [expert_layout(ws) for ws in _expert_lists(layer)] == [None, None]
    want_loss, want_grads = loss_and_grads(reference, rank)

    if variant == "reversed" or (variant == "reversed_on_rank0" and rank == 0):
        for layer in layers:
            _reverse(layer)
    calls = []
    with _recording_mok_moe(calls):
        got_loss, got_grads = loss_and_grads(model, rank)
    assert len(calls) == len(layers)
    agreed_reversed = variant == "reversed"
    for layer, (fc1, fc2, _) in zip(layers, calls):
        w1, w2 = _expert_lists(layer)
        assert layer._mok_reversed == agreed_reversed
        if variant == "reversed_on_rank0" and rank == 0:  # the other rank is in order: a copy here
            assert not any(_storage_ptr(fc1) == _storage_ptr(w) for w in w1)
            assert torch.equal(fc1, torch.stack(w1)) and torch.equal(fc2, torch.stack(w2))
        else:
            first = -1 if agreed_reversed else 0
            assert fc1.data_ptr() == w1[first].data_ptr() and fc2.data_ptr() == w2[first].data_ptr()
            assert _storage_ptr(fc1) == _storage_ptr(w1[0]) and _storage_ptr(fc2) == _storage_ptr(w2[0])
    assert torch.equal(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert torch.equal(got_grads[name], want), name

    # A strict state_dict round trip keeps the stacked storage (values are copied in place).
    ptrs = [w.data_ptr() for layer in layers for w in sum(_expert_lists(layer), [])]
    model.load_state_dict(stock.state_dict(), strict=True)
    assert ptrs == [w.data_ptr() for layer in layers for w in sum(_expert_lists(layer), [])]
    stock.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("world,variant", [(1, "forward"), (2, "forward"), (1, "reversed"), (2, "reversed"),
                                           (2, "reversed_on_rank0")])
def test_layer_passes_views_of_the_parameters_and_gradients_match(world, variant):
    megatron_ranks(_layer_zero_copy, world, variant)


def _fused_shared_zero_copy(rank, world, variant):
    """The fused shared expert of one expert's size goes to mok_moe as a second weight segment
    that IS its parameters (no copy), beside the routed experts' alias; the loss and every
    gradient equal those of the same model with all weights copied into one tensor."""
    import megatron_mok

    from megatron_mok.megatron import MoKLayerSettings

    megatron_mok.register()
    settings = MoKLayerSettings(backend="reference", fuse_shared_expert=True)
    config = tiny_config("mok", world, mok_settings=settings, moe_shared_expert_intermediate_size=16)
    model = build_gpt(config, seed=7)
    layers = [m for _, m in moe_layers(model)]
    assert all(layer.fused_shared for layer in layers)
    if variant == "reversed":
        for layer in layers:
            _reverse(layer)
    with _copying_mok_moe():
        want_loss, want_grads = loss_and_grads(model, rank)
    calls = []
    with _recording_mok_moe(calls):
        got_loss, got_grads = loss_and_grads(model, rank)
    assert len(calls) == len(layers)
    for layer, (fc1, fc2, _) in zip(layers, calls):
        assert isinstance(fc1, tuple) and isinstance(fc2, tuple) and len(fc1) == len(fc2) == 2
        (routed1, shared1), (routed2, shared2) = fc1, fc2
        w1, w2 = _expert_lists(layer)
        first = -1 if variant == "reversed" else 0
        assert routed1.data_ptr() == w1[first].data_ptr() and routed2.data_ptr() == w2[first].data_ptr()
        s1, s2 = layer.shared_experts.linear_fc1.weight, layer.shared_experts.linear_fc2.weight
        assert shared1.shape == (1, *s1.shape) and shared2.shape == (1, *s2.shape)
        assert shared1.data_ptr() == s1.data_ptr() and shared2.data_ptr() == s2.data_ptr()
    assert torch.equal(got_loss, want_loss)
    assert got_grads.keys() == want_grads.keys()
    assert any(".shared_experts." in n for n in got_grads)
    for name, want in want_grads.items():
        assert torch.equal(got_grads[name], want), name


@pytest.mark.parametrize("world,variant", [(1, "forward"), (2, "forward"), (2, "reversed")])
def test_fused_shared_expert_is_passed_without_a_copy(world, variant):
    megatron_ranks(_fused_shared_zero_copy, world, variant)


def _conversions(rank, world):
    import megatron_mok

    megatron_mok.register()
    model = build_gpt(tiny_config("mok", world, mok_settings=_settings()), seed=8)
    layer = moe_layers(model)[0][1]
    ptrs = [w.data_ptr() for w in sum(_expert_lists(layer), [])]
    model.float()  # no-op conversion: storage (and whatever layout DDP made) untouched
    assert ptrs == [w.data_ptr() for w in sum(_expert_lists(layer), [])]
    model.double()  # new tensor per parameter: stacked again
    assert [w.dtype for w in sum(_expert_lists(layer), [])] == [torch.float64] * 8
    assert [expert_layout(ws) for ws in _expert_lists(layer)] == [FORWARD, FORWARD]


def test_dtype_conversion_restacks_the_expert_parameters():
    megatron_ranks(_conversions, 1)


class _Holder(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        for i in range(L):
            p = torch.nn.Parameter(torch.randn(shape))
            p.allreduce = False
            self.register_parameter(f"weight{i}", p)


class _Grouped(torch.nn.Module):
    """The parameters of a TEGroupedMLP (``linear_fc{1,2}.weight{i}``, expert-parallel)."""

    def __init__(self):
        super().__init__()
        self.linear_fc1 = _Holder((2 * I, H))
        self.linear_fc2 = _Holder((H, I))


def _ddp_layouts(rank, world):
    """What Megatron's DDP does with the stacked layout (documented in docs/megatron.md)."""
    import megatron_mok
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    megatron_mok.register()
    for distributed_optimizer in (False, True):
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                                   overlap_grad_reduce=True)
        # Grouped weights: kept in order without the distributed optimizer, reversed by its
        # parameter buffer (parameters are laid out in reverse registration order).
        config = tiny_config("alltoall", world)
        grouped = _Grouped()
        assert stack_expert_storage(grouped, L)
        DistributedDataParallel(config, ddp_config, grouped)
        want = REVERSED if distributed_optimizer else FORWARD
        assert [expert_layout(ws) for ws in local_expert_weights(grouped, L)] == [want, want]

        # SequentialMLP: the distributed optimizer interleaves each expert's fc1 and fc2
        # (reverse order), so the MoK layer stacks with a copy; results stay Megatron's.
        config = tiny_config("mok", world, mok_settings=_settings())
        model = build_gpt(config, seed=9)
        ddp = DistributedDataParallel(config, ddp_config, model)
        for _, layer in moe_layers(model):
            want = None if distributed_optimizer else FORWARD
            assert [expert_layout(ws) for ws in _expert_lists(layer)] == [want, want]
        ddp.zero_grad_buffer()
        tokens, position_ids, mask, labels = batch(rank)
        ddp(tokens, position_ids, mask, labels=labels).sum().backward()
        ddp.finish_grad_sync()
        assert all(p.main_grad.abs().sum() > 0 for n, p in model.named_parameters() if ".experts." in n)


def test_megatron_ddp_layouts():
    megatron_ranks(_ddp_layouts, 2)


# ----------------------------------------------------------------------------------------------
# Megatron's training step sequence, with the weights treated as the megakernel backend treats them.


def _megatron_training(rank, world):
    """Two iterations of Megatron's training step (bf16 Float16Module, DDP without the
    distributed optimizer, Megatron's optimizer, forward_backward_no_pipelining with two
    microbatches, finalize_model_grads), with the weights copied and with zero-copy. The expert
    weights reach the reference backend through _SavesWeightsLikeTheGpuBackends, which treats
    them the way the megakernel backend does (an op declared mutates_args="unknown", then
    save_for_backward); an autograd view of the parameters would raise in the first backward."""
    import megatron_mok
    import megatron_mok.megatron.layer as layer_module

    megatron_mok.register()
    real = layer_module.mok_moe
    results = {}
    for zero_copy in (False, True):
        config = tiny_config("mok", world, mok_settings=_settings(), bf16=True, params_dtype=torch.bfloat16)
        model = build_gpt(config, seed=5)
        layers = [m for _, m in moe_layers(model)]
        calls = []

        def gpu_like(x, topk_ids, topk_weights, fc1, fc2, **kwargs):
            if not zero_copy:
                fc1, fc2 = _copied(fc1), _copied(fc2)
            calls.append((fc1.data_ptr(), fc2.data_ptr()))
            x = _SavesWeightsLikeTheGpuBackends.apply(x, fc1, fc2)
            return real(x, topk_ids, topk_weights, fc1, fc2, **kwargs)

        with mock.patch.object(layer_module, "mok_moe", gpu_like):
            results[zero_copy] = megatron_train_steps(model, config, rank, iterations=2, microbatches=2)
        # 2 iterations x 2 microbatches x every MoE layer; zero-copy passes the parameters'
        # own memory (after Float16Module and DDP wrapped the model), the reference a copy.
        assert len(calls) == 4 * len(layers)
        firsts = [(w1[0].data_ptr(), w2[0].data_ptr()) for w1, w2 in map(_expert_lists, layers)]
        for i, ptrs in enumerate(calls):
            assert (ptrs == firsts[i % len(layers)]) == zero_copy
    (want, want_params), (got, got_params) = results[False], results[True]
    for (want_losses, want_grads), (got_losses, got_grads) in zip(want, got):
        assert torch.equal(got_losses, want_losses)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            assert torch.equal(got_grads[name], grad), name
    assert all(torch.equal(got_params[name], value) for name, value in want_params.items())


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_training_steps_with_zero_copy_equal_the_copy(world):
    megatron_ranks(_megatron_training, world)


def _pre_hooks_seen(rank, world, results, fuse_shared):
    """Forward pre-hooks on every module, as Megatron's DDP registers them with
    --overlap-param-gather: which parameter-owning modules saw theirs in one forward."""
    import megatron_mok
    from megatron_mok.megatron import MoKLayerSettings

    megatron_mok.register()
    seen = {}
    for dispatcher in ("alltoall", "mok"):
        settings = MoKLayerSettings(backend="reference", fuse_shared_expert=fuse_shared)
        config = tiny_config(dispatcher, world, **({"mok_settings": settings} if dispatcher == "mok" else {}))
        model = build_gpt(config, seed=9)
        called = []
        for name, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(lambda m, args, name=name: called.append(name))
        tokens, position_ids, mask, labels = batch(rank)
        model(tokens, position_ids, mask, labels=labels)
        seen[dispatcher] = called
    expert_modules = [n for n in seen["alltoall"] if ".experts." in n or (fuse_shared and ".shared_experts." in n)]
    assert expert_modules, "the alltoall forward called no expert module"
    missing = sorted(set(seen["alltoall"]) - set(seen["mok"]))
    assert not missing, f"under mok these modules' forward pre-hooks never ran: {missing}"
    # Each expert module's hook ran before the layer's output existed: once per forward.
    for name in expert_modules:
        assert seen["mok"].count(name) == seen["alltoall"].count(name), name
    results[rank] = True


@pytest.mark.parametrize("fuse_shared", [False, True], ids=["shared-expert-module", "shared-expert-fused"])
def test_expert_modules_forward_pre_hooks_run_as_ddp_overlap_param_gather_needs(fuse_shared):
    import multiprocessing

    results = multiprocessing.Manager().dict()
    megatron_ranks(_pre_hooks_seen, 2, results, fuse_shared)
    assert dict(results) == {0: True, 1: True}


def _overlap_param_gather(rank, world, ep):
    """Megatron training with the distributed optimizer, its parameter all-gather overlapped with
    the forward (waited for in the modules' forward pre-hooks) or not: the same numbers. With
    EP < world the experts are replicated over world / EP data-parallel ranks, so the optimizer
    shards them and each step must all-gather them back (with EP = world there is nothing to
    gather, and a layer that skipped the hooks would pass)."""
    import megatron_mok

    megatron_mok.register()
    results = {}
    for overlap in (False, True):
        config = tiny_config("mok", ep, mok_settings=_settings(), bf16=True, params_dtype=torch.bfloat16)
        model = build_gpt(config, seed=6)
        results[overlap] = megatron_train_steps(model, config, rank, iterations=3, microbatches=2,
                                                distributed_optimizer=True, overlap_param_gather=overlap)
    (want, want_params), (got, got_params) = results[False], results[True]
    for it, ((want_losses, _), (got_losses, _)) in enumerate(zip(want, got)):
        assert torch.equal(got_losses, want_losses), f"iteration {it}: {got_losses} vs {want_losses}"
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), name


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2)])
def test_training_with_overlapped_param_gather_equals_it_without(world, ep):
    megatron_ranks(_overlap_param_gather, world, ep, expert_parallel=ep)
