"""From Megatron's router output to MoK's top-k arrays.

Megatron's router returns dense ``probs`` and a boolean ``routing_map``, both [T, E]. MoK takes
``topk_ids`` [T, K] (int64) and ``topk_weights`` [T, K] (fp32). Within a token the K slots are
in ascending expert id, a fixed order that does not depend on the router's scores, and a token
with fewer than K chosen experts gets id -1 in its trailing slots. The weights are gathered from
``probs``, so the router-weight gradient flows back into Megatron's router (aux losses and
expert bias included).
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["routing_to_topk", "remap_for_fused_shared", "reverse_local_expert_ids"]


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Convert Megatron's routing to MoK's top-k form, without a host synchronisation.

    Args:
        probs: [T, E] router probabilities (any float dtype; zero where not routed).
        routing_map: [T, E] bool, True where token t is routed to expert e (at most ``topk``
            per token).
        topk: K, the number of slots per token.

    Returns:
        topk_ids: [T, K] int64, the routed experts of each token in ascending order, -1 for
            unused slots.
        topk_weights: [T, K] float32, ``probs`` at those experts (0 for unused slots);
            differentiable with respect to ``probs``.
    """
    num_experts = routing_map.shape[1]
    if topk > num_experts:
        raise ValueError(f"top-k {topk} is larger than the expert count {num_experts}")
    # Key E - e for a routed expert e, 0 otherwise: the K largest keys are the routed experts in
    # ascending id. The keys are distinct, so the selection does not depend on tie-breaking, and
    # they are exact in float32 for any realistic E.
    descending = torch.arange(num_experts, 0, -1, device=routing_map.device, dtype=torch.float32)
    keys = routing_map.to(torch.float32) * descending
    top_keys, _ = torch.topk(keys, topk, dim=1, sorted=True)
    valid = top_keys > 0
    ids = torch.where(valid, num_experts - top_keys.to(torch.int64), torch.full_like(top_keys, -1, dtype=torch.int64))
    gathered = probs.gather(1, ids.clamp(min=0)).to(torch.float32)
    weights = torch.where(valid, gathered, torch.zeros_like(gathered))
    return ids, weights


def remap_for_fused_shared(topk_ids: torch.Tensor, experts_per_rank: int, shared_per_rank: int) -> torch.Tensor:
    """Global routed-expert ids in the numbering that includes fused shared experts.

    With ``shared_per_rank`` shared experts appended to each rank's ``experts_per_rank`` routed
    experts, routed expert e = r * L + l becomes r * (L + S) + l; -1 stays -1.

    Args:
        topk_ids: [T, K] int64 routed ids in [0, E) or -1.
        experts_per_rank: L; shared_per_rank: S.

    Returns:
        [T, K] int64 ids in the numbering of L + S experts per rank.
    """
    width = experts_per_rank + shared_per_rank
    remapped = topk_ids // experts_per_rank * width + topk_ids % experts_per_rank
    return torch.where(topk_ids >= 0, remapped, topk_ids)


def reverse_local_expert_ids(topk_ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """Global expert ids with each rank's local experts numbered in reverse.

    Expert e = r * L + l becomes r * L + (L - 1 - l); -1 stays -1. Used when every EP rank
    hands ``mok_moe`` its expert weights stacked in reverse order (expert L - 1 first). The
    slots keep their order, so the fixed-order sum over a token's slots, and each expert's
    set of rows, are those of the unreversed call: the result is the same.

    Args:
        topk_ids: [T, K] int64 ids in [0, E) or -1.
        experts_per_rank: L.

    Returns:
        [T, K] int64 ids.
    """
    reversed_ids = topk_ids + (experts_per_rank - 1) - 2 * (topk_ids % experts_per_rank)
    return torch.where(topk_ids >= 0, reversed_ids, topk_ids)
