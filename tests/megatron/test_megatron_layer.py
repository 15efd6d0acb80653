"""The MoK MoE layer against Megatron's own MoE layers, on the CPU with gloo (P = 1 and 2).

Every test builds Megatron's layer (alltoall / allgather dispatcher) and the MoK layer
(reference backend) from the same spec, copies the weights across with a strict
``load_state_dict`` and compares outputs and every parameter gradient within fp32 round-off.
Each rank's tokens differ, and with P = 2 half of each token's experts live on the other rank,
so a wrong route shows up as a wrong value.
"""

import pytest
import torch

from megatron_mok.megatron.routing import remap_for_fused_shared, routing_to_topk
from tests.megatron.megatron_utils import (
    assert_close_tensors,
    build_gpt,
    loss_and_grads,
    megatron_ranks,
    moe_layers,
    moe_spec_layer,
    tiny_config,
)


def _settings(**kwargs):
    from megatron_mok.megatron import MoKLayerSettings

    return MoKLayerSettings(backend="reference", **kwargs)


def _gpt_matches_megatron(rank, world):
    import megatron_mok
    from megatron_mok.megatron import MoKMoELayer

    megatron_mok.register()
    mok = build_gpt(tiny_config("mok", world, mok_settings=_settings()), seed=1)
    layers = moe_layers(mok)
    assert [n for n, _ in layers] == ["decoder.layers.1.mlp", "mtp.layers.0.mtp_model_layer.mlp"]
    assert all(isinstance(m, MoKMoELayer) for _, m in layers)
    for dispatcher in ("alltoall", "allgather"):
        ref = build_gpt(tiny_config(dispatcher, world), seed=2)
        assert not any(isinstance(m, MoKMoELayer) for _, m in moe_layers(ref))
        mok.load_state_dict(ref.state_dict(), strict=True)
        want_loss, want_grads = loss_and_grads(ref, rank)
        got_loss, got_grads = loss_and_grads(mok, rank)
        assert_close_tensors({"loss": want_loss}, {"loss": got_loss}, f"{dispatcher} loss")
        assert_close_tensors(want_grads, got_grads, f"{dispatcher} grad")
        # Router, experts and shared experts all received gradients.
        assert any(".router." in n for n in got_grads) and any(".experts." in n for n in got_grads)


@pytest.mark.parametrize("world", [1, 2])
def test_gpt_moe_matches_alltoall_and_allgather(world):
    megatron_ranks(_gpt_matches_megatron, world)


def _fused_shared_expert(rank, world):
    import megatron_mok

    megatron_mok.register()
    cases = [dict(), dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True),
             dict(recompute_granularity="selective", recompute_modules=["moe"])]
    for overrides in cases:
        overrides.setdefault("moe_shared_expert_intermediate_size", 16)
        ref = build_gpt(tiny_config("alltoall", world, **overrides), seed=3)
        mok = build_gpt(tiny_config("mok", world, mok_settings=_settings(fuse_shared_expert=True), **overrides), seed=4)
        assert all(m.fused_shared for _, m in moe_layers(mok))
        assert all(m.moe_layer_recompute == ("recompute_modules" in overrides) for _, m in moe_layers(mok))
        mok.load_state_dict(ref.state_dict(), strict=True)
        want_loss, want_grads = loss_and_grads(ref, rank)
        got_loss, got_grads = loss_and_grads(mok, rank)
        assert_close_tensors({"loss": want_loss}, {"loss": got_loss}, f"fused shared {overrides} loss")
        assert_close_tensors(want_grads, got_grads, f"fused shared {overrides} grad")


def test_fused_shared_expert_and_recompute_match_megatron():
    megatron_ranks(_fused_shared_expert, 2)


def _staged_protocol(rank, world):
    import megatron_mok
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_mok.megatron import MoKMoELayer, MoKTokenDispatcher

    megatron_mok.register()
    torch.manual_seed(5)
    layer = moe_spec_layer(tiny_config("mok", world, mok_settings=_settings()))
    assert isinstance(layer, MoKMoELayer) and isinstance(layer, MoELayer)
    assert isinstance(layer.token_dispatcher, MoKTokenDispatcher)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 2, 32, generator=gen)
    dy = torch.randn(6, 2, 32, generator=gen)

    def run(forward):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = forward(xi)
        y.backward(dy)
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        grads["input"] = xi.grad.clone()
        return y.detach(), grads

    def staged(xi):
        # Megatron's stage methods, one at a time, as the EP-overlap schedules call them.
        shared = layer.shared_experts_compute(xi)
        probs, routing_map = layer.route(xi)
        hidden, probs = layer.preprocess(xi, probs, routing_map)
        hidden, probs = layer.dispatch(hidden, probs)
        out, bias = layer.routed_experts_compute(hidden, probs)
        assert bias is None
        return layer.postprocess(layer.combine(out), shared)

    fused_y, fused_grads = run(lambda xi: layer(xi)[0])
    staged_y, staged_grads = run(staged)
    megatron_y, megatron_grads = run(lambda xi: MoELayer.forward(layer, xi)[0])
    assert fused_y.shape == x.shape
    assert_close_tensors({"y": fused_y}, {"y": staged_y}, "staged output")
    assert_close_tensors(fused_grads, staged_grads, "staged grad")
    assert_close_tensors({"y": fused_y}, {"y": megatron_y}, "MoELayer.forward output")
    assert_close_tensors(fused_grads, megatron_grads, "MoELayer.forward grad")


def test_six_method_dispatcher_protocol_matches_fused_forward():
    megatron_ranks(_staged_protocol, 2)


def _same_attributes_as_moe_layer(rank, world):
    import megatron_mok
    from megatron.core.transformer.moe.moe_layer import MoELayer

    megatron_mok.register()
    stock = moe_spec_layer(tiny_config("allgather", world))
    mok = moe_spec_layer(tiny_config("mok", world, mok_settings=_settings()))
    assert type(stock) is MoELayer
    missing = set(vars(stock)) - set(vars(mok))
    assert not missing, f"MoKMoELayer lacks MoELayer attributes {sorted(missing)}"
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in mok.named_parameters()]


def test_mok_layer_has_every_moe_layer_attribute():
    megatron_ranks(_same_attributes_as_moe_layer, 1)


def test_routing_to_topk_orders_slots_by_expert_and_pads_with_minus_one():
    routing_map = torch.tensor([[False, True, False, True, True],
                                [True, False, False, False, False],
                                [False, False, False, False, False]])
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3],
                          [0.9, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ids, weights = routing_to_topk(probs, routing_map, 3)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 3, 4], [0, -1, -1], [-1, -1, -1]]
    assert torch.allclose(weights, torch.tensor([[0.2, 0.5, 0.3], [0.9, 0, 0], [0, 0, 0]]))
    (weights * torch.arange(1, 4)).sum().backward()
    expected = torch.zeros(3, 5, dtype=torch.float64)
    expected[0, 1], expected[0, 3], expected[0, 4], expected[1, 0] = 1, 2, 3, 1
    assert torch.equal(probs.grad, expected)


def test_remap_for_fused_shared_keeps_each_expert_on_its_rank():
    ids = torch.tensor([[0, 3, -1], [4, 7, 5]])
    # 4 routed + 2 shared experts per rank: expert 4 (rank 1, local 0) becomes 6.
    assert remap_for_fused_shared(ids, 4, 2).tolist() == [[0, 3, -1], [6, 9, 7]]
