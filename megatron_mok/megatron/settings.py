"""The settings of the MoK MoE layer that Megatron's ``TransformerConfig`` has no field for:
which backend runs ``mok_moe``, its tunables (:class:`megatron_mok.MoKConfig`) and whether the
shared expert is fused into the routed-expert call.

Where a layer finds them (attached to its config, else the ``--mok-*`` flags, else the
defaults) is :func:`megatron_mok.megatron.arguments.settings_for`; this module depends on no
other module of the integration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import MoKConfig
from ..functional.validate import BACKENDS

__all__ = ["MoKLayerSettings", "SETTINGS_ATTRIBUTE"]

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
            buffer, timeout, megakernel launch shape, ...); results do not depend on them.
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
