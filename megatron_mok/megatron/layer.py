"""The MoK MoE layer: Megatron's router feeding ``mok_moe`` (dispatch + experts + combine).

:class:`MoKMoELayer` is a ``MoELayer`` (``isinstance`` holds, so every Megatron code path that
special-cases MoE layers treats it as one) built from the same spec as Megatron's: the same
router, the same expert module (``SequentialMLP`` or ``TEGroupedMLP``) and shared-expert module,
hence the same parameter names, shapes, initialisation, gradient buffers and
``sharded_state_dict``. Only the token dispatcher differs: the forward runs one fused
``mok_moe`` call on the expert weights instead of dispatcher + expert module + dispatcher.

Forward, for hidden states [S, B, H] of this rank (T = S * B tokens):

1. shared expert (Megatron's module, unless fused), as ``MoELayer`` does;
2. ``probs, routing_map = router(x)`` ([T, E] each; aux losses and expert bias as usual);
3. ``topk_ids, topk_weights`` [T, K] in ascending expert id (:mod:`.routing`);
4. ``y = mok_moe(x, topk_ids, topk_weights, fc1 [L, 2I, H], fc2 [L, H, I], ep_group)``;
   with a fused shared expert, each rank's shared expert is appended to its local experts and
   every token gets extra slots for it (weight 1, or the shared-expert gate);
5. ``y + shared`` reshaped to [S, B, H]; the bias output is None.

The expert module's per-expert parameters are moved into one [L, 2I, H] and one [L, H, I]
buffer when the layer is built (and again after a ``.to()``/``.cuda()`` that gives them new
storage), so step 4 reads them through an alias of that storage, without a copy, while they
stay stacked; see :mod:`.stacking` and :meth:`MoKMoELayer._expert_weights`.

Megatron's staged methods (``preprocess``, ``dispatch``, ``routed_experts_compute``, ``combine``,
``postprocess``) keep working through :class:`~.dispatcher.MoKTokenDispatcher`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core import tensor_parallel, utils
from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import MoECudaGraphTensorStore, get_default_pg_collection
from megatron.core.typed_torch import not_none

from ..functional import mok_moe
from .arguments import settings_for
from .dispatcher import MoKTokenDispatcher
from .experts import local_expert_weights, run_forward_pre_hooks, shared_expert_weights
from .backend_choice import choose_backend, describe_layer_choice, model_dtype
from .peers import check_ep_group
from .routing import remap_for_fused_shared, reverse_local_expert_ids, routing_to_topk
from .settings import MoKLayerSettings
from .stacking import REVERSED, expert_layout, stack_expert_storage, stack_experts
from .validation import check_supported, ignored_settings

__all__ = ["MoKMoELayer", "MOK_DISPATCHER_TYPE"]

MOK_DISPATCHER_TYPE = "mok"
"""The value of ``--moe-token-dispatcher-type`` / ``TransformerConfig.moe_token_dispatcher_type``
that selects this layer."""

_NOTES_PRINTED: set = set()
"""Notes about ignored settings already printed by this process (one line per job, not per layer)."""


def print_first_rank_of_stage(message: str) -> None:
    """Print ``message`` on the first rank of each pipeline stage (tensor-, context- and
    data-parallel rank 0: global rank 0 without pipeline parallelism, as Megatron's
    ``print_rank_0``), with ``print`` so that any ``--logging-level`` shows it."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            first = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                     and ps.get_data_parallel_rank() == 0)
        else:
            first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    except (ImportError, AssertionError, RuntimeError):
        first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if first:
        print(message, flush=True)


class MoKMoELayer(MoELayer):
    """Megatron ``MoELayer`` whose routed experts run through ``mok_moe``.

    Built like ``MoELayer`` (same arguments, same submodules); ``MoELayer(config, ...)`` with
    ``config.moe_token_dispatcher_type == "mok"`` returns one once :func:`megatron_mok.register`
    has run. Its settings (backend, tunables, fused shared expert) come from
    :func:`~.arguments.settings_for`.

    Raises (at construction):
        MoKUnsupportedError: the config asks for something MoK does not do (listed, with reasons).
        EPTopologyError: a GPU backend would run on an EP group that is not one NVLink domain.
        BackendUnavailable: ``--mok-backend cuda``/``megakernel`` cannot run here, or
            ``auto`` on a CUDA device where no GPU backend can run the layer
            (``MoKBackendError``: dtype, architecture, shape; ``--mok-backend reference``
            runs the slow path on purpose).

    At construction the first rank of each pipeline stage prints which backend the layer runs
    and why (:mod:`.backend_choice`).
    """

    def __init__(
        self,
        config,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
    ):
        self.mok_settings: MoKLayerSettings = settings_for(config)
        check_supported(config, self.mok_settings)
        # The backend this layer runs, decided now (not at the first forward): an explicitly
        # requested backend that cannot run, or auto where no GPU backend can, fails here.
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        dtype = model_dtype(config)
        self.mok_backend_choice = choose_backend(config, self.mok_settings, device=device, dtype=dtype)
        self.submodules = not_none(submodules)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        # MoELayer.__init__ rejects dispatcher types it does not know, so the layer is assembled
        # here from the same parts, in the same order (router, experts, shared experts).
        BaseMoELayer.__init__(self, config=config, layer_number=layer_number,
                              pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.moe_layer_recompute = (
            config.recompute_granularity == "selective"
            and "moe" in (config.recompute_modules or [])
            and config.cuda_graph_impl != "local"
        )
        self.shared_experts_recompute = (
            config.recompute_granularity == "selective"
            and "shared_experts" in (config.recompute_modules or [])
        )
        self.tp_group = pg_collection.tp
        self.router = self.submodules.router(config=self.config, pg_collection=pg_collection,
                                             is_mtp_layer=is_mtp_layer)
        self.token_dispatcher = MoKTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                   config=self.config, pg_collection=pg_collection)
        self.experts = self.submodules.experts(
            self.num_local_experts, self.config, pg_collection=pg_collection,
            name=(name + ".experts") if name is not None else None,
        )
        # One [L, 2I, H] and one [L, H, I] buffer behind the per-expert parameters (same
        # parameter objects and values), so the forward reads them without a copy.
        stack_expert_storage(self.experts, self.num_local_experts)
        # Expert order of the stacked weights (see _expert_weights): what this rank's layout
        # prefers, and what the EP group agreed on for that preference.
        self._mok_prefers_reversed: Optional[bool] = None
        self._mok_reversed = False
        if self.use_shared_expert:
            if self.submodules.shared_experts is None:
                raise ValueError("the MoE spec has no shared-expert builder, but "
                                 "moe_shared_expert_intermediate_size is set")
            self.shared_experts = self.submodules.shared_experts(
                config=self.config, pg_collection=pg_collection, gate=self.config.moe_shared_expert_gate,
                name=(name + ".shared_experts") if name is not None else None,
            )
        self.fused_shared = self.use_shared_expert and self.mok_settings.fuse_shared_expert
        self.cudagraph_tensor_store = MoECudaGraphTensorStore()
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]
        self.setup_delayed_wgrad_for_dispatch_backward_overlap()

        self.ep_size = utils.get_pg_size(self.ep_group)
        # A GPU backend needs the EP group in one NVLink domain (checked once per group; at
        # argument validation already when the job was started by torchrun).
        if self.mok_backend_choice.backend != "reference" and self.ep_size > 1:
            check_ep_group(self.ep_group)
        for note in ignored_settings(config):
            if note not in _NOTES_PRINTED:
                _NOTES_PRINTED.add(note)
                print_first_rank_of_stage(note)
        # The start-up line: once the layer knows its number (TransformerLayer sets it right
        # after building the MLP; a layer built with a number prints now).
        self._mok_announce_facts = (device, dtype, is_mtp_layer)
        self._mok_announced = None
        if layer_number is not None:
            self._announce_backend(layer_number)

    def _announce_backend(self, layer_number) -> None:
        """Print which backend this layer runs and why (once per layer number)."""
        if layer_number == self._mok_announced:
            return
        self._mok_announced = layer_number
        device, dtype, is_mtp_layer = self._mok_announce_facts
        print_first_rank_of_stage(describe_layer_choice(
            self.mok_backend_choice, self.config, self.mok_settings, layer_number=layer_number,
            is_mtp_layer=is_mtp_layer, device=device, dtype=dtype))

    def set_layer_number(self, layer_number: int):
        """Megatron's ``set_layer_number`` (the router learns it too), then the start-up line
        saying which backend this layer runs and why."""
        super().set_layer_number(layer_number)
        self._announce_backend(layer_number)

    # ------------------------------------------------------------------------------------------
    # The fused path.

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.bfloat16()``, ``to_empty()``), then,
        if that gave the expert parameters new storage (a device or dtype conversion makes one
        tensor per parameter), stack them again. A conversion that keeps their storage (e.g.
        ``.cuda()`` of parameters already on the GPU, as Megatron's ``get_model`` does) leaves
        them alone, so a layout made by Megatron's DDP is never touched."""
        experts = self._modules.get("experts")
        before = self._expert_data_ptrs(experts)
        result = super()._apply(fn, recurse)
        if experts is not None and recurse and self._expert_data_ptrs(experts) != before:
            stack_expert_storage(experts, self.num_local_experts)
        return result

    def _expert_data_ptrs(self, experts):
        if experts is None:
            return None
        try:
            fc1, fc2 = local_expert_weights(experts, self.num_local_experts)
            return [w.data_ptr() for w in fc1 + fc2]
        except (TypeError, RuntimeError):
            return None

    def _expert_weights(self):
        """fc1 and fc2 of this rank's experts, the number of fused shared experts, and whether the
        local experts are stacked in reverse order (expert L - 1 first; the caller renumbers the
        top-k ids to match).

        Returns:
            (fc1, fc2, shared, reverse): fc1 [L, 2I, H] and fc2 [L, H, I] (routed experts); with
            the fused shared expert, two weight segments each, (routed [L, 2I, H], shared
            [n, 2I, H]) and (routed [L, H, I], shared [n, H, I]), which ``mok_moe`` reads where
            they lie.

        Routed experts are views of the parameters' storage, without a copy, when the
        parameters lie stacked in it: in order (as built by this layer, kept by Megatron's DDP
        without the distributed optimizer), or in reverse order (Megatron's distributed
        optimizer puts ``TEGroupedMLP``'s weights into its parameter buffer that way) provided
        every EP rank's layout allows it. Any other layout costs one ``torch.stack`` copy. The
        fused shared expert is its parameters themselves when it is one expert's size
        (``moe_shared_expert_intermediate_size`` = ``moe_ffn_hidden_size``: DeepSeek-V3,
        Kimi-K2), else a copy of its n expert-sized slices.
        """
        # The expert modules' forward is never called: run their forward pre-hooks (Megatron's
        # DDP waits for their parameters' all-gather there with --overlap-param-gather).
        run_forward_pre_hooks(self.experts)
        if self.fused_shared:
            run_forward_pre_hooks(self.shared_experts)
        fc1, fc2 = local_expert_weights(self.experts, self.num_local_experts)
        sh1, sh2 = ([], [])
        if self.fused_shared:
            sh1, sh2 = shared_expert_weights(self.shared_experts, self.config.moe_ffn_hidden_size)
        layout1, layout2 = expert_layout(fc1), expert_layout(fc2)
        reverse = self._reversed_expert_order(layout1, layout2, fc1[0].device)
        routed1, routed2 = stack_experts(fc1, layout1, reverse), stack_experts(fc2, layout2, reverse)
        if not self.fused_shared:
            return routed1, routed2, 0, reverse
        shared1, shared2 = stack_experts(sh1, expert_layout(sh1)), stack_experts(sh2, expert_layout(sh2))
        return (routed1, shared1), (routed2, shared2), len(sh1), reverse

    def _reversed_expert_order(self, layout1, layout2, device) -> bool:
        """Whether to stack the local experts in reverse order.

        This rank prefers it when its fc1 weights (or, if those are not stacked, its fc2
        weights) lie in reverse order. The expert order changes the top-k ids that every rank
        sends, so it must be the same on all EP ranks: whenever this rank's preference changes
        (first forward; after Megatron's DDP has moved the parameters into its buffer) the EP
        group agrees with one all-reduce (reverse only if every rank prefers it). That is one
        tiny collective and host sync per layer per layout change, none in a steady state. All
        EP ranks of a layer see the same layout changes at the same forward (they build the
        same module and DDP lays out the same parameter list the same way); a rank whose
        parameters were moved on its own would wait in that all-reduce.
        """
        prefers = layout1 == REVERSED or (layout1 is None and layout2 == REVERSED)
        if prefers is not self._mok_prefers_reversed:
            agreed = prefers
            if self.ep_size > 1:
                flag = torch.tensor([int(prefers)], dtype=torch.int32, device=device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.ep_group)
                agreed = bool(flag.item())
            self._mok_prefers_reversed, self._mok_reversed = prefers, agreed
        return self._mok_reversed

    def _shared_slots(self, tokens: torch.Tensor, shared: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k columns of the fused shared experts: ids [T, n] of this rank's shared experts
        and weights [T, n] (1, or the shared-expert gate)."""
        ep_rank = utils.get_pg_rank(self.ep_group)
        width = self.num_local_experts + shared
        first = ep_rank * width + self.num_local_experts
        ids = torch.arange(first, first + shared, device=tokens.device, dtype=torch.int64)
        ids = ids.expand(tokens.shape[0], shared)
        gate_weight = getattr(self.shared_experts, "gate_weight", None)
        if gate_weight is not None:
            gate = torch.sigmoid(torch.nn.functional.linear(tokens, gate_weight)).to(torch.float32)
            weights = gate.expand(tokens.shape[0], shared)
        else:
            weights = torch.ones((tokens.shape[0], shared), device=tokens.device, dtype=torch.float32)
        return ids, weights

    def mok_experts(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Routed experts (and the fused shared expert) of this rank's tokens, one ``mok_moe`` call.

        Args:
            hidden_states: [S, B, H] (or [T, H]) tokens of this rank.
            probs: [T, E] router probabilities; routing_map: [T, E] bool.

        Returns:
            [S, B, H] (the input's shape) in the input's dtype.
        """
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        topk_ids, topk_weights = routing_to_topk(probs, routing_map, self.config.moe_router_topk)
        fc1, fc2, shared, reverse = self._expert_weights()
        if reverse:
            topk_ids = reverse_local_expert_ids(topk_ids, self.num_local_experts)
        if shared:
            shared_ids, shared_weights = self._shared_slots(tokens, shared)
            topk_ids = torch.cat([remap_for_fused_shared(topk_ids, self.num_local_experts, shared), shared_ids], 1)
            topk_weights = torch.cat([topk_weights, shared_weights], 1)
        output = mok_moe(
            tokens, topk_ids, topk_weights, fc1, fc2,
            ep_group=self.ep_group if self.ep_size > 1 else None,
            config=self.mok_settings.config,
            backend=self.mok_settings.backend,
            main_grads=self._fused_main_grads(reverse),
        )
        return output.reshape(shape)

    def _fused_main_grads(self, reverse: bool):
        """Megatron's gradient-accumulation fusion for the expert weights: (fc1 main_grads, fc2
        main_grads) in the order of the stacked weights, for ``mok_moe`` to accumulate into in
        fp32, each parameter marked ``grad_added_to_main_grad`` so that Megatron's DDP skips its
        own add; or None (bf16 gradients, which DDP adds) when ``gradient_accumulation_fusion`` is
        off, nothing needs a gradient, or a weight has no fp32 ``main_grad`` of its own shape (the
        first such call prints why, once per job)."""
        if not (getattr(self.config, "gradient_accumulation_fusion", False) and torch.is_grad_enabled()):
            return None
        fc1, fc2 = local_expert_weights(self.experts, self.num_local_experts)
        if reverse:
            fc1, fc2 = fc1[::-1], fc2[::-1]
        why = None
        if self.fused_shared:
            sh1, sh2 = self.shared_experts.linear_fc1.weight, self.shared_experts.linear_fc2.weight
            if sh2.shape[1] != self.config.moe_ffn_hidden_size:
                why = (f"the fused shared expert ({sh2.shape[1]} channels) runs as copies of "
                       f"{self.config.moe_ffn_hidden_size}-channel slices, whose gradients are not main_grad views")
            fc1, fc2 = list(fc1) + [sh1], list(fc2) + [sh2]
        params = list(fc1) + list(fc2)
        if not any(p.requires_grad for p in params):
            return None
        if why is None:
            for p in params:
                mg = getattr(p, "main_grad", None)
                if not isinstance(mg, torch.Tensor) or mg.dtype != torch.float32 or mg.shape != p.shape:
                    why = ("an expert weight has no fp32 main_grad of its shape "
                           f"({None if mg is None else (mg.dtype, tuple(mg.shape))})")
                    break
                if getattr(p, "zero_out_wgrad", False):
                    why = "an expert weight asks for zeroed weight gradients (zero_out_wgrad)"
                    break
        note = ("MoK: expert weight gradients accumulate into main_grad in fp32 inside the weight-gradient "
                "kernel (gradient-accumulation fusion)" if why is None else
                f"MoK: expert weight gradients are returned in bf16 and added into main_grad by DDP: {why}")
        if note not in _NOTES_PRINTED:
            _NOTES_PRINTED.add(note)
            print_first_rank_of_stage(note)
        if why is not None:
            return None
        for p in params:
            p.grad_added_to_main_grad = True
        return [p.main_grad for p in fc1], [p.main_grad for p in fc2]

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        """MoE forward: [S, B, H] -> ([S, B, H], None).

        Runs the fused MoK path. Calls that resume a partially captured layer
        (``intermediate_tensors``) take Megatron's staged path through the MoK dispatcher.
        """
        if intermediate_tensors is not None or self.fwd_execution_map != ["route", "expert_compute", "postprocess"]:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError(
                "During training, MoE with tensor parallelism needs sequence parallelism "
                "(--sequence-parallel), as in Megatron's MoE layer."
            )
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def fused_forward(hidden_states, padding_mask=None):
            shared_output = None if self.fused_shared else self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            output = self.mok_experts(hidden_states, probs, routing_map)
            if shared_output is not None:
                output = output + shared_output
            return output, None

        if self.moe_layer_recompute and self.training:
            return tensor_parallel.checkpoint(fused_forward, False, hidden_states, padding_mask)
        return fused_forward(hidden_states, padding_mask)
