"""Helpers for the Megatron integration tests: P gloo ranks on the CPU with Megatron's parallel
state, tiny GPT-MoE configs, and weight/gradient comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks

SEQ = 8
BATCH = 2
VOCAB = 64


def _entry(rank, world, fn, tensor_parallel, expert_parallel, args):
    from megatron_mok.megatron.cpu_compat import cpu_device_patches, initialize_cpu_model_parallel

    from megatron.core import parallel_state

    with cpu_device_patches():
        initialize_cpu_model_parallel(tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
        try:
            fn(rank, world, *args)
        finally:
            parallel_state.destroy_model_parallel()


def megatron_ranks(fn, world: int, *args, tensor_parallel: int = 1, expert_parallel=None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks with Megatron's model-parallel state
    (EP = ``expert_parallel``, default the world size) and the CPU patches active. ``fn`` must be
    a module-level function."""
    ep = world if expert_parallel is None else expert_parallel
    run_ranks(_entry, world, fn, tensor_parallel, ep, args)


def tiny_config(dispatcher: str, ep: int, **overrides):
    """A fp32 GPT-MoE TransformerConfig small enough for the CPU: 2 layers (dense, MoE), 4
    experts per EP rank, top-2, DeepSeek-style router (sigmoid, groups, expert bias, seq aux
    loss), a shared expert, one MTP layer. ``mok_settings=`` attaches MoKLayerSettings."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
        num_moe_experts=4 * ep, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1], mtp_num_layers=1,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.0,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        normalization="RMSNorm", moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, init_method_std=0.05,
    )
    settings = overrides.pop("mok_settings", None)
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    if settings is not None:
        config.mok_settings = settings
    return config


def build_gpt(config, seed: int = 7):
    """A GPTModel (local spec, decoder block spec + MTP block spec) on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = None
    if config.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, mtp_block_spec=mtp, position_embedding_type="rope")


def batch(rank: int, seed: int = 11):
    """tokens, position ids, causal mask, labels of this rank (different on every rank)."""
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    return tokens, position_ids, mask, labels


def loss_and_grads(model, rank: int):
    """Sum of the LM (and MTP) losses of this rank's batch, and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    tokens, position_ids, mask, labels = batch(rank)
    loss = model(tokens, position_ids, mask, labels=labels).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def moe_layers(model):
    """(name, module) of every MoELayer of the model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]


def assert_close_tensors(expected: dict, actual: dict, what: str, rtol: float = 2e-5) -> None:
    """Same keys, and every tensor within ``rtol`` of the largest magnitude of its expectation
    (fp32 round-off of a different summation order, far below any real mismatch)."""
    assert expected.keys() == actual.keys(), f"{what}: keys differ: {set(expected) ^ set(actual)}"
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{what} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        scale = want.abs().max().item()
        err = (got - want).abs().max().item()
        assert err <= rtol * scale + 1e-7, f"{what} {name}: max |diff| {err:.3e} vs scale {scale:.3e}"


def moe_spec_layer(config):
    """One MoE layer built the way a GPT layer spec builds it (local spec's mlp builder)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules

    builder = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts).mlp
    return builder(config=config, pg_collection=None, is_mtp_layer=False)
