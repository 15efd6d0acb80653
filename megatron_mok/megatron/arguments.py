"""The ``--mok-*`` command-line flags and where a MoK layer finds its settings.

* :func:`add_mok_arguments` adds the flags to Megatron's argument parser (installed by
  :func:`megatron_mok.register`);
* :func:`settings_from_args` turns parsed flags into a :class:`MoKLayerSettings`;
* :func:`settings_for` gives the settings of a layer built from a ``TransformerConfig``, in this
  order: ``config.mok_settings`` when the code that built the config attached a
  :class:`MoKLayerSettings` (programmatic use, tests); else the flags of Megatron's parsed
  command line (``megatron.training.get_args()``), when the job was started through Megatron's
  parser with :func:`megatron_mok.register` installed; else the defaults (``backend="auto"``,
  every tunable chosen from the shape and the device).

Imports go one way: this module uses :mod:`.settings`, never the reverse.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from ..config import TRAINING_RING_MARGIN, MegakernelTunables, MoKConfig, MoKConfigError
from ..functional.validate import BACKENDS
from .settings import SETTINGS_ATTRIBUTE, MoKLayerSettings

__all__ = ["add_mok_arguments", "settings_from_args", "settings_for", "MOK_FLAGS"]

MOK_FLAGS = (
    "--mok-backend",
    "--mok-comm-sms",
    "--mok-comm-sms-forward",
    "--mok-comm-sms-backward",
    "--mok-minibatch-rows",
    "--mok-ring-rows",
    "--mok-training-ring-rows",
    "--mok-megakernel-pairs",
    "--mok-megakernel-group-blocks",
    "--mok-tile-rows",
    "--mok-timeout-s",
    "--mok-max-tokens-per-rank",
    "--mok-fuse-shared-expert",
)
"""Every flag :func:`add_mok_arguments` adds."""

_PAIRS = {"auto": None, "on": True, "off": False}
"""``--mok-megakernel-pairs`` value -> ``MegakernelTunables.pairs``."""


def add_mok_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``mok`` argument group to ``parser`` (once; a second call is a no-op).

    Every flag only matters with ``--moe-token-dispatcher-type mok``. Tunables left unset are
    chosen from the layer shape and the device (``MoKConfig.resolve``) or, for the megakernel's
    launch shape, taken from the library's defaults.
    """
    if any(a.dest == "mok_backend" for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="mok", description="MoK MoE layer (--moe-token-dispatcher-type mok): megatron-mok plugin"
    )
    group.add_argument("--mok-backend", choices=BACKENDS, default="auto",
                       help="Which implementation runs dispatch + experts + combine. 'auto' picks "
                            "the fastest available: the megakernel, else the CUDA backend on sm_90 "
                            "GPUs, else the pure-PyTorch reference (any device, slow).")
    group.add_argument("--mok-comm-sms", type=int, default=None,
                       help="SMs that only move data, forward and backward (default: from the "
                            "device: 10, at most a quarter of the SMs; `python -m megatron_mok.bench "
                            "tune` measures a shape). Overridden by the two flags below.")
    group.add_argument("--mok-comm-sms-forward", type=int, default=None,
                       help="Comm SMs of the forward kernels.")
    group.add_argument("--mok-comm-sms-backward", type=int, default=None,
                       help="Comm SMs of the backward kernels (checked, but no backend reads it yet: "
                            "the backward runs the cuda backend's kernels, which size their own grids).")
    group.add_argument("--mok-minibatch-rows", type=int, default=None,
                       help="Rows handed to the expert GEMMs at once (a multiple of "
                            "--mok-tile-rows; default: two GEMM waves per compute SM).")
    group.add_argument("--mok-ring-rows", type=int, default=None,
                       help="Rows of the ring token buffer (a multiple of the minibatch, at least "
                            "two minibatches; default: four minibatches).")
    group.add_argument("--mok-training-ring-rows", type=int, default=None, metavar="N",
                       help="Rows of the expert-grouped layout whose activations a forward with grad "
                            "keeps for the backward (x, router weight, gate|up: 2H + 4 + 4I bytes a "
                            "row); the backward replays the rows past it (a hot expert costs time, "
                            "never memory). A multiple of --mok-tile-rows; 0 replays every row. "
                            "Default (megatron_mok.config.default_training_ring_rows): the rows a "
                            "rank receives with uniform routing (T x K: T tokens per rank of a "
                            f"micro-batch, top-K) times {TRAINING_RING_MARGIN:g}, plus segment padding "
                            "for the L local experts, and never fewer than the rank's own T x K "
                            "routes can take with padding (one GPU never replays); rounded up to "
                            "tile rows. Results never depend on it: every value gives bitwise the "
                            "same output. Rank 0 logs the rows and bytes at start-up.")
    group.add_argument("--mok-megakernel-pairs", choices=tuple(_PAIRS), default="auto",
                       help="Run the megakernel in clusters of two CTAs that share each weight tile "
                            "(auto: the library's default, on, faster at every measured expert "
                            "load; `python -m megatron_mok.bench tune` measures both).")
    group.add_argument("--mok-megakernel-group-blocks", type=int, default=None, metavar="N",
                       help="Row blocks of a megakernel group: the tiles of one column sweep inside "
                            "a minibatch, whose CTAs share the weight tile in L2. An even number "
                            "from 2 to 64 (default: the library's, 8).")
    group.add_argument("--mok-tile-rows", type=int, default=128,
                       help="GEMM row-block height; expert segments are padded to it (GPU "
                            "backends: 64 or 128).")
    group.add_argument("--mok-timeout-s", type=float, default=60.0,
                       help="Seconds a rank waits for a peer before it raises an error naming it.")
    group.add_argument("--mok-max-tokens-per-rank", type=int, default=None,
                       help="Token capacity of the communication workspace per rank (default: "
                            "agreed by all ranks at the first call).")
    group.add_argument("--mok-fuse-shared-expert", action="store_true", default=False,
                       help="Compute the shared expert inside the MoK call as one more local "
                            "expert used by every token (needs tensor-parallel size 1 and a shared "
                            "intermediate size that is a multiple of --moe-ffn-hidden-size). "
                            "Default: Megatron's shared-expert module computes it.")
    return parser


def settings_from_args(args: Any) -> MoKLayerSettings:
    """The :class:`MoKLayerSettings` the parsed ``--mok-*`` flags describe (a flag missing from
    ``args`` takes its default).

    Raises:
        MoKConfigError: a tunable has a value MoK does not support (the message names the
            field, the value and the rule).
    """
    both = getattr(args, "mok_comm_sms", None)
    forward = getattr(args, "mok_comm_sms_forward", None)
    backward = getattr(args, "mok_comm_sms_backward", None)
    pairs = getattr(args, "mok_megakernel_pairs", None) or "auto"
    if pairs not in _PAIRS:
        raise MoKConfigError(f"--mok-megakernel-pairs {pairs!r} must be one of {', '.join(_PAIRS)}")
    megakernel = MegakernelTunables(
        pairs=_PAIRS[pairs],
        group_blocks=getattr(args, "mok_megakernel_group_blocks", None),
    )
    config = MoKConfig(
        comm_sms_forward=forward if forward is not None else both,
        comm_sms_backward=backward if backward is not None else both,
        minibatch_rows=getattr(args, "mok_minibatch_rows", None),
        ring_rows=getattr(args, "mok_ring_rows", None),
        training_ring_rows=getattr(args, "mok_training_ring_rows", None),
        tile_rows=getattr(args, "mok_tile_rows", 128),
        timeout_s=getattr(args, "mok_timeout_s", 60.0),
        max_tokens_per_rank=getattr(args, "mok_max_tokens_per_rank", None),
        megakernel=megakernel,
    )
    return MoKLayerSettings(
        backend=getattr(args, "mok_backend", "auto"),
        config=config,
        fuse_shared_expert=bool(getattr(args, "mok_fuse_shared_expert", False)),
    )


def _settings_from_megatron_args() -> Optional[MoKLayerSettings]:
    """The settings of the ``--mok-*`` flags, when Megatron's global args are set and carry them."""
    try:
        from megatron.training.global_vars import _GLOBAL_ARGS as args
    except ImportError:  # megatron.training is optional for megatron-core users
        return None
    if args is None or not hasattr(args, "mok_backend"):
        return None
    return settings_from_args(args)


def settings_for(config: Any) -> MoKLayerSettings:
    """The :class:`MoKLayerSettings` of a layer built from ``config`` (a ``TransformerConfig``):
    ``config.mok_settings`` if set, else the ``--mok-*`` command-line flags, else defaults.

    Raises:
        TypeError: ``config.mok_settings`` is set to something else than a MoKLayerSettings.
    """
    attached = getattr(config, SETTINGS_ATTRIBUTE, None)
    if attached is not None:
        if not isinstance(attached, MoKLayerSettings):
            raise TypeError(
                f"TransformerConfig.{SETTINGS_ATTRIBUTE} must be a MoKLayerSettings, got "
                f"{type(attached).__name__}"
            )
        return attached
    from_args = _settings_from_megatron_args()
    return from_args if from_args is not None else MoKLayerSettings()
