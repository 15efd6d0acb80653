"""Megatron's six-method token-dispatcher protocol for the MoK layer, step by step.

The MoK layer's own forward runs dispatch, experts and combine as one fused ``mok_moe`` call.
Code written against Megatron's staged interface (``MoELayer.preprocess`` / ``dispatch`` /
``routed_experts_compute`` / ``combine`` / ``postprocess``, which call ``dispatch_preprocess``
... ``combine_postprocess`` one at a time, with Megatron's expert module in between) still works
through :class:`MoKTokenDispatcher`, which follows the MoK dataflow with ordinary collectives:

1. ``dispatch_preprocess``: flatten the tokens, turn ``routing_map``/``probs`` into the top-k
   form (slots in ascending expert id);
2. ``token_dispatch``: all-gather tokens, top-k ids and weights over the EP group (the pull);
3. ``dispatch_postprocess``: select the routes to this rank's experts in the schedule order
   (local expert, then source rank, token, slot) and hand rows, per-expert counts and router
   weights to the expert module;
4. ``combine_preprocess``: put each expert output row into its (source token, slot);
5. ``token_combine``: reduce-scatter the slots back to the tokens' home ranks (the push; each
   slot is non-zero on exactly one rank, so the sum is exact);
6. ``combine_postprocess``: sum the K slots of each token in ascending slot order.

This path is for compatibility, not speed: it all-gathers every token. All ranks of the EP
group must hold the same number of tokens (as with Megatron's allgather dispatcher).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .routing import routing_to_topk

__all__ = ["MoKTokenDispatcher"]


class MoKTokenDispatcher(MoETokenDispatcher):
    """The MoK dataflow behind Megatron's staged dispatcher interface (see the module docstring).

    Args:
        num_local_experts: L, experts on this rank.
        local_expert_indices: global ids of this rank's experts (contiguous).
        config: the layer's ``TransformerConfig``.
        pg_collection: process groups (``ep`` is the expert-parallel group).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.first_local_expert = self.local_expert_indices[0]
        self.topk = config.moe_router_topk
        self.hidden_shape: Optional[torch.Size] = None
        self.topk_ids: Optional[torch.Tensor] = None
        self.routes: Optional[torch.Tensor] = None
        self.num_gathered_tokens = 0
        self.cudagraph_attrs = []

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return tensor
        return gather_from_sequence_parallel_region(tensor, group=self.ep_group)

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten the tokens and convert the routing to top-k form.

        Args:
            tokens: [S, B, H] (or [T, H]) hidden states of this rank.
            routing_map: [T, E] bool; probs: [T, E] router probabilities.

        Returns:
            (tokens [T, H], topk_weights [T, K] fp32); the top-k ids are kept for the next steps.
        """
        self.hidden_shape = tokens.shape
        tokens = tokens.reshape(-1, tokens.shape[-1])
        self.topk_ids, topk_weights = routing_to_topk(probs, routing_map, self.topk)
        return tokens, topk_weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """All-gather tokens [T, H] and top-k weights [T, K] (and ids) over the EP group.

        Returns:
            (tokens [P*T, H], topk_weights [P*T, K]) in source-rank order.
        """
        with torch.no_grad():
            self.topk_ids = self._gather(self.topk_ids)
        return self._gather(hidden_states), self._gather(probs)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Select the routes to this rank's experts, grouped by local expert.

        Within an expert, routes are in ascending (source rank, token, slot) order, the MoK
        schedule order.

        Returns:
            rows [R, H], tokens_per_expert int64 [L] (on the CPU, as Megatron's expert modules
            expect), router weights [R].
        """
        ids = self.topk_ids.reshape(-1)
        local = ids - self.first_local_expert
        mine = (ids >= 0) & (local >= 0) & (local < self.num_local_experts)
        flat_routes = torch.nonzero(mine).reshape(-1)
        order = torch.sort(local[flat_routes], stable=True).indices
        self.routes = flat_routes[order]
        self.num_gathered_tokens = hidden_states.shape[0]
        tokens_per_expert = torch.bincount(local[self.routes], minlength=self.num_local_experts).cpu()
        rows = hidden_states[self.routes // self.topk]
        weights = probs.reshape(-1)[self.routes]
        return rows, tokens_per_expert, weights

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Place each expert output row [R, H] into its (source token, slot).

        Returns:
            slots [P*T, K, H], zero where another rank's expert owns the slot.
        """
        slots = hidden_states.new_zeros((self.num_gathered_tokens * self.topk, hidden_states.shape[-1]))
        slots = slots.index_copy(0, self.routes, hidden_states)
        self.routes = None
        return slots.view(self.num_gathered_tokens, self.topk, -1)

    def token_combine(self, hidden_states: torch.Tensor):
        """Reduce-scatter the slots [P*T, K, H] to the home ranks: [T, K, H]."""
        if self.ep_size == 1:
            return hidden_states
        gathered, topk, hidden = hidden_states.shape
        flat = reduce_scatter_to_sequence_parallel_region(hidden_states.reshape(gathered, topk * hidden),
                                                          group=self.ep_group)
        return flat.view(-1, topk, hidden)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Sum the K slots of each token in ascending slot order and restore the input shape."""
        out = hidden_states[:, 0]
        for j in range(1, hidden_states.shape[1]):
            out = out + hidden_states[:, j]
        return out.reshape(self.hidden_shape)
