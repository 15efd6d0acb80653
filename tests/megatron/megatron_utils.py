"""Helpers for the Megatron integration tests: P gloo ranks on the CPU with Megatron's parallel
state, tiny GPT-MoE configs, and weight/gradient comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks

SEQ = 8
BATCH = 2
VOCAB = 64


def end_child_processes(timeout_s: float = 10.0) -> None:
    """End the processes this rank started: the manager process behind Megatron's checkpoint
    write-results queue (``dist_checkpointing.save`` starts one per process) and any other
    multiprocessing child. A test rank leaves with ``os._exit`` (tests/distributed.py), which
    skips the exit handlers that would end them, so without this they outlive the test."""
    import multiprocessing

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        filesystem_async = None
    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is not None:
        manager = getattr(queue, "_manager", None)
        if manager is not None:
            manager.shutdown()
        filesystem_async._results_queue = None
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join(timeout_s)


def _entry(rank, world, fn, tensor_parallel, expert_parallel, args, layout=None):
    from megatron_mok.megatron.cpu_compat import cpu_device_patches, initialize_cpu_model_parallel

    from megatron.core import parallel_state

    try:
        with cpu_device_patches():
            initialize_cpu_model_parallel(tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                                          **(layout or {}))
            try:
                fn(rank, world, *args)
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        end_child_processes()


def megatron_ranks(fn, world: int, *args, tensor_parallel: int = 1, expert_parallel=None, **layout) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks with Megatron's model-parallel state
    (EP = ``expert_parallel``, default the world size; ``layout``: more keyword arguments of
    :func:`megatron_mok.megatron.cpu_compat.initialize_cpu_model_parallel`, e.g.
    ``expert_tensor_parallel``, ``pipeline_parallel``, ``virtual_pipeline_parallel``) and the CPU
    patches active. ``fn`` must be a module-level function."""
    ep = world if expert_parallel is None else expert_parallel
    run_ranks(_entry, world, fn, tensor_parallel, ep, args, layout)


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


class _CudaDeviceToCpu(torch.overrides.TorchFunctionMode):
    """Tensors that Megatron's optimizer and schedules create with ``device="cuda"`` (literal
    device strings, which ``cpu_compat``'s patches do not reach) are created on the CPU, and
    ``Tensor.cuda()`` leaves CPU tensors where they are; ``Tensor.type()`` names CPU tensors as
    their CUDA types (Megatron's mixed-precision optimizer accepts only ``torch.cuda.*Tensor``).
    For the CPU training-loop tests only."""

    @staticmethod
    def _cpu(value):
        if isinstance(value, str) and value.startswith("cuda"):
            return "cpu"
        if isinstance(value, torch.device) and value.type == "cuda":
            return torch.device("cpu")
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs:
            kwargs["device"] = self._cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(self._cpu(a) for a in args)
        return func(*args, **kwargs)


def megatron_train_steps(model, config, rank: int, iterations: int = 2, microbatches: int = 2,
                         bf16: bool = True, overlap_grad_reduce: bool = True,
                         distributed_optimizer: bool = False, overlap_param_gather: bool = False):
    """``iterations`` training steps the way Megatron's ``train_step`` runs them (core 0.19.2):
    ``Float16Module`` (with ``bf16``), Megatron's DistributedDataParallel (with
    ``distributed_optimizer``, the distributed optimizer; with ``overlap_param_gather`` too, the
    parameters' all-gather waited for in the modules' forward pre-hooks), the optimizer from
    ``get_megatron_optimizer`` (Adam, fp32 main params), ``forward_backward_no_pipelining`` over
    ``microbatches`` microbatches with ``finalize_model_grads``, then ``optimizer.step()``.

    ``config`` must be the model's config (``bf16=True`` with ``bf16``). Returns, per
    iteration, the losses of the microbatches (after Megatron's loss function) and every
    parameter's ``main_grad`` (keyed by the unwrapped model's parameter names), and at the
    end the parameters' values (a copy)."""
    with _CudaDeviceToCpu():
        return _train_steps(model, config, rank, iterations, microbatches, bf16, overlap_grad_reduce,
                            distributed_optimizer, overlap_param_gather)


def _train_steps(model, config, rank, iterations, microbatches, bf16, overlap_grad_reduce, distributed_optimizer,
                 overlap_param_gather):
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer.module import Float16Module

    wrapped = Float16Module(config, model) if bf16 else model
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               overlap_grad_reduce=overlap_grad_reduce,
                                               overlap_param_gather=overlap_param_gather, grad_reduce_in_fp32=True,
                                               # small buckets: the expert weights get buckets of
                                               # their own, as in a real model's size
                                               bucket_size=4096 if distributed_optimizer else None)
    ddp = DistributedDataParallel(config, ddp_config, wrapped)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, use_distributed_optimizer=distributed_optimizer,
                        clip_grad=1.0),
        [ddp])
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync if overlap_grad_reduce else None
    config.finalize_model_grads_func = finalize_model_grads

    def loss_func(labels, output):
        loss = output.float().sum() / labels.numel()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, position_ids, mask, labels = next(data_iterator)
        return model(tokens, position_ids, mask, labels=labels), partial(loss_func, labels)

    names = {id(p): n for n, p in model.named_parameters()}
    history = []
    for iteration in range(iterations):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        data = iter([batch(rank, seed=100 * iteration + m) for m in range(microbatches)])
        results = forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=microbatches,
            seq_length=SEQ, micro_batch_size=BATCH)
        if overlap_param_gather:
            # What the forward pre-hooks guarantee: every parameter all-gather of this step was
            # waited for before the forward used the parameters (one not waited for is a race
            # with the compute stream on GPUs; on gloo it completes in time anyway).
            groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
            pending = [i for i, g in enumerate(groups) if g.param_gather_handle is not None]
            assert not pending, (f"iteration {iteration}: the parameter all-gather of bucket groups {pending} "
                                 f"(of {len(groups)}) was never waited for")
        losses = torch.stack([r["loss"] for r in results])
        grads = {names[id(p)]: p.main_grad.detach().clone() for p in model.parameters() if p.requires_grad}
        optimizer.step()
        history.append((losses, grads))
    if overlap_param_gather:
        ddp.disable_forward_pre_hook()  # waits for the last step's parameter all-gathers
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return history, params
