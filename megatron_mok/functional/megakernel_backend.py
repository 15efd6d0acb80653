"""The ``megakernel`` backend: the layer forward in one persistent kernel launch per MoE layer
(after the schedule kernel), the backward with the ``cuda`` backend's kernels on activations the
launch writes.

Validated on H200s (P = 1, virtual ranks, P = 2: tests/test_megakernel.py). ``auto`` (the
default) and ``backend="megakernel"`` (``--mok-backend megakernel``) take it whenever the shape
allows (:func:`unsupported_reason`).

Forward, on every rank:

1. the ``cuda`` backend's prologue in one host call (``Workspace.dispatch``): publish x,
   topk_ids, topk_weights into the workspace, barrier, schedule (``mok_build_schedule``);
2. ``mok::megakernel_forward`` (eagerly ``launch_forward``: the backend checked its arguments
   when it prepared the (config, shape), ``Workspace.prepared_calls``): comm CTAs pull the
   routed token rows into a fixed-size ring, minibatch by minibatch; compute CTAs run fc1 +
   SwiGLU (router weight applied per row) and fc2 tile by tile as soon as a row block has
   landed, fc2's epilogue storing the output rows into their home ranks' (token, slot); ring
   slots are reused once their fc2 tiles are done; a combine-done flag exchange, then the
   fixed-order sum over the top-k slots. Memory: the ring, ``ring_rows * (H + I) * 2
   + ring_rows * 4`` bytes plus the counters, fixed by the config whatever the routing.

Backward: when the call needs one, the launch also writes the activations the ``cuda``
backend's backward reads (the pulled rows, their router weights and the fc1 pre-activation, at
their expert-grouped layout rows: the same buffers and sizes as the ``cuda`` backend keeps), and
the backward is ``_CudaMoE.backward`` on them. A forward without grad keeps nothing.
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, Optional, Tuple

import torch

from ..config import MoKConfig, MoKConfigError
from ..ops import megakernel as mk_ops
from . import cuda_backend
from .groups import EPGroup, LocalEPRank, group_size_rank
from .validate import MoEShape
from .workspace import Workspace, get_workspace

TRACE_ENV = "MOK_MEGAKERNEL_TRACE"
"""When "1", every forward launch records its timeline (read it with :func:`last_trace`)."""

_last_trace: Dict[str, object] = {}


def last_trace() -> Dict[str, object]:
    """The timeline of this process's last traced forward launch (``MOK_MEGAKERNEL_TRACE=1``):
    ``records`` int64 [N, 6] on the device (``mk_ops.TRACE_FIELDS``; unwritten records are 0)
    and the launch's ``minibatch_rows``, ``ring_rows``, ``comm_ctas``, ``hidden``,
    ``ffn_hidden``. Empty when nothing was traced."""
    return dict(_last_trace)

BLOCK_ROWS = mk_ops.BLOCK_ROWS


def unsupported_reason(shape: MoEShape, config: MoKConfig, ep_size: int) -> Optional[str]:
    """Why the megakernel does not take this call, or None. Reads no device state (the
    device-dependent rules, comm SMs against the SM count, are checked by
    :func:`resolve_tunables` before any GPU work)."""
    if config.tile_rows != BLOCK_ROWS:
        return (f"tile_rows={config.tile_rows}; the megakernel's row blocks are {BLOCK_ROWS} rows "
                "(the cuda backend takes 64)")
    if shape.hidden % mk_ops.FC2_COLS:
        return f"hidden size {shape.hidden} is not a multiple of {mk_ops.FC2_COLS} (the fc2 tile's columns)"
    if shape.ffn_hidden % mk_ops.FC1_COLS:
        return (f"expert FFN size {shape.ffn_hidden} is not a multiple of {mk_ops.FC1_COLS} "
                "(the fc1 tile's h columns)")
    if shape.experts_per_rank > mk_ops.MAX_EXPERTS:
        return f"{shape.experts_per_rank} experts per rank exceed the megakernel's {mk_ops.MAX_EXPERTS}"
    if shape.topk > mk_ops.MAX_TOPK:
        return f"top-k {shape.topk} exceeds the megakernel's {mk_ops.MAX_TOPK}"
    return cuda_backend.unsupported_reason(shape, config)  # the backward runs the cuda backend


def sm_share(device: torch.device, ep_group: EPGroup) -> int:
    """SMs one rank's launch may use: all of the device's, or an equal share for each virtual
    rank of a :class:`LocalEPGroup` (their persistent kernels run at the same time and wait on
    each other, so each must fit beside the others)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    P, _ = group_size_rank(ep_group)
    return sms // P if isinstance(ep_group, LocalEPRank) else sms


@functools.lru_cache(maxsize=256)
def resolve_tunables(config: MoKConfig, shape: MoEShape, ep_size: int, num_sms: int) -> MoKConfig:
    """``config`` with its ``None`` tunables chosen (:meth:`MoKConfig.resolve`) for a launch of
    ``num_sms`` CTAs, checked against the megakernel's rules. Cached: every layer of a model
    asks the same question on every call.

    Raises:
        MoKConfigError: naming the tunable, its value and the rule.
    """
    if num_sms < 3:
        raise MoKConfigError(f"the megakernel needs at least 3 SMs (two pulling, one computing), "
                             f"this launch has {num_sms}")
    resolved = config.resolve(hidden=shape.hidden, ffn_hidden=shape.ffn_hidden, num_sms=num_sms, ep_size=ep_size,
                              rows_per_expert=rows_per_expert(shape))
    if resolved.minibatch_rows % BLOCK_ROWS:
        raise MoKConfigError(f"MoKConfig.minibatch_rows={resolved.minibatch_rows} must be a multiple of "
                             f"the megakernel's {BLOCK_ROWS}-row blocks")
    if resolved.ring_rows % resolved.minibatch_rows or resolved.ring_rows < 2 * resolved.minibatch_rows:
        raise MoKConfigError(
            f"MoKConfig.ring_rows={resolved.ring_rows} must be a multiple of minibatch_rows="
            f"{resolved.minibatch_rows} and at least two minibatches ({2 * resolved.minibatch_rows})")
    return resolved


PAIRS_BY_DEFAULT = True
"""Pair mode (clusters of two CTAs sharing each weight tile, docs/megakernel.md) is asked for
in every regime unless ``MoKConfig.megakernel_pairs`` says otherwise. Timed with each mode in
its own steady state (blocks A B B A after 100 untimed calls; the card runs at its power cap)
pairs were faster at every load: -0.30 / -0.14 / -0.21 ms at 192 / 48 / 6 experts per GPU
without grad, -0.47 / -0.19 ms at 192 / 6 with it (docs/perf-notes.md, twelfth session). Until
then it was asked for only at most 256 rows per expert: call-by-call timings, where both modes
run at the clock the previous call left, had found it 0.2-1.7% slower at 48 and 6 per GPU."""


def rows_per_expert(shape: MoEShape) -> float:
    """Mean routed rows a rank's local expert receives: tokens x top-k / local experts (every
    rank sends T x K rows, spread over the E = P x L experts)."""
    return shape.tokens * shape.topk / shape.experts_per_rank


def use_pairs(config: Optional[MoKConfig] = None) -> bool:
    """Whether the launch asks for pair mode: ``config.megakernel_pairs`` when set, else
    :data:`PAIRS_BY_DEFAULT`."""
    if config is not None and config.megakernel_pairs is not None:
        return config.megakernel_pairs
    return PAIRS_BY_DEFAULT


def ring_bytes(ring_rows: int, hidden: int, ffn_hidden: int) -> int:
    """Device memory of the ring (x / out rows, h rows, router weights), without the counters."""
    return ring_rows * (hidden + ffn_hidden) * 2 + ring_rows * 4


@dataclass
class _Ring:
    """One rank's ring and counters (local device memory, reused by every layer and call)."""

    x: torch.Tensor         # bf16 [ring_rows, H]
    h: torch.Tensor         # bf16 [ring_rows, I]
    w: torch.Tensor         # fp32 [ring_rows]
    counters: torch.Tensor  # int32 [counter_words(ring_rows)], reset by the kernel's first launch


_rings: "weakref.WeakKeyDictionary[Workspace, Dict[Tuple[int, int], _Ring]]" = weakref.WeakKeyDictionary()


def get_ring(ws: Workspace, ring_rows: int, ffn_hidden: int) -> _Ring:
    """The ring of workspace ``ws`` for ``ring_rows`` rows and FFN size I (created once).
    Like the workspace, it serves every layer: calls on one rank run one after another."""
    per_ws = _rings.setdefault(ws, {})
    key = (ring_rows, ffn_hidden)
    if key not in per_ws:
        dev = ws.device
        per_ws[key] = _Ring(
            x=torch.empty((ring_rows, ws.layout.hidden), dtype=torch.bfloat16, device=dev),
            h=torch.empty((ring_rows, ffn_hidden), dtype=torch.bfloat16, device=dev),
            w=torch.empty((ring_rows,), dtype=torch.float32, device=dev),
            counters=torch.zeros((mk_ops.counter_words(ring_rows),), dtype=torch.int32, device=dev))
    return per_ws[key]


@dataclass(frozen=True)
class _Launch:
    """What every call of one (config, shape) on one workspace launches with (no reference to the
    workspace, which keeps these in :attr:`Workspace.prepared_calls`)."""

    ring: _Ring
    config: MoKConfig       # resolved
    num_ctas: int
    timeout_s: float
    pairs: bool             # ask for clusters of two CTAs (use_pairs)
    comm_ctas_no_grad: int  # comm CTAs of a launch that saves no activations (forward_comm_sms)
    num_experts: int        # E = P x L
    hopper_gemms: bool      # the backward's GEMMs (cuda_backend.hopper_gemms_apply)
    fused_swiglu: tuple     # (cuda_backend.fused_swiglu_apply)


@dataclass(frozen=True)
class _Call:
    ws: Workspace
    launch: _Launch
    cuda_call: cuda_backend._Call  # the backward's


def _run_forward(x, topk_ids, topk_weights, fc1, fc2, call: _Call, fc1_2, fc2_2, training: bool):
    """The forward launch (prologue, then the persistent kernel). Returns ``(y, saved)``: y bf16
    [T, H]; saved: the schedule and the activations the backward reads when ``training``, else
    None."""
    ws, launch = call.ws, call.launch
    ring, cfg = launch.ring, launch.config
    comm_ctas = cfg.comm_sms_forward if training else launch.comm_ctas_no_grad
    ws.raise_if_failed(launch.timeout_s)
    table, counts, offsets, _ = ws.dispatch(x, topk_ids, topk_weights, cuda_backend.SITE_FWD_DISPATCH,
                                            launch.timeout_s, BLOCK_ROWS)
    trace = None
    if os.environ.get(TRACE_ENV) == "1":
        H, I = fc2.shape[1], fc2.shape[2]
        trace = torch.zeros((mk_ops.trace_records(table.shape[0], H, I), len(mk_ops.TRACE_FIELDS)),
                            dtype=torch.int64, device=x.device)
        _last_trace.update(records=trace, minibatch_rows=cfg.minibatch_rows, ring_rows=cfg.ring_rows,
                           comm_ctas=comm_ctas, hidden=H, ffn_hidden=I, num_ctas=launch.num_ctas,
                           pairs=launch.pairs)
    saved = (None, None, None)
    if training:  # the cuda backend's activations, written by the launch
        R, H, two_i = table.shape[0], fc1.shape[2], fc1.shape[1]
        saved = (torch.empty((R, H), dtype=torch.bfloat16, device=x.device),
                 torch.empty((R,), dtype=torch.float32, device=x.device),
                 torch.empty((R, two_i), dtype=torch.bfloat16, device=x.device))
    # The backend checked every argument when it prepared the call (and built the schedule,
    # trace and copies here): the eager path skips the op's checks, torch.compile sees the op.
    run_kernel = mk_ops.megakernel_forward if torch.compiler.is_compiling() else mk_ops.launch_forward
    y = run_kernel(
        ws.bases, ws.signal_bases, ws.layout.rows, ws.layout.scalars, ws.layout.slots, table, offsets, counts,
        topk_ids, fc1, fc2, ring.x, ring.h, ring.w, ring.counters, ws.counter, ws.status, ws.rank,
        cfg.minibatch_rows, comm_ctas, launch.num_ctas, int(launch.timeout_s * 1e9), trace, *saved,
        fc1_2, fc2_2, pairs=launch.pairs)
    ws.mirror_status()
    return y, ((table, offsets, *saved, counts) if training else None)


class _MegakernelMoE(torch.autograd.Function):
    """fc1_2 / fc2_2: None, or the second weight segment (local experts L1 ..), read in place.
    Only calls that need a backward go through it (:func:`megakernel_moe`)."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, fc1, fc2, call: _Call, fc1_2=None, fc2_2=None):
        training = any(ctx.needs_input_grad)
        y, saved = _run_forward(x, topk_ids, topk_weights, fc1, fc2, call, fc1_2, fc2_2, training)
        if training:
            table, offsets, save_x, save_w, save_gu, counts = saved
            ctx.save_for_backward(topk_ids, fc1, fc2, table, offsets, save_x, save_w, save_gu, counts, fc1_2, fc2_2)
            ctx.call = call
            ctx.tokens = x.shape[0]
        return y

    @staticmethod
    def backward(ctx, dy):
        inner = SimpleNamespace(saved_tensors=ctx.saved_tensors, call=ctx.call.cuda_call, tokens=ctx.tokens)
        dx, _, dw, d_fc1, d_fc2, _, d_fc1_2, d_fc2_2 = cuda_backend._CudaMoE.backward(inner, dy)
        return dx, None, dw, d_fc1, d_fc2, None, d_fc1_2, d_fc2_2


def megakernel_moe(x, topk_ids, topk_weights, fc1_weight, fc2_weight, *, ep_group: EPGroup,
                   config: MoKConfig, shape: MoEShape) -> torch.Tensor:
    """The ``megakernel`` backend of :func:`megatron_mok.functional.mok_moe` (validated inputs).

    Args: as ``mok_moe``: x bf16 [T, H]; topk_ids int64 [T, K]; topk_weights fp32 [T, K];
        fc1_weight: tuple of bf16 [L_i, 2I, H] weight segments (one or two); fc2_weight: tuple
        of bf16 [L_i, H, I]. A second segment gets its own pair of weight tensor maps in the
        launch (and its own launches in the backward): no copy.

    Returns:
        y bf16 [T, H].

    Raises:
        MoKConfigError: tunables that do not fit the megakernel or the device (before any GPU
            work).
    """
    ws = get_workspace(ep_group, x.device, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                       experts_per_rank=shape.experts_per_rank, config=config)
    # Everything but the tensors' addresses follows from these, so a launch is prepared and
    # checked once (later calls of the key have the same shapes and dtypes: mok_moe checked them).
    key = ("megakernel", config, shape, os.environ.get(cuda_backend.GEMM_ENV), os.environ.get(cuda_backend.SWIGLU_ENV))
    launch = ws.prepared_calls.get(key)
    first = launch is None
    if first:
        launch = _prepare_launch(ws, ep_group, x.device, config, shape)
    ws.timeout_s = launch.timeout_s
    cuda_call = cuda_backend._Call(ws=ws, segment_rows=BLOCK_ROWS, timeout_s=launch.timeout_s,
                                   num_experts=launch.num_experts, comm_blocks=0, hopper_gemms=launch.hopper_gemms,
                                   fused_swiglu=launch.fused_swiglu)
    x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    # Segments stay where they are when the backward's GEMMs can read them too; else one copy.
    fc1, fc2, fc1_2, fc2_2 = cuda_backend.weight_arguments(fc1_weight, fc2_weight, cuda_call)
    if first:
        # Everything the launch will check, before any GPU work (the schedule is built later). A
        # launch without grad takes fewer comm CTAs, still at least 2, so these checks cover it.
        ring, cfg = launch.ring, launch.config
        mk_ops.check_forward_args(ws.bases, ws.signal_bases, None, None, None, topk_ids, fc1, fc2, ring.x, ring.h,
                                  ring.w, ring.counters, ws.counter, ws.status, rank=ws.rank,
                                  minibatch_rows=cfg.minibatch_rows, comm_ctas=cfg.comm_sms_forward,
                                  num_ctas=launch.num_ctas, timeout_ns=int(launch.timeout_s * 1e9),
                                  fc1_weight2=fc1_2, fc2_weight2=fc2_2)
        ws.prepared_calls[key] = launch
    call = _Call(ws=ws, launch=launch, cuda_call=cuda_call)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (x, topk_weights, fc1, fc2, fc1_2, fc2_2))):
        # Nothing to differentiate: skip the autograd function's own host time (~30 us a call).
        return _run_forward(x, topk_ids, topk_weights, fc1, fc2, call, fc1_2, fc2_2, training=False)[0]
    return _MegakernelMoE.apply(x, topk_ids, topk_weights, fc1, fc2, call, fc1_2, fc2_2)


def _prepare_launch(ws: Workspace, ep_group: EPGroup, device: torch.device, config: MoKConfig,
                    shape: MoEShape) -> _Launch:
    """The settings every call of this shape and config on workspace ``ws`` launches with:
    resolved tunables, the ring, the backward's GEMM choices.

    Raises:
        MoKConfigError: tunables that do not fit the megakernel or the device.
    """
    P, _ = group_size_rank(ep_group)
    share = sm_share(device, ep_group)
    resolved = resolve_tunables(config, shape, P, share)
    return _Launch(ring=get_ring(ws, resolved.ring_rows, shape.ffn_hidden), config=resolved,
                   num_ctas=share if isinstance(ep_group, LocalEPRank) else 0, timeout_s=float(config.timeout_s),
                   pairs=use_pairs(resolved), comm_ctas_no_grad=config.forward_comm_sms(resolved, saves_activations=False),
                   num_experts=P * shape.experts_per_rank,
                   hopper_gemms=cuda_backend.hopper_gemms_apply(shape, BLOCK_ROWS),
                   fused_swiglu=cuda_backend.fused_swiglu_apply(shape, BLOCK_ROWS))
