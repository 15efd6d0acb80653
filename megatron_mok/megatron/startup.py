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
   (:mod:`.peers`); then rank 0 prints how much memory the training ring reserves
   (:func:`training_ring_line`).

Everything fails before any process group or model exists, with one message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from ..config import training_ring_bytes
from ..functional.expert_ffn import hopper_gemms_apply
from .backend_choice import BackendChoice, choose_backend, layer_shape, model_dtype
from .peers import check_ep_domains_at_startup
from .settings import MoKLayerSettings
from .validation import check_supported, check_supported_args

__all__ = ["check_args_before_megatron", "check_job_after_megatron", "local_device", "TrainingRing",
           "tokens_per_rank", "moe_layer_count", "training_ring_of", "training_ring_line", "format_bytes"]


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
    if getattr(args, "rank", 0) == 0:
        print(training_ring_line(training_ring_of(args, config, settings, backend=choice.backend)), flush=True)
    return choice


@dataclass(frozen=True)
class TrainingRing:
    """What the training ring of one job holds (``MoKConfig.training_ring_rows``, resolved).

    Attributes:
        rows: rows kept per MoE layer and micro-batch (``MoKConfig.training_ring``).
        bytes_per_layer: ``training_ring_bytes(rows, H, I)``, bytes per MoE layer and micro-batch.
        moe_layers: MoE layers of the model (decoder and MTP, :func:`moe_layer_count`).
        tokens: T, tokens per rank of one micro-batch (:func:`tokens_per_rank`).
        topk: K, routed slots per token (plus the fused shared expert's).
        experts_per_rank: L, local experts (plus the fused shared expert's).
        tile_rows: the GEMM row-block height the default rounds to.
        configured: True when ``--mok-training-ring-rows`` set ``rows``, False for the default.
        keeps_every_row: None, or why the GPU backend keeps every row of the worst-case layout
            instead (then ``rows`` is that worst case, P x T x K + L x (tile_rows - 1)).
    """

    rows: int
    bytes_per_layer: int
    moe_layers: int
    tokens: int
    topk: int
    experts_per_rank: int
    tile_rows: int
    configured: bool
    keeps_every_row: Optional[str] = None

    @property
    def total_bytes(self) -> int:
        """Bytes of every MoE layer's ring for one micro-batch: ``bytes_per_layer * moe_layers``.
        With pipeline parallelism a stage holds the rings of its own layers for each micro-batch
        in flight, which under 1F1B on the first stage comes to about this sum."""
        return self.bytes_per_layer * self.moe_layers


def tokens_per_rank(args: Any) -> int:
    """T, the tokens one rank's MoE layer takes per micro-batch: seq_length x micro_batch_size,
    divided by the context-parallel size and, with sequence parallelism, by the tensor-parallel
    size (the MoK layer's input is this rank's [S / (CP x TP), B, H] slice)."""
    tokens = int(args.seq_length) * int(args.micro_batch_size)
    tokens //= max(1, int(getattr(args, "context_parallel_size", 1) or 1))
    if getattr(args, "sequence_parallel", False):
        tokens //= max(1, int(getattr(args, "tensor_model_parallel_size", 1) or 1))
    return tokens


def _moe_pattern(config: Any) -> List[int]:
    """1 for each decoder layer that is an MoE layer, 0 for a dense one (Megatron's reading of
    ``moe_layer_freq``: an int N marks every N-th layer from the first, a list marks each)."""
    layers = int(config.num_layers)
    if not getattr(config, "num_moe_experts", None):
        return [0] * layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    return [int(bool(v)) for v in freq]


def moe_layer_count(config: Any) -> int:
    """MoE layers of the model: the decoder layers ``moe_layer_freq`` marks, plus the MTP layers
    when the last decoder layer is an MoE layer (Megatron builds each MTP layer from the last
    decoder layer's spec)."""
    pattern = _moe_pattern(config)
    mtp = int(getattr(config, "mtp_num_layers", None) or 0)
    return sum(pattern) + (mtp if pattern and pattern[-1] else 0)


def training_ring_of(args: Any, config: Any, settings: MoKLayerSettings,
                     backend: Optional[str] = None) -> TrainingRing:
    """The training ring of the job: ``settings.config.training_ring`` for this rank's tokens
    per micro-batch (:func:`tokens_per_rank` of ``args``) and the MoE layer shape of ``config``
    (``TransformerConfig``: K, L and, with a fused shared expert, its slots and experts; H, I),
    with its bytes. When ``backend`` (the one the layers run) is a GPU backend and the shape is
    outside MoK's Hopper GEMMs, whose backward alone replays rows, the rows are the worst-case
    layout's instead, which that backend keeps."""
    tokens = tokens_per_rank(args)
    shape = layer_shape(config, settings, tokens=tokens)
    cfg = settings.config
    rows = cfg.training_ring(tokens=tokens, topk=shape.topk, experts_per_rank=shape.experts_per_rank)
    tile = 128 if backend == "megakernel" else cfg.tile_rows
    keeps_every_row = None
    if backend in ("megakernel", "cuda") and not hopper_gemms_apply(shape, tile):
        keeps_every_row = (f"hidden {shape.hidden}, expert FFN {shape.ffn_hidden}, tile rows {tile}: outside MoK's "
                           "Hopper GEMMs (H and I multiples of 256, tiles of 64 or 128 rows), whose backward "
                           "alone replays rows past a training ring")
        ep = max(1, int(getattr(config, "expert_model_parallel_size", None)
                        or getattr(args, "expert_model_parallel_size", None) or 1))
        rows = ep * tokens * shape.topk + shape.experts_per_rank * (tile - 1)
    return TrainingRing(rows=rows, bytes_per_layer=training_ring_bytes(rows, shape.hidden, shape.ffn_hidden),
                        moe_layers=moe_layer_count(config), tokens=tokens, topk=shape.topk,
                        experts_per_rank=shape.experts_per_rank, tile_rows=cfg.tile_rows,
                        configured=cfg.training_ring_rows is not None, keeps_every_row=keeps_every_row)


def format_bytes(count: int) -> str:
    """``count`` bytes in GiB from 1 GiB up, else MiB, with three significant digits below 1000
    (e.g. "1.21 GiB", "70.2 GiB", "824 MiB")."""
    unit, value = ("GiB", count / 2 ** 30) if count >= 2 ** 30 else ("MiB", count / 2 ** 20)
    digits = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{digits}f} {unit}"


def training_ring_line(ring: TrainingRing) -> str:
    """The start-up line rank 0 prints: the training ring's rows and bytes per MoE layer and
    micro-batch, the sum over the MoE layers, and where the rows come from. DeepSeek-V3 at EP 64
    (4096 tokens, top-8, 4 experts per rank, 58 + 1 MTP MoE layers): ``> megatron-mok: MoK
    training ring: 41216 rows per MoE layer and micro-batch (886 MiB; 59 MoE layers: 51.0 GiB held
    until their backward) [the default for ...]``."""
    layers = f"{ring.moe_layers} MoE layer{'' if ring.moe_layers == 1 else 's'}"
    if ring.keeps_every_row is not None:
        return (f"> megatron-mok: MoK keeps every routed row's activations for the backward: {ring.rows} rows "
                f"per MoE layer and micro-batch, the worst case ({format_bytes(ring.bytes_per_layer)}; {layers}: "
                f"{format_bytes(ring.total_bytes)}), not a training ring [{ring.keeps_every_row}]")
    if ring.configured:
        source = f"--mok-training-ring-rows {ring.rows}"
    else:
        source = (f"the default for {ring.tokens} tokens per rank, top-{ring.topk}, {ring.experts_per_rank} "
                  f"experts per rank; --mok-training-ring-rows sets it")
    replay = "; every row is replayed in the backward" if ring.rows == 0 else ""
    return (f"> megatron-mok: MoK training ring: {ring.rows} rows per MoE layer and micro-batch "
            f"({format_bytes(ring.bytes_per_layer)}; {layers}: {format_bytes(ring.total_bytes)} held until their "
            f"backward{replay}) [{source}]")
