"""GPT pretraining with Megatron-Core's training loop and the MoK plugin installed.

``python -m megatron_mok.pretrain_gpt [Megatron flags]`` (console script ``mok-pretrain-gpt``)
does what Megatron-LM's ``pretrain_gpt.py`` does for megatron-core 0.19 (parse and validate
Megatron's flags, build the GPT model from the config, train on ``--mock-data`` or indexed
``--data-path`` datasets), after :func:`megatron_mok.register`, so that
``--moe-token-dispatcher-type mok`` and the ``--mok-*`` flags are available. Any other
dispatcher (``alltoall``, ``flex``, ``allgather``) runs unchanged, which makes side-by-side
comparisons one flag apart.

Arguments of the form ``@FILE`` are replaced by the flags in FILE (one or more per line, ``#``
starts a comment), so the model configs of ``configs/`` compose with extra flags:
``mok-pretrain-gpt @configs/tiny.args --moe-token-dispatcher-type mok --train-iters 20``.

Megatron's training loop needs CUDA GPUs. On a machine without one the launcher parses and
validates the flags, builds the model on the meta device (every MoE layer is checked and
constructed, no memory is allocated), reports what it built and exits with status 1, saying
that training needs a GPU.

Not handled here (use Megatron-LM's own ``pretrain_gpt.py`` plus ``megatron_mok.register()``):
SFT (``--sft``), FIM data, packed sequences (``--dataloader-inter-document-masking``), hybrid
context parallelism, ModelOpt and logit distillation.
"""

import time

_PROGRAM_START_TIME = time.time()

import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
from functools import partial  # noqa: E402
from typing import List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

import megatron_mok  # noqa: E402

__all__ = ["main", "expand_arg_files", "read_config_metadata", "forward_step", "loss_func", "get_batch",
           "train_valid_test_datasets_provider", "gpt_dataset_config_from_args", "get_embedding_ranks"]

_UNSUPPORTED_FLAGS = {
    "sft": "--sft",
    "fim_data": "--fim-data",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking",
    "hybrid_context_parallel": "--hybrid-context-parallel",
    "logits_load_dir": "--logits-load-dir",
}


def expand_arg_files(argv: Sequence[str]) -> List[str]:
    """Replace every ``@FILE`` argument by the flags written in FILE.

    FILE holds flags as on a command line, any number per line; ``#`` starts a comment; quoting
    follows the shell. Files may include other files with ``@OTHER`` (relative paths are taken
    from the including file's directory).

    Args:
        argv: command-line arguments (without the program name).

    Returns:
        The arguments with every ``@FILE`` expanded in place.
    """
    out: List[str] = []
    for arg in argv:
        if not arg.startswith("@") or len(arg) == 1:
            out.append(arg)
            continue
        path = arg[1:]
        with open(path) as f:
            words = shlex.split(f.read(), comments=True)
        base = os.path.dirname(os.path.abspath(path))
        words = [("@" + os.path.join(base, w[1:])) if w.startswith("@") and not os.path.isabs(w[1:]) else w
                 for w in words]
        out.extend(expand_arg_files(words))
    return out


def read_config_metadata(path: str) -> dict:
    """The ``#@ key=value`` lines of a config file (e.g. ``nodes``, ``gpus_per_node``,
    ``experts_per_gpu``, ``min_gpus``), values as int where they are integers.

    Megatron ignores these lines (they are comments); launch scripts read them to size a job.
    """
    meta = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#@"):
                continue
            for item in line[2:].split():
                key, _, value = item.partition("=")
                meta[key] = int(value) if value.isdigit() else value
    return meta


# ----------------------------------------------------------------------------------------------
# Data and the forward step (Megatron's GPT pretraining recipe).

_TRANSFORMER_CONFIG = None


def _transformer_config():
    """The TransformerConfig of the parsed args, built once (batches need its MTP layout)."""
    global _TRANSFORMER_CONFIG
    if _TRANSFORMER_CONFIG is None:
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        _TRANSFORMER_CONFIG = core_transformer_config_from_args(get_args())
    return _TRANSFORMER_CONFIG


def _mtp_on_this_rank(vp_stage: Optional[int]) -> bool:
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    config = _transformer_config()
    return mtp_on_this_rank(layout=config.pipeline_model_parallel_layout,
                            mtp_num_layers=config.mtp_num_layers, ignore_virtual=False, vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage: Optional[int] = None) -> dict:
    """The micro-batch of this rank: tokens, labels, loss_mask, position_ids, attention_mask.

    Tensor-parallel rank 0 reads the data iterator and broadcasts to its TP group; the batch is
    then split along the sequence for context parallelism. Middle pipeline stages without MTP
    layers get Nones.

    Returns:
        dict of [B, S] int64 ``tokens``/``labels``/``position_ids``, [B, S] float ``loss_mask``
        and optional [B, 1, S, S] bool ``attention_mask`` (CUDA tensors), or Nones.
    """
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
    args = get_args()
    mtp_here = _mtp_on_this_rank(vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return {key: None for key in keys}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {key: (raw[key].cuda(non_blocking=True) if raw.get(key) is not None else None) for key in keys}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return {key: batch.get(key) for key in keys}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Masked sum of the per-token LM losses of one micro-batch.

    Args:
        loss_mask: [B, S] float, 1 where the token counts.
        output_tensor: [B, S] per-token losses from the model.

    Returns:
        (loss sum, number of counted tokens, {"lm loss": [sum, count]}) as Megatron's
        schedules expect; NaN/Inf losses are reported through Megatron's rerun state machine.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rerun = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun.validate_result(result=loss, rejection_func=reject,
                                  message=f"found {what} in local forward loss calculation",
                                  tolerance=0.0, fatal=True)
    return loss, num_tokens, report


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch forward: returns the per-token losses and the loss function to reduce them.

    ``return_schedule_plan`` (Megatron's EP-overlap schedule) is passed through for other
    dispatchers; the ``mok`` layer rejects that schedule at start-up.
    """
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    if return_schedule_plan:
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                         labels=batch["labels"], loss_mask=batch["loss_mask"])
        return plan, partial(loss_func, batch["loss_mask"], model=model)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"], model=model)


def is_dataset_built_on_rank(vp_stage: Optional[int] = None) -> bool:
    """Datasets are built on TP rank 0 of the stages that read data (first, last, MTP)."""
    from megatron.core import mpu
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_on_this_rank(vp_stage)


def gpt_dataset_config_from_args(args):
    """The ``GPTDatasetConfig`` of the parsed args (tokenizer, blends, sequence length, seed)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage: Optional[int] = None):
    """Train/valid/test datasets: ``MockGPTDataset`` with ``--mock-data``, else ``GPTDataset``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        gpt_dataset_config_from_args(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True


def get_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """Pipeline ranks holding word embeddings: the first stage, the last one when embeddings
    are tied, and every stage with MTP layers."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.training import get_args

    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        if not get_args().untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, _transformer_config()))
    return sorted(ranks)


# ----------------------------------------------------------------------------------------------
# Entry point.


def _reject_unsupported(args) -> None:
    used = [flag for name, flag in _UNSUPPORTED_FLAGS.items() if getattr(args, name, None)]
    if used:
        raise SystemExit(
            f"mok-pretrain-gpt: {', '.join(used)} not handled by this launcher (it runs GPT "
            "pretraining on mock or indexed data). Use Megatron-LM's pretrain_gpt.py with "
            "`import megatron_mok; megatron_mok.register()` added before its argument parsing."
        )


def _describe_model(model) -> str:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    params = sum(p.numel() for p in model.parameters())
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    kinds = sorted({type(m).__name__ for m in moe})
    return f"{params / 1e6:.1f}M parameters on this rank, {len(moe)} MoE layers ({', '.join(kinds) or 'none'})"


def build_model_without_gpu(args, model_cfg) -> str:
    """Build this rank's model stage on the meta device, on a machine without a GPU.

    Runs every layer constructor (the MoK layer's start-up checks included) over a gloo
    process group, allocating no parameter memory. Returns a one-line description.
    """
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from .megatron.cpu_compat import cpu_device_patches, initialize_cpu_model_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    meta = torch.device("meta")
    with cpu_device_patches():
        initialize_cpu_model_parallel(tensor_parallel=args.tensor_model_parallel_size,
                                      expert_parallel=args.expert_model_parallel_size,
                                      pipeline_parallel=args.pipeline_model_parallel_size, seed=args.seed)
        model_cfg.transformer.use_cpu_initialization = False
        with torch.device("meta"), _current_device(meta):
            model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
        description = _describe_model(model)
        parallel_state.destroy_model_parallel()
    return description


def _current_device(device):
    from unittest import mock

    return mock.patch("torch.cuda.current_device", lambda: device)


def _use_prebuilt_dataset_helpers() -> None:
    """Megatron's training start runs ``make`` in megatron/core/datasets to build its C++ index
    helpers; the megatron-core wheel ships them prebuilt (``helpers_cpp``) but no Makefile, so
    that ``make`` fails and rank 0 exits. Skip the build when the prebuilt module imports."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401  (only: does it import?)
    except ImportError:
        return  # a source checkout: let Megatron build them as usual
    dataset_utils.compile_helpers = lambda: None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run GPT pretraining (see the module docstring). Returns the process exit status.

    Args:
        argv: command-line arguments without the program name; default ``sys.argv[1:]``.
    """
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, print_rank_0, set_startup_timestamps
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from .config import MoKConfigError
    from .functional import BackendUnavailable
    from .megatron.validation import MoKUnsupportedError

    main_entry = time.time()
    megatron_mok.register()
    arguments = expand_arg_files(sys.argv[1:] if argv is None else list(argv))
    sys.argv = [sys.argv[0]] + arguments  # Megatron's parser reads sys.argv
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=main_entry)
    run_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    except (MoKUnsupportedError, MoKConfigError) as err:
        print(f"mok-pretrain-gpt: error: {err}", file=sys.stderr, flush=True)
        return 2
    _reject_unsupported(args)
    model_cfg = gpt_config_from_args(args)

    if not torch.cuda.is_available():
        try:
            description = build_model_without_gpu(args, model_cfg)
        except (MoKUnsupportedError, BackendUnavailable) as err:
            print(f"mok-pretrain-gpt: error: {err}", file=sys.stderr, flush=True)
            return 2
        print(
            f"mok-pretrain-gpt: no CUDA GPU on this machine. Arguments parsed and validated "
            f"(--moe-token-dispatcher-type {args.moe_token_dispatcher_type}); model built on the "
            f"meta device: {description}. Megatron's training loop (data loaders, DDP, optimizer, "
            "fused kernels) needs CUDA GPUs, so nothing was trained. For a CPU run of the MoK "
            "layer against Megatron's own, see `python examples/cpu_demo.py`.",
            flush=True,
        )
        return 1

    print_rank_0(f"> megatron-mok {megatron_mok.__version__}: --moe-token-dispatcher-type "
                 f"{args.moe_token_dispatcher_type}" + (f", --mok-backend {args.mok_backend}"
                                                        if args.moe_token_dispatcher_type == "mok" else ""))
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    _use_prebuilt_dataset_helpers()
    run_pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 store=store, get_embedding_ranks=get_embedding_ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
