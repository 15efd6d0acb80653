"""The launcher: GPT pretraining with Megatron-Core's training loop and the MoK plugin installed.

``python -m megatron_mok.pretrain_gpt [Megatron flags]`` (console script ``mok-pretrain-gpt``;
both call :func:`main`) does what Megatron-LM's ``pretrain_gpt.py`` does for megatron-core 0.19
(parse and validate Megatron's flags, build the GPT model from the config, train on
``--mock-data`` or indexed ``--data-path`` datasets; :mod:`.gpt_recipe`), after
:func:`megatron_mok.register`, so that ``--moe-token-dispatcher-type mok`` and the ``--mok-*``
flags are available. Any other dispatcher (``alltoall``, ``flex``, ``allgather``) runs
unchanged, which makes side-by-side comparisons one flag apart.

Arguments of the form ``@FILE`` are replaced by the flags in FILE (:mod:`.arg_files`), so the
model configs of ``configs/`` compose with extra flags:
``mok-pretrain-gpt @configs/tiny.args --moe-token-dispatcher-type mok --train-iters 20``.

Megatron's training loop needs CUDA GPUs. On a machine without one the launcher parses and
validates the flags, builds the model on the meta device (every MoE layer is checked and
constructed, no memory is allocated), reports what it built and exits with status 1, saying
that training needs a GPU. Start-up errors (unsupported settings, bad tunables) exit with
status 2 and one message.

Not handled here (use Megatron-LM's own ``pretrain_gpt.py`` plus ``megatron_mok.register()``):
SFT (``--sft``), FIM data, packed sequences (``--dataloader-inter-document-masking``), hybrid
context parallelism, ModelOpt and logit distillation.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Optional, Sequence

import torch

from .. import __version__
from .arg_files import expand_arg_files
from .gpt_recipe import forward_step, get_embedding_ranks, train_valid_test_datasets_provider
from .registration import register

__all__ = ["main", "build_model_without_gpu"]

_UNSUPPORTED_FLAGS = {
    "sft": "--sft",
    "fim_data": "--fim-data",
    "dataloader_inter_document_masking": "--dataloader-inter-document-masking",
    "hybrid_context_parallel": "--hybrid-context-parallel",
    "logits_load_dir": "--logits-load-dir",
}


def _reject_unsupported(args) -> None:
    used = [flag for name, flag in _UNSUPPORTED_FLAGS.items() if getattr(args, name, None)]
    if used:
        raise SystemExit(
            f"mok-pretrain-gpt: {', '.join(used)} not handled by this launcher (it runs GPT "
            "pretraining on mock or indexed data). Use Megatron-LM's pretrain_gpt.py with "
            "`import megatron_mok; megatron_mok.register()` added before its argument parsing."
        )


def _describe_model(chunks) -> str:
    """One line: parameters of this rank's model chunks, and its MoE layers by class."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    moe = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
    kinds = sorted({type(m).__name__ for m in moe})
    stages = f" in {len(chunks)} virtual pipeline stages" if len(chunks) > 1 else ""
    return (f"{params / 1e6:.1f}M parameters on this rank{stages}, {len(moe)} MoE layers "
            f"({', '.join(kinds) or 'none'})")


def _layout(args) -> str:
    """The parallel layout of the job, e.g. "TP 2 (SP), ETP 1, EP 2, PP 2 x 2 virtual"."""
    parts = [f"TP {args.tensor_model_parallel_size}" + (" (SP)" if args.sequence_parallel else "")]
    if args.context_parallel_size > 1:
        parts.append(f"CP {args.context_parallel_size}")
    parts.append(f"ETP {args.expert_tensor_parallel_size}")
    parts.append(f"EP {args.expert_model_parallel_size}")
    pp = f"PP {args.pipeline_model_parallel_size}"
    if args.virtual_pipeline_model_parallel_size:
        pp += f" x {args.virtual_pipeline_model_parallel_size} virtual"
    parts.append(pp)
    return ", ".join(parts)


def build_model_without_gpu(args, model_cfg) -> str:
    """Build this rank's model (every virtual pipeline stage of its pipeline stage) on the meta
    device, on a machine without a GPU.

    Runs every layer constructor (the MoK layer's start-up checks included) over a gloo
    process group with the job's tensor-, context-, expert-, expert-tensor- and
    pipeline-parallel groups, allocating no parameter memory. Returns a one-line description
    (rank, layout, parameters, MoE layers).
    """
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from .cpu_compat import cpu_device_patches, initialize_cpu_model_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    meta = torch.device("meta")
    virtual = args.virtual_pipeline_model_parallel_size
    with cpu_device_patches():
        initialize_cpu_model_parallel(tensor_parallel=args.tensor_model_parallel_size,
                                      expert_parallel=args.expert_model_parallel_size,
                                      expert_tensor_parallel=args.expert_tensor_parallel_size,
                                      pipeline_parallel=args.pipeline_model_parallel_size,
                                      virtual_pipeline_parallel=virtual,
                                      context_parallel=args.context_parallel_size, seed=args.seed)
        model_cfg.transformer.use_cpu_initialization = False
        model_cfg.transformer.init_model_with_meta_device = True  # no embedding all-reduce across stages
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        with torch.device("meta"), _current_device(meta), _torch_norm_with_sequence_parallel() as stand_in:
            builder = GPTModelBuilder(model_cfg)
            chunks = [builder.build_model(pg_collection, vp_stage=vp) for vp in (range(virtual) if virtual else [None])]
        description = f"rank {args.rank} (pipeline stage {stage}; {_layout(args)}): {_describe_model(chunks)}"
        if stand_in:
            description += (" (its norms are torch's, standing in for the sequence-parallel norms of Transformer "
                            "Engine or Apex, which this machine lacks and a GPU run with --sequence-parallel needs)")
        parallel_state.destroy_model_parallel()
    return description


@contextlib.contextmanager
def _torch_norm_with_sequence_parallel():
    """On the meta device only: Megatron's local spec without Apex normalises with torch's norms
    (``WrappedTorchNorm``), which refuse sequence parallelism; a GPU job with
    ``--sequence-parallel`` runs Transformer Engine's or Apex's norms instead. So that the dry run
    can build tensor-parallel layouts with sequence parallelism, a torch norm is built here from
    the config as if sequence parallelism were off (its parameters are the same). Yields a list
    that is non-empty when a stand-in was built."""
    import copy
    from unittest import mock

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    used = []

    def __new__(cls, config, *args, **kwargs):
        if getattr(config, "sequence_parallel", False):
            used.append(True)
            config = copy.copy(config)
            config.sequence_parallel = False
        return original(cls, config, *args, **kwargs)

    with mock.patch.object(torch_norm.WrappedTorchNorm, "__new__", __new__):
        yield used


def _current_device(device):
    from unittest import mock

    return mock.patch("torch.cuda.current_device", lambda: device)


def _validate_for_hopper_without_a_gpu() -> None:
    """Without a GPU, Megatron's ``validate_args`` cannot ask the GPU's architecture (it does
    with tensor or context parallelism, to decide the CUDA_DEVICE_MAX_CONNECTIONS rule): the
    CPU dry run validates for the GPUs MoK targets, Hopper (sm_90)."""
    from megatron.training import arguments as megatron_arguments

    megatron_arguments.get_device_arch_version = lambda: 9


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


def main(argv: Optional[Sequence[str]] = None, *, program_start: Optional[float] = None) -> int:
    """Run GPT pretraining (see the module docstring). Returns the process exit status: 0 after
    training, 1 on a machine without a CUDA GPU (model built on the meta device, nothing
    trained), 2 for a start-up error (unsupported setting, bad tunable, unavailable backend).

    Args:
        argv: command-line arguments without the program name; default ``sys.argv[1:]``.
        program_start: ``time.time()`` when the program started, for Megatron's start-up
            timing log; default: when ``main`` was entered.
    """
    from megatron.core.enums import ModelType
    from megatron.training import inprocess_restart, pretrain, print_rank_0, set_startup_timestamps
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from ..config import MoKConfigError
    from ..functional import BackendUnavailable
    from .peers import EPTopologyError
    from .validation import MoKUnsupportedError

    startup_errors = (MoKUnsupportedError, MoKConfigError, BackendUnavailable, EPTopologyError)

    main_entry = time.time()
    register()
    arguments = expand_arg_files(sys.argv[1:] if argv is None else list(argv))
    sys.argv = [sys.argv[0]] + arguments  # Megatron's parser reads sys.argv
    program_start = main_entry if program_start is None else program_start
    set_startup_timestamps(program_start=program_start, main_entry=main_entry)
    run_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    if not torch.cuda.is_available():
        _validate_for_hopper_without_a_gpu()
    try:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    except startup_errors as err:
        return _startup_error(err)
    _reject_unsupported(args)
    model_cfg = gpt_config_from_args(args)

    if not torch.cuda.is_available():
        try:
            description = build_model_without_gpu(args, model_cfg)
        except startup_errors as err:
            return _startup_error(err)
        print(
            f"mok-pretrain-gpt: no CUDA GPU on this machine. Arguments parsed and validated "
            f"(--moe-token-dispatcher-type {args.moe_token_dispatcher_type}); model built on the "
            f"meta device: {description}. Megatron's training loop (data loaders, DDP, optimizer, "
            "fused kernels) needs CUDA GPUs, so nothing was trained. For a CPU run of the MoK "
            "layer against Megatron's own, see `python examples/cpu_demo.py`.",
            flush=True,
        )
        return 1

    print_rank_0(f"> megatron-mok {__version__}: --moe-token-dispatcher-type "
                 f"{args.moe_token_dispatcher_type}" + (f", --mok-backend {args.mok_backend}"
                                                        if args.moe_token_dispatcher_type == "mok" else ""))
    length = (f"{args.train_iters} iterations" if args.train_iters else f"{args.train_samples} samples")
    print_rank_0(f"> megatron-mok: Megatron's training loop, {length}; it prints an "
                 f"iteration line every {args.log_interval} (--log-interval), and each MoE layer says which "
                 "MoK backend it runs when it is built")
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    _use_prebuilt_dataset_helpers()
    try:
        run_pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                     store=store, get_embedding_ranks=get_embedding_ranks)
    except startup_errors as err:  # raised by a MoK layer's constructor inside pretrain()
        return _startup_error(err)
    return 0


def _startup_error(err: BaseException) -> int:
    """Print a start-up error once per host (local rank 0; every rank of a host sees the same
    GPUs and flags) without a traceback; returns the exit status 2."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"mok-pretrain-gpt: error: {err}", file=sys.stderr, flush=True)
    return 2
