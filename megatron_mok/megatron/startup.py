"""What ``validate_args`` checks for ``--moe-token-dispatcher-type mok`` (installed by
:func:`megatron_mok.register`), in two steps around Megatron's own validation:

1. :func:`check_args_before_megatron`, on the parsed command line before Megatron validates it:
   every setting MoK refuses or replaces (:mod:`.validation`), so that the user reads MoK's
   reason and advice rather than the assertion Megatron raises for a dispatcher that is not
   alltoall/flex (``--moe-shared-expert-overlap``, ``--overlap-moe-expert-parallel-comm``,
   ``--moe-enable-deepep``, ``--recompute-modules moe_act`` without grouped GEMM, ...);
2. :func:`check_job_after_megatron`, on the ``TransformerConfig`` Megatron builds from the
   validated arguments: the same settings check the layer runs at construction, the backend the
   MoE layers will run (:mod:`.backend_choice`: auto with no GPU backend that can run them
   fails here, saying why), and, when a GPU backend will run, the EP groups' NVLink domain
   (:mod:`.peers`).

Everything fails before any process group or model exists, with one message.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .backend_choice import BackendChoice, choose_backend, model_dtype
from .peers import check_ep_domains_at_startup
from .settings import MoKLayerSettings
from .validation import check_supported, check_supported_args

__all__ = ["check_args_before_megatron", "check_job_after_megatron", "local_device"]


def check_args_before_megatron(args: Any, settings: MoKLayerSettings) -> None:
    """Raise :class:`~.validation.MoKUnsupportedError` for every setting of the parsed command
    line that MoK does not support, before Megatron's ``validate_args`` runs."""
    check_supported_args(args, settings)


def local_device() -> Optional[torch.device]:
    """The CUDA device this rank will use (``LOCAL_RANK``, as Megatron's initialisation picks
    it), or None on a machine without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def check_job_after_megatron(args: Any, config: Any, settings: MoKLayerSettings) -> BackendChoice:
    """After Megatron's ``validate_args``: the settings check on the ``TransformerConfig``, the
    backend the MoE layers will run on this rank's GPU, and the EP groups' NVLink domain.

    Returns:
        The backend choice (on a machine without a GPU: what can be said without one).

    Raises:
        MoKUnsupportedError, MoKBackendError, BackendUnavailable, EPTopologyError: with the
            setting, why and what to do.
    """
    check_supported(config, settings)
    device = local_device()
    choice = choose_backend(config, settings, device=device, dtype=model_dtype(config))
    if device is not None and choice.backend != "reference":
        check_ep_domains_at_startup(args)
    return choice
