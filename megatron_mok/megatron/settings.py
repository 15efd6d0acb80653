"""The settings of the MoK MoE layer that Megatron's ``TransformerConfig`` has no field for:
which backend runs ``mok_moe``, its tunables (:class:`megatron_mok.MoKConfig`) and whether the
shared expert is fused into the routed-expert call.

A layer finds its settings, in this order:

1. ``config.mok_settings``, when the code that built the ``TransformerConfig`` attached a
   :class:`MoKLayerSettings` to it (programmatic use, tests);
2. Megatron's parsed command line (``megatron.training.get_args()``), when the job was started
   through Megatron's argument parser with :func:`megatron_mok.register` installed (the
   ``--mok-*`` flags, see :mod:`megatron_mok.megatron.arguments`);
3. the defaults: ``backend="auto"`` and every tunable chosen from the shape and the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import MoKConfig
from ..functional.validate import BACKENDS

__all__ = ["MoKLayerSettings", "settings_for", "SETTINGS_ATTRIBUTE"]

SETTINGS_ATTRIBUTE = "mok_settings"
"""Name of the optional ``TransformerConfig`` attribute holding a :class:`MoKLayerSettings`."""


@dataclass(frozen=True)
class MoKLayerSettings:
    """How the MoK MoE layer runs its routed experts.

    Attributes:
        backend: one of ``"auto"`` (the fastest backend that can run: the megakernel, else the
            CUDA backend on sm_90 GPUs, else the reference), ``"megakernel"``, ``"cuda"`` or
            ``"reference"`` (pure PyTorch, any device, slow).
        config: the tunables handed to every ``mok_moe`` call (comm SMs, minibatch, ring
            buffer, timeout, ...); results do not depend on them.
        fuse_shared_expert: when the model has a shared expert, run it inside the same
            ``mok_moe`` call as an extra local expert that every token of the rank uses (with
            weight 1, or the shared-expert gate). When False, Megatron's own shared-expert
            module computes it and its output is added, as Megatron does.
    """

    backend: str = "auto"
    config: MoKConfig = field(default_factory=MoKConfig)
    fuse_shared_expert: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"MoK backend {self.backend!r} is not one of {BACKENDS}")
        if not isinstance(self.config, MoKConfig):
            raise TypeError(f"MoKLayerSettings.config must be a MoKConfig, got {type(self.config).__name__}")

    def replace(self, **changes: Any) -> "MoKLayerSettings":
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def _settings_from_megatron_args() -> Optional[MoKLayerSettings]:
    """The settings of the ``--mok-*`` flags, when Megatron's global args are set and carry them."""
    try:
        from megatron.training.global_vars import _GLOBAL_ARGS as args
    except ImportError:  # megatron.training is optional for megatron-core users
        return None
    if args is None or not hasattr(args, "mok_backend"):
        return None
    from .arguments import settings_from_args

    return settings_from_args(args)


def settings_for(config: Any) -> MoKLayerSettings:
    """The :class:`MoKLayerSettings` of a layer built from ``config`` (a ``TransformerConfig``):
    ``config.mok_settings`` if set, else the ``--mok-*`` command-line flags, else defaults."""
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
