"""Megatron's gradient-accumulation fusion for the MoK layer's expert weights
(``MoKMoELayer._fused_main_grads``): with ``gradient_accumulation_fusion`` the expert weight
gradients go straight into each parameter's fp32 ``main_grad`` and DDP skips its own add
(``grad_added_to_main_grad``); Megatron's DDP still sees a gradient at every expert parameter,
so ``--overlap-grad-reduce`` reduces every bucket. On gloo CPU ranks with the reference
backend (which adds its bf16 gradient into ``main_grad`` exactly as DDP would), every
``main_grad`` after two micro-batches is bitwise the one without fusion, with and without
``--overlap-grad-reduce``, and with the distributed optimizer's gradient buffer. A fused shared expert
larger than one expert's size is split into copies whose gradients are not ``main_grad`` views:
the layer then says so once and leaves the add to DDP.
"""

from __future__ import annotations

import torch

from tests.megatron.megatron_utils import batch, build_gpt, megatron_ranks, moe_layers, tiny_config

FUSED = "MoK: expert weight gradients accumulate into main_grad in fp32 inside the weight-gradient kernel"
NOT_FUSED = "MoK: expert weight gradients are returned in bf16 and added into main_grad by DDP: the fused shared expert"


def _main_grads(rank, world, shared_size, overlap, fuse, distributed_optimizer=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import megatron_mok
    from megatron_mok.megatron import MoKLayerSettings

    megatron_mok.register()
    config = tiny_config("mok", world, moe_shared_expert_intermediate_size=shared_size,
                         mok_settings=MoKLayerSettings(backend="reference", fuse_shared_expert=True))
    model = build_gpt(config, seed=61)
    # Megatron's own linear layers read the flag when built (and would need apex's fused kernel
    # on this CPU); the MoK layer reads it at every forward.
    config.gradient_accumulation_fusion = fuse
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, use_distributed_optimizer=distributed_optimizer,
        bucket_size=4096 if distributed_optimizer else None), model)
    ddp.zero_grad_buffer()
    marked = []
    for micro in range(2):
        tokens, position_ids, mask, labels = batch(rank, seed=70 + micro)
        ddp(tokens, position_ids, mask, labels=labels).sum().backward()
        marked.append(sorted(n for n, p in model.named_parameters() if getattr(p, "grad_added_to_main_grad", False)))
    ddp.finish_grad_sync()
    layers = moe_layers(model)
    assert layers
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters()), "DDP's hooks ran for every parameter"
    return grads, marked


def _fused_equals_unfused(rank, world, shared_size, overlap, distributed_optimizer=False):
    from megatron_mok.megatron import layer as mok_layer

    plain, _ = _main_grads(rank, world, shared_size, overlap, False, distributed_optimizer)
    fused, marked = _main_grads(rank, world, shared_size, overlap, True, distributed_optimizer)
    assert plain.keys() == fused.keys()
    for name in plain:
        assert torch.equal(plain[name], fused[name]), f"rank {rank}: main_grad of {name} differs with fusion"
    experts = sorted(n for n in plain if ".experts." in n or ".shared_experts.linear_fc" in n)
    assert all(plain[n].abs().sum() > 0 for n in experts)
    if shared_size == 16:  # one expert's size: every expert weight (the shared one too) is fused
        assert FUSED in " ".join(mok_layer._NOTES_PRINTED)
        for names in marked:
            assert names == experts, (names, experts)
    else:
        assert any(n.startswith(NOT_FUSED) for n in mok_layer._NOTES_PRINTED), mok_layer._NOTES_PRINTED
        assert marked == [[], []]


def test_fused_main_grads_are_bitwise_ddps_with_overlapped_reduce():
    megatron_ranks(_fused_equals_unfused, 2, 16, True)


def test_fused_main_grads_are_bitwise_ddps_without_overlap():
    megatron_ranks(_fused_equals_unfused, 2, 16, False)


def test_fused_main_grads_with_the_distributed_optimizer():
    """Its gradient buffer interleaves each expert's fc1 and fc2 main_grad, in reverse order, in
    small buckets: the buffers are reached through their addresses wherever they lie."""
    megatron_ranks(_fused_equals_unfused, 2, 16, True, True)


def test_a_shared_expert_split_into_copies_leaves_the_add_to_ddp():
    megatron_ranks(_fused_equals_unfused, 2, 32, True)
