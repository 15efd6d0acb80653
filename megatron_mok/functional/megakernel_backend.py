"""The ``megakernel`` backend: the layer forward in one persistent kernel launch per MoE layer
(after the schedule kernel), the backward with the ``cuda`` backend's kernels on activations the
launch writes.

Validated on H200s (P = 1, virtual ranks, P = 2: tests/megakernel/test_gpu.py). ``auto`` (the
default) and ``backend="megakernel"`` (``--mok-backend megakernel``) take it whenever the shape
allows (:func:`unsupported_reason`).

Forward, on every rank:

1. the ``cuda`` backend's prologue in one host call (``Workspace.dispatch``): publish x,
   topk_ids, topk_weights into the workspace, barrier, schedule (``mok_build_schedule``);
2. ``mok::megakernel_forward`` (eagerly ``launch_forward``: the backend checked its arguments
   when it prepared the (config, shape), :func:`_prepared_launch`): comm CTAs pull the
   routed token rows into a fixed-size ring, minibatch by minibatch; compute CTAs run fc1 +
   SwiGLU (router weight applied per row) and fc2 tile by tile as soon as a row block has
   landed, fc2's epilogue storing the output rows into their home ranks' (token, slot); ring
   slots are reused once their fc2 tiles are done; a combine-done flag exchange, then the
   fixed-order sum over the top-k slots. Memory: the ring, ``ring_rows * (H + I) * 2
   + ring_rows * 4`` bytes plus the counters, fixed by the config whatever the routing.

Backward: when the call needs one, the launch also writes the activations the backward reads
(the pulled rows, their router weights and the fc1 pre-activation) for the first rows of the
expert-grouped layout, as many as the training ring holds (``MoKConfig.training_ring_rows``), and
the backward is :func:`training.moe_backward` (the ``cuda`` backend's kernels, chunk by chunk,
replaying the rows past the ring). A forward without grad keeps nothing.

Tunables: ``MoKConfig`` (comm SMs, minibatch, ring) and ``MoKConfig.megakernel`` (pair mode,
group size), resolved once per (config, shape) by :func:`resolve_tunables`, whose ``None``
fields come from the shape heuristic (:meth:`MoKConfig.resolve`) and the library's defaults.
:func:`trace_launches` records the timeline of the launches made inside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from ..config import MegakernelTunables, MoKConfig, MoKConfigError
from ..ops import megakernel as mk_ops
from . import cuda_backend, expert_ffn, training
from .backend import CallSpec, gpu_unavailable_reason
from .groups import EPGroup, LocalEPRank, group_size_rank
from .validate import MoEShape
from .workspace import Workspace, get_workspace

log = logging.getLogger("megatron_mok")

PRINT_CONFIG_ENV = "MOK_PRINT_CONFIG"
"""Debug switch: "1" logs every resolved launch configuration once (it changes nothing else)."""

_trace_sink: "contextvars.ContextVar[Optional[List[dict]]]" = contextvars.ContextVar("mok_megakernel_trace",
                                                                                       default=None)


@contextlib.contextmanager
def trace_launches() -> Iterator[List[dict]]:
    """Record the timeline of every forward launch made inside the ``with`` block.

    Yields a list that gets one dict per launch: ``records`` int64 [N, 6] on the device (columns
    ``mk_ops.TRACE_FIELDS``; unwritten records are 0; read it after the stream is done) and the
    launch's ``minibatch_rows``, ``ring_rows``, ``comm_ctas``, ``hidden``, ``ffn_hidden``,
    ``num_ctas``, ``pairs``, ``group_blocks``. A traced launch writes a few timer stamps per work
    item: it is slower than an untraced one."""
    launches: List[dict] = []
    token = _trace_sink.set(launches)
    try:
        yield launches
    finally:
        _trace_sink.reset(token)


def unsupported_reason(shape: MoEShape, config: MoKConfig, ep_size: int) -> Optional[str]:
    """Why the megakernel does not take this call, or None. Reads no device state but the
    library's constants (the device-dependent rules, comm SMs against the SM count, are checked
    by :func:`resolve_tunables` before any GPU work)."""
    c = mk_ops.constants()
    if config.tile_rows != c.block_rows:
        return (f"tile_rows={config.tile_rows}; the megakernel's row blocks are {c.block_rows} rows "
                "(the cuda backend takes 64)")
    if shape.hidden % c.fc2_cols:
        return f"hidden size {shape.hidden} is not a multiple of {c.fc2_cols} (the fc2 tile's columns)"
    if shape.ffn_hidden % c.fc1_cols:
        return (f"expert FFN size {shape.ffn_hidden} is not a multiple of {c.fc1_cols} "
                "(the fc1 tile's h columns)")
    if shape.experts_per_rank > c.max_experts:
        return f"{shape.experts_per_rank} experts per rank exceed the megakernel's {c.max_experts}"
    if shape.topk > c.max_topk:
        return f"top-k {shape.topk} exceeds the megakernel's {c.max_topk}"
    return cuda_backend.unsupported_reason(shape, config)  # the backward runs the cuda backend's kernels


def sm_share(device: torch.device, ep_group: EPGroup) -> int:
    """SMs one rank's launch may use: all of the device's, or an equal share for each virtual
    rank of a :class:`LocalEPGroup` (their persistent kernels run at the same time and wait on
    each other, so each must fit beside the others)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    P, _ = group_size_rank(ep_group)
    return sms // P if isinstance(ep_group, LocalEPRank) else sms


@functools.lru_cache(maxsize=256)
def resolve_tunables(config: MoKConfig, shape: MoEShape, ep_size: int, num_sms: int) -> MoKConfig:
    """``config`` with every ``None`` tunable chosen for a launch of ``num_sms`` CTAs: comm SMs,
    minibatch and ring by :meth:`MoKConfig.resolve`, ``config.megakernel``'s fields from the
    library's defaults; checked against the megakernel's rules. Cached: every layer of a model
    asks the same question on every call.

    Raises:
        MoKConfigError: naming the tunable, its value and the rule.
    """
    c = mk_ops.constants()
    if num_sms < 3:
        raise MoKConfigError(f"the megakernel needs at least 3 SMs (two pulling, one computing), "
                             f"this launch has {num_sms}")
    resolved = config.resolve(hidden=shape.hidden, ffn_hidden=shape.ffn_hidden, num_sms=num_sms, ep_size=ep_size,
                              rows_per_expert=rows_per_expert(shape))
    if resolved.minibatch_rows % c.block_rows:
        raise MoKConfigError(f"MoKConfig.minibatch_rows={resolved.minibatch_rows} must be a multiple of "
                             f"the megakernel's {c.block_rows}-row blocks")
    if resolved.ring_rows % resolved.minibatch_rows or resolved.ring_rows < 2 * resolved.minibatch_rows:
        raise MoKConfigError(
            f"MoKConfig.ring_rows={resolved.ring_rows} must be a multiple of minibatch_rows="
            f"{resolved.minibatch_rows} and at least two minibatches ({2 * resolved.minibatch_rows})")
    defaults = mk_ops.default_tunables()
    given = config.megakernel
    tunables = MegakernelTunables(
        pairs=defaults["pairs"] if given.pairs is None else given.pairs,
        group_blocks=defaults["group_blocks"] if given.group_blocks is None else given.group_blocks)
    if not c.min_group_blocks <= tunables.group_blocks <= c.max_group_blocks:
        raise MoKConfigError(f"MegakernelTunables.group_blocks={tunables.group_blocks} must be an even number "
                             f"from {c.min_group_blocks} to {c.max_group_blocks}")
    return dataclasses.replace(resolved, megakernel=tunables)


def rows_per_expert(shape: MoEShape) -> float:
    """Mean routed rows a rank's local expert receives: tokens x top-k / local experts (every
    rank sends T x K rows, spread over the E = P x L experts)."""
    return shape.tokens * shape.topk / shape.experts_per_rank


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


@dataclass(frozen=True)
class _Launch:
    """What every call of one (config, shape) on one workspace launches with."""

    ring: _Ring
    config: MoKConfig       # resolved (resolve_tunables)
    num_ctas: int
    comm_ctas_no_grad: int  # comm CTAs of a launch that saves no activations (forward_comm_sms)
    expert_call: expert_ffn.ExpertCall  # the backward's


class _WorkspaceState:
    """The backend's state per workspace: rings by (ring rows, I), launches by (config, shape)."""

    def __init__(self):
        self.rings: Dict[Tuple[int, int], _Ring] = {}
        self.launches: Dict[tuple, _Launch] = {}


_state: "weakref.WeakKeyDictionary[Workspace, _WorkspaceState]" = weakref.WeakKeyDictionary()


def get_ring(ws: Workspace, ring_rows: int, ffn_hidden: int) -> _Ring:
    """The ring of workspace ``ws`` for ``ring_rows`` rows and FFN size I (created once).
    Like the workspace, it serves every layer: calls on one rank run one after another."""
    rings = _state.setdefault(ws, _WorkspaceState()).rings
    key = (ring_rows, ffn_hidden)
    if key not in rings:
        dev = ws.device
        rings[key] = _Ring(
            x=torch.empty((ring_rows, ws.layout.hidden), dtype=torch.bfloat16, device=dev),
            h=torch.empty((ring_rows, ffn_hidden), dtype=torch.bfloat16, device=dev),
            w=torch.empty((ring_rows,), dtype=torch.float32, device=dev),
            counters=torch.zeros((mk_ops.counter_words(ring_rows),), dtype=torch.int32, device=dev))
    return rings[key]


def _run_forward(x, topk_ids, topk_weights, fc1, fc2, ws: Workspace, launch: _Launch, spec: CallSpec, fc1_2, fc2_2,
                 training_call: bool):
    """The forward launch (prologue, then the persistent kernel). Returns ``(y, saved)``: y bf16
    [T, H]; saved, when ``training_call``: (plan, table, offsets, counts, kept x [N, H], kept router
    weights [N], kept gate | up [N, 2I]) for :func:`training.moe_backward`, N the plan's kept rows;
    else None."""
    ring, cfg = launch.ring, launch.config
    c = mk_ops.constants()
    comm_ctas = cfg.comm_sms_forward if training_call else launch.comm_ctas_no_grad
    call = launch.expert_call
    ws.raise_if_failed(call.timeout_s)
    table, counts, offsets, capacity = ws.dispatch(x, topk_ids, topk_weights, cuda_backend.SITE_FWD_DISPATCH,
                                                   call.timeout_s, c.block_rows)
    trace = None
    sink = _trace_sink.get()
    if sink is not None:
        H, I = fc2.shape[1], fc2.shape[2]
        trace = torch.zeros((mk_ops.trace_records(table.shape[0], H, I), len(mk_ops.TRACE_FIELDS)),
                            dtype=torch.int64, device=x.device)
        sink.append(dict(records=trace, minibatch_rows=cfg.minibatch_rows, ring_rows=cfg.ring_rows,
                         comm_ctas=comm_ctas, hidden=H, ffn_hidden=I, num_ctas=launch.num_ctas,
                         pairs=cfg.megakernel.pairs, group_blocks=cfg.megakernel.group_blocks))
    plan, saved = None, (None, None, None)
    if training_call:  # the launch writes the kept rows' activations (the training ring)
        plan = training.training_plan(spec.config, spec.shape, capacity, c.block_rows, call.hopper_gemms)
        N, H, two_i = training.kept_rows(plan), fc1.shape[2], fc1.shape[1]
        saved = (torch.empty((N, H), dtype=torch.bfloat16, device=x.device),
                 torch.empty((N,), dtype=torch.float32, device=x.device),
                 torch.empty((N, two_i), dtype=torch.bfloat16, device=x.device))
    # The backend checked every argument when it prepared the launch (and built the schedule,
    # trace and copies here): the eager path skips the op's checks, torch.compile sees the op.
    run_kernel = mk_ops.megakernel_forward if torch.compiler.is_compiling() else mk_ops.launch_forward
    y = run_kernel(
        ws.bases, ws.signal_bases, ws.layout.rows, ws.layout.scalars, ws.layout.slots, table, offsets, counts,
        topk_ids, fc1, fc2, ring.x, ring.h, ring.w, ring.counters, ws.counter, ws.status, ws.rank,
        cfg.minibatch_rows, comm_ctas, launch.num_ctas, int(call.timeout_s * 1e9), trace, *saved,
        fc1_2, fc2_2, pairs=cfg.megakernel.pairs, group_blocks=cfg.megakernel.group_blocks)
    ws.mirror_status()
    if not training_call:
        return y, None
    return y, (plan, table, offsets, counts, *saved)


class _MegakernelMoE(torch.autograd.Function):
    """fc1_2 / fc2_2: None, or the second weight segment (local experts L1 ..), read in place.
    Only calls that need a backward go through it (:meth:`MegakernelBackend.run`)."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, fc1, fc2, ws, launch, spec, fc1_2=None, fc2_2=None, main_grads=None):
        training_call = any(ctx.needs_input_grad)
        y, saved = _run_forward(x, topk_ids, topk_weights, fc1, fc2, ws, launch, spec, fc1_2, fc2_2, training_call)
        if training_call:
            plan, table, offsets, counts, save_x, save_w, save_gu = saved
            # x and topk_weights are the caller's tensors, kept for replay.
            ctx.save_for_backward(x, topk_ids, topk_weights, fc1, fc2, fc1_2, fc2_2, table, offsets, counts, save_x,
                                  save_w, save_gu)
            ctx.ws, ctx.call, ctx.plan, ctx.main_grads = ws, launch.expert_call, plan, main_grads
        return y

    @staticmethod
    @once_differentiable  # a second derivative through MoK raises instead of being dropped
    def backward(ctx, dy):
        training.consume_kept(ctx)
        x, topk_ids, topk_weights, fc1, fc2, fc1_2, fc2_2, table, offsets, counts, save_x, save_w, save_gu = \
            ctx.saved_tensors
        kept = training.split_kept(ctx.plan, save_x, save_w, save_gu)
        dx, dw, d_fc1, d_fc2, d_fc1_2, d_fc2_2 = training.moe_backward(
            ctx.ws, ctx.call, ctx.plan, kept, dy, x, topk_ids, topk_weights, table, offsets, counts, fc1, fc2,
            fc1_2, fc2_2, ctx.main_grads)
        return dx, None, dw, d_fc1, d_fc2, None, None, None, d_fc1_2, d_fc2_2, None


def _prepared_launch(ws: Workspace, spec: CallSpec) -> Tuple[_Launch, bool]:
    """The launch of this (config, shape) on workspace ``ws`` (prepared at its first call:
    resolved tunables, the ring, the backward's GEMM choice), and whether it was just made.

    Raises:
        MoKConfigError: tunables that do not fit the megakernel or the device.
    """
    state = _state.setdefault(ws, _WorkspaceState())
    # Everything but the tensors' addresses follows from these (later calls of the key have the
    # same shapes and dtypes: mok_moe checked them), so a launch is prepared and checked once.
    key = (spec.config, spec.shape)
    launch = state.launches.get(key)
    if launch is not None:
        return launch, False
    config, shape = spec.config, spec.shape
    share = sm_share(ws.device, spec.ep_group)
    resolved = resolve_tunables(config, shape, spec.ep_size, share)
    block_rows = mk_ops.constants().block_rows
    launch = _Launch(ring=get_ring(ws, resolved.ring_rows, shape.ffn_hidden), config=resolved,
                     num_ctas=share if isinstance(spec.ep_group, LocalEPRank) else 0,
                     comm_ctas_no_grad=config.forward_comm_sms(resolved, saves_activations=False),
                     expert_call=expert_ffn.expert_call(config, shape, spec.ep_size, block_rows))
    if os.environ.get(PRINT_CONFIG_ENV) == "1":
        log.warning("megatron-mok: megakernel launch for %s on EP rank %d of %d: %s, %d CTAs (0: every SM), "
                    "%d comm CTAs without grad", shape, ws.rank, spec.ep_size, resolved, launch.num_ctas,
                    launch.comm_ctas_no_grad)
    return launch, True


class MegakernelBackend:
    """The layer forward in one persistent launch (sm_90, bf16); the backward by the ``cuda``
    backend's kernels on the activations the launch saves."""

    name = "megakernel"

    def unavailable_reason(self, spec: CallSpec) -> Optional[str]:
        return gpu_unavailable_reason(spec.device, spec.dtype) or _shape_reason(spec.shape, spec.config, spec.ep_size)

    def run(self, spec: CallSpec, x, topk_ids, topk_weights, fc1s, fc2s, main_grads=None) -> torch.Tensor:
        """y bf16 [T, H] for x bf16 [T, H], topk_ids int64 [T, K], topk_weights fp32 [T, K] and
        the weight segments fc1s (bf16 [L_i, 2I, H]) and fc2s (bf16 [L_i, H, I]): a second
        segment gets its own pair of weight tensor maps in the launch (and its own launches in the
        backward), no copy. ``main_grads``: see :class:`~megatron_mok.functional.backend.Backend`.

        Raises:
            MoKConfigError: tunables that do not fit the megakernel or the device (before any
                GPU work).
        """
        shape = spec.shape
        ws = get_workspace(spec.ep_group, x.device, tokens=shape.tokens, hidden=shape.hidden, topk=shape.topk,
                           experts_per_rank=shape.experts_per_rank, config=spec.config)
        launch, first = _prepared_launch(ws, spec)
        ws.timeout_s = launch.expert_call.timeout_s
        x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
        # Segments stay where they are when the backward's GEMMs can read them too; else one copy.
        fc1, fc2, fc1_2, fc2_2 = expert_ffn.weight_arguments(fc1s, fc2s, launch.expert_call)
        if first:
            # Everything the launch will check, before any GPU work (the schedule is built later). A
            # launch without grad takes fewer comm CTAs, still at least 2, so these checks cover it.
            ring, cfg = launch.ring, launch.config
            mk_ops.check_forward_args(ws.bases, ws.signal_bases, None, None, None, topk_ids, fc1, fc2, ring.x, ring.h,
                                      ring.w, ring.counters, ws.counter, ws.status, rank=ws.rank,
                                      minibatch_rows=cfg.minibatch_rows, comm_ctas=cfg.comm_sms_forward,
                                      num_ctas=launch.num_ctas, timeout_ns=int(launch.expert_call.timeout_s * 1e9),
                                      fc1_weight2=fc1_2, fc2_weight2=fc2_2, group_blocks=cfg.megakernel.group_blocks)
            _state[ws].launches[(spec.config, spec.shape)] = launch
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in (x, topk_weights, fc1, fc2, fc1_2, fc2_2))):
            # Nothing to differentiate: skip the autograd function's own host time (~30 us a call).
            return _run_forward(x, topk_ids, topk_weights, fc1, fc2, ws, launch, spec, fc1_2, fc2_2,
                                training_call=False)[0]
        return _MegakernelMoE.apply(x, topk_ids, topk_weights, fc1, fc2, ws, launch, spec, fc1_2, fc2_2, main_grads)


@functools.lru_cache(maxsize=256)
def _shape_reason(shape: MoEShape, config: MoKConfig, ep_size: int) -> Optional[str]:
    # Cached: every layer asks the same question on every call (it reads no device state).
    return unsupported_reason(shape, config, ep_size)
