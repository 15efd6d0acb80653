"""Megatron-LM's GPT pretraining recipe for megatron-core 0.19: batches, the loss, the forward
step, datasets and embedding ranks, the functions the launcher (:mod:`.pretrain`) hands to
Megatron's ``pretrain``.

They follow Megatron-LM's ``pretrain_gpt.py``: TP rank 0 reads the data iterator and
broadcasts to its TP group, batches are split along the sequence for context parallelism, MTP
layers make their pipeline stages read data and hold word embeddings. Nothing here depends on
the dispatcher type: ``alltoall``, ``flex`` and ``mok`` runs are one flag apart.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional

import torch

__all__ = ["get_batch", "loss_func", "forward_step", "is_dataset_built_on_rank", "gpt_dataset_config_from_args",
           "train_valid_test_datasets_provider", "get_embedding_ranks"]

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
