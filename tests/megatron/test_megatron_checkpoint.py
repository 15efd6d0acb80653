"""Checkpoints interchange between Megatron's MoE layer and the MoK layer (P = 2, gloo), and
expert gradients land in Megatron's expert-data-parallel gradient buffer."""

from unittest import mock

import torch

from tests.megatron.megatron_utils import assert_close_tensors, batch, build_gpt, loss_and_grads, megatron_ranks, tiny_config


def _outputs(model, rank):
    tokens, position_ids, mask, labels = batch(rank, seed=21)
    with torch.no_grad():
        return model(tokens, position_ids, mask, labels=labels)


def _sharded_layout(model):
    """key -> (global shape, global offset) of every sharded tensor of the model."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layout = {}
    for key, value in model.sharded_state_dict().items():
        if isinstance(value, ShardedTensor):
            layout[key] = (tuple(value.global_shape), tuple(value.global_offset), value.key)
    return layout


def _round_trip(rank, world, directory):
    import megatron_mok
    from megatron.core import dist_checkpointing

    from megatron_mok.megatron import MoKLayerSettings

    megatron_mok.register()
    settings = MoKLayerSettings(backend="reference")
    alltoall = build_gpt(tiny_config("alltoall", world), seed=31)
    mok = build_gpt(tiny_config("mok", world, mok_settings=settings), seed=32)
    assert alltoall.state_dict().keys() == mok.state_dict().keys()
    assert _sharded_layout(alltoall) == _sharded_layout(mok)

    # alltoall -> mok with a plain state_dict: same outputs.
    mok.load_state_dict(alltoall.state_dict(), strict=True)
    assert_close_tensors({"y": _outputs(alltoall, rank)}, {"y": _outputs(mok, rank)}, "alltoall -> mok")
    # Train the MoK model one SGD step so its weights are its own, then mok -> alltoall. The
    # replicated (non-expert) gradients are averaged over the ranks, as data parallelism does,
    # so replicas stay equal and the distributed checkpoint below may save one copy of them.
    _, grads = loss_and_grads(mok, rank)
    with torch.no_grad():
        for name, p in mok.named_parameters():
            if ".experts." not in name:
                torch.distributed.all_reduce(grads[name])
                grads[name] /= world
            p -= 0.1 * grads[name]
    back = build_gpt(tiny_config("alltoall", world), seed=33)
    back.load_state_dict(mok.state_dict(), strict=True)
    assert_close_tensors({"y": _outputs(mok, rank)}, {"y": _outputs(back, rank)}, "mok -> alltoall")
    assert not torch.allclose(_outputs(back, rank), _outputs(alltoall, rank))

    # Distributed checkpoint: saved from the MoK model, loaded into a fresh alltoall model.
    # (Megatron logs the writer's memory through psutil, which this environment lacks.)
    with mock.patch("megatron.core.dist_checkpointing.strategies.filesystem_async._process_memory", lambda: 0):
        dist_checkpointing.save(mok.sharded_state_dict(), directory)
    fresh = build_gpt(tiny_config("alltoall", world), seed=34)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), directory), strict=True)
    assert_close_tensors({"y": _outputs(mok, rank)}, {"y": _outputs(fresh, rank)}, "dist checkpoint mok -> alltoall")


def test_checkpoint_round_trip_alltoall_mok_alltoall(tmp_path):
    megatron_ranks(_round_trip, 2, str(tmp_path))


def _ddp_main_grads(rank, world):
    import megatron_mok
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_mok.megatron import MoKLayerSettings

    megatron_mok.register()
    main_grads = {}
    for dispatcher in ("alltoall", "mok"):
        config = tiny_config(dispatcher, world)
        if dispatcher == "mok":
            config.mok_settings = MoKLayerSettings(backend="reference")
        model = build_gpt(config, seed=41)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        expert_params = {id(p) for b in ddp.expert_parallel_buffers for p in b.params}
        for name, p in model.named_parameters():
            assert (id(p) in expert_params) == (".experts." in name), name
        # Two micro-batches accumulate into main_grad, then the gradient all-reduce.
        ddp.zero_grad_buffer()
        for micro in range(2):
            tokens, position_ids, mask, labels = batch(rank, seed=50 + micro)
            ddp(tokens, position_ids, mask, labels=labels).sum().backward()
        ddp.finish_grad_sync()
        main_grads[dispatcher] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        assert all(g.abs().sum() > 0 for n, g in main_grads[dispatcher].items() if ".experts." in n)
    assert_close_tensors(main_grads["alltoall"], main_grads["mok"], "DDP main_grad")


def test_ddp_main_grad_and_expert_buffers_match_megatron():
    megatron_ranks(_ddp_main_grads, 2)
