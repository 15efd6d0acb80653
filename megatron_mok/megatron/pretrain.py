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

    from .cpu_compat import cpu_device_patches, initialize_cpu_model_parallel

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
    from .validation import MoKUnsupportedError

    main_entry = time.time()
    register()
    arguments = expand_arg_files(sys.argv[1:] if argv is None else list(argv))
    sys.argv = [sys.argv[0]] + arguments  # Megatron's parser reads sys.argv
    program_start = main_entry if program_start is None else program_start
    set_startup_timestamps(program_start=program_start, main_entry=main_entry)
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

    print_rank_0(f"> megatron-mok {__version__}: --moe-token-dispatcher-type "
                 f"{args.moe_token_dispatcher_type}" + (f", --mok-backend {args.mok_backend}"
                                                        if args.moe_token_dispatcher_type == "mok" else ""))
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    _use_prebuilt_dataset_helpers()
    run_pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 store=store, get_embedding_ranks=get_embedding_ranks)
    return 0
