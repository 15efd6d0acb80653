"""The ``reference`` backend: the pure-PyTorch oracle of the contract (``megatron_mok/reference.py``),
on any device and dtype, exchanging data with ``torch.distributed`` collectives. Slow on purpose."""

from __future__ import annotations

from typing import Optional

import torch

from ..reference import reference_moe
from .backend import CallSpec
from .groups import LocalEPRank
from .validate import check_expert_ids_on_host


class ReferenceBackend:
    """Runs wherever ``torch.distributed`` does, except on virtual ranks (one process)."""

    name = "reference"

    def unavailable_reason(self, spec: CallSpec) -> Optional[str]:
        if isinstance(spec.ep_group, LocalEPRank):
            return ("the reference backend exchanges data with torch.distributed collectives; "
                    "virtual ranks (LocalEPGroup) run only the GPU backends")
        return None

    def run(self, spec: CallSpec, x, topk_ids, topk_weights, fc1s, fc2s) -> torch.Tensor:
        """y [T, H] in x's dtype; weight segments are concatenated (a copy)."""
        check_expert_ids_on_host(topk_ids, spec.shape.experts_per_rank * spec.ep_size)
        fc1, fc2 = (fc1s[0], fc2s[0]) if len(fc1s) == 1 else (torch.cat(fc1s), torch.cat(fc2s))
        return reference_moe(x, topk_ids, topk_weights, fc1, fc2, ep_group=spec.ep_group,
                             tile_rows=spec.config.tile_rows)
