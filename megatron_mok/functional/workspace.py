"""The communication workspace: buffers every rank of the EP group reaches by peer pointer,
allocated once per (EP group, device, hidden, top-k, experts per rank) and reused by every
layer and step.

Each rank holds one region with the same layout (:class:`SymmetricLayout`); peers read from
it (pull) and write into it (push) through the base addresses in ``bases``. On a real EP
group the regions are torch symmetric memory (multicast is never used); for P = 1 and for
the virtual ranks of :class:`LocalEPGroup` they are plain device allocations.

Size, fixed up front and independent of the routing, per rank, for capacity T_cap tokens:
``16P + 16 + T_cap*K*(8 + 4) + 2*T_cap*H*2 + T_cap*K*H*2`` bytes (plus alignment): the
per-(token, slot) rows dominate. The schedule table (8 bytes a row) is sized by the worst case
``P*T_cap*K + L*(tile-1)`` rows; the expert-grouped activations by the training ring and one
chunk of rows (functional/training.py).

Reuse across calls is safe because every call has two barriers: peers read this rank's
published rows only between the first and the second barrier of a call, and write into its
slots only in that window too, while this rank rewrites its rows before the first barrier
and reads its slots after the second (docs/architecture.md, "Buffer reuse").
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ..config import MoKConfig
from ..ops import comm as comm_ops
from ..ops import prologue as prologue_ops
from ..ops import schedule as schedule_ops
from . import faults
from .faults import (SITE_WORKSPACE, MoKCapacityError, MoKPeerError, MoKRuntimeError,  # noqa: F401
                     MoKTimeoutError, bad_id_message, capacity_message, own_stop_message, peer_failed_message,
                     timeout_message)
from .groups import EPGroup, LocalEPRank, global_rank_name, group_size_rank

STATUS_BAD_EXPERT_ID, STATUS_TOO_MANY_TOKENS, STATUS_TIMEOUT, STATUS_PEER_FAILED = 1, 2, 4, 8
# Words of the status (csrc/include/mok/common.h, MokStatusIndex).
_FLAGS, _VALUE, _PEER, _WHERE, _RANK, _FAILURE, _SOURCE = range(7)
_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class SymmetricLayout:
    """Byte offsets of the buffers in every rank's region (the same on all ranks).

    signals: uint64 [2P], words peers write: the barrier's and the megakernel's combine-done
    flags, one per peer, then the failure words, one per peer (csrc/include/mok/common.h);
    ntok: int32, this rank's T;
    ids: int64 [T_cap, K]; scalars: fp32 [T_cap, K] (router weights out, dw slots in);
    rows: bf16 [T_cap, H] (x in the forward, dy in the backward);
    rows_x: bf16 [T_cap, H] (x again in a backward that replays rows);
    slots: bf16 [T_cap, K, H] (expert outputs in the forward, dx per slot in the backward).
    """

    P: int
    max_tokens: int
    topk: int
    hidden: int
    signals: int
    ntok: int
    ids: int
    scalars: int
    rows: int
    rows_x: int
    slots: int
    total: int

    @staticmethod
    def plan(P: int, max_tokens: int, topk: int, hidden: int) -> "SymmetricLayout":
        sizes = [("signals", 16 * P), ("ntok", 16), ("ids", 8 * max_tokens * topk),
                 ("scalars", 4 * max_tokens * topk), ("rows", 2 * max_tokens * hidden),
                 ("rows_x", 2 * max_tokens * hidden), ("slots", 2 * max_tokens * topk * hidden)]
        offsets, at = {}, 0
        for name, size in sizes:
            offsets[name] = at
            at += _align(max(size, 1))
        return SymmetricLayout(P=P, max_tokens=max_tokens, topk=topk, hidden=hidden, total=at, **offsets)


class Workspace:
    """One rank's view of the workspace: its region, the peers' base addresses, the barrier
    counter, the status word and the schedule scratch memory."""

    def __init__(self, *, ep_group: EPGroup, rank: int, layout: SymmetricLayout, region: torch.Tensor,
                 bases: List[int], experts_per_rank: int):
        self.ep_group = ep_group
        self.rank = rank
        self.P = layout.P
        self.layout = layout
        self.region = region  # uint8 [layout.total], this rank's
        self.device = region.device
        self.experts_per_rank = experts_per_rank
        self.timeout_s = float("nan")  # set by every call, for messages
        _every_workspace.add(self)
        T, K, H = layout.max_tokens, layout.topk, layout.hidden
        as_dev = lambda vals: torch.tensor(vals, dtype=torch.int64).to(self.device)
        self.bases = as_dev(bases)
        self.signal_bases = as_dev([b + layout.signals for b in bases])
        self.ids_ptrs = as_dev([b + layout.ids for b in bases])
        self.ntok_ptrs = as_dev([b + layout.ntok for b in bases])
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Kernels record problems in `status` (device memory, device atomics); each call ends
        # with a kernel storing it into `status_host` (pinned, mapped), or a copy where the
        # memory is not mapped, which the host reads at the next call without synchronising.
        self.status = torch.zeros(8, dtype=torch.int32, device=self.device)
        self.status_host = torch.zeros(8, dtype=torch.int32, pin_memory=True)
        self._status_host_view = self.status_host.numpy()  # the same memory, read without torch's indexing
        with torch.cuda.device(self.device):
            self._status_host_mapped = comm_ops.host_device_pointer(self.status_host)
        self.scratch = torch.empty(max(1, schedule_ops.scratch_ints(self.P, T, K, experts_per_rank)),
                                   dtype=torch.int32, device=self.device)
        self._table_rows: Dict[int, int] = {}  # schedule table capacity per tile_rows
        view = lambda off, n, dtype: region[off:off + n * dtype.itemsize].view(dtype)
        self.ntok = view(layout.ntok, 1, torch.int32)
        self.ids = view(layout.ids, T * K, torch.int64).view(T, K)
        self.scalars = view(layout.scalars, T * K, torch.float32).view(T, K)
        self.rows = view(layout.rows, T * H, torch.bfloat16).view(T, H)
        self.rows_x = view(layout.rows_x, T * H, torch.bfloat16).view(T, H)
        self.slots = view(layout.slots, T * K * H, torch.bfloat16).view(T, K, H)

    # -- capacity and status ---------------------------------------------------------------

    def check_tokens(self, tokens: int) -> None:
        """Raise :class:`MoKCapacityError` if ``tokens`` exceeds the capacity."""
        if tokens > self.layout.max_tokens:
            raise MoKCapacityError(capacity_message(self.ep_group, self.rank, tokens, self.layout.max_tokens))

    def mirror_status(self) -> None:
        """Queue the copy of the device status word to the host (end of every call): a kernel's
        stores into the mapped pinned memory, ~8 us less GPU time per call than a copy-engine
        copy, which remains for torch.compile and where the memory is not mapped."""
        if self._status_host_mapped and not torch.compiler.is_compiling():
            comm_ops.mirror_status(self.status, self._status_host_mapped)
        else:
            self.status_host.copy_(self.status, non_blocking=True)

    def signal_failure(self, code: int, failed_rank: int) -> None:
        """This rank stops the current call before queueing it: set its failure word in every
        peer's signal array (their next barrier stops, their outputs are NaN, their next call
        raises naming ``failed_rank``) and record the stop in its own status word (this
        workspace is out of step with its peers' from now on). Queued on the current stream;
        nothing for P = 1."""
        if self.P == 1:
            return
        comm_ops.signal_failure(self.signal_bases, self.rank, code, failed_rank, self.status)
        self.mirror_status()

    def recorded_error(self, timeout_s: float) -> "MoKRuntimeError | None":
        """The error an earlier call's kernels recorded, if any (reads the pinned host copy of
        the status word: no device synchronisation)."""
        flags = int(self._status_host_view[0])
        if flags == 0:
            return None
        words = [int(v) for v in self._status_host_view[:7]]
        value, peer, site, rank, code, source = (words[_VALUE], words[_PEER], words[_WHERE], words[_RANK],
                                                 words[_FAILURE], words[_SOURCE])
        g = self.ep_group
        if flags & STATUS_PEER_FAILED:
            if peer == rank:
                return MoKRuntimeError(own_stop_message(g, rank, code))
            return MoKPeerError(peer_failed_message(g, rank, peer, code, "", at_this_call=False, site=site))
        if flags & STATUS_TIMEOUT:
            return MoKTimeoutError(timeout_message(g, rank, [peer], timeout_s, site, outputs_nan=True))
        if flags & STATUS_BAD_EXPERT_ID:
            return MoKRuntimeError(bad_id_message(g, [(source, value)], self.experts_per_rank * self.P))
        if flags & STATUS_TOO_MANY_TOKENS:
            return MoKRuntimeError(
                f"MoK: {global_rank_name(g, source)} published {value} tokens, above the workspace capacity "
                f"{self.layout.max_tokens}; the output of that call is NaN. Set MoKConfig.max_tokens_per_rank on "
                "every rank.")
        return MoKRuntimeError(f"MoK: unknown status flags {flags:#x}")

    def raise_if_failed(self, timeout_s: float) -> None:
        """Raise the error an earlier call's kernels recorded, if any. Reads the pinned host
        copy: no device synchronisation (a problem shows up at the next call, or at once
        after a synchronisation)."""
        if int(self._status_host_view[0]) == 0:
            return
        err = self.recorded_error(timeout_s)
        if err is not None:
            raise err

    # -- per-call steps --------------------------------------------------------------------

    def publish_rows(self, rows: torch.Tensor) -> None:
        """Copy this rank's rows (bf16 [T, H], the backward's output gradients) into its region for
        the peers to pull (a forward publishes its tokens, ids and router weights in
        :meth:`dispatch`)."""
        self.rows[: rows.shape[0]].copy_(rows)

    def publish_replay(self, x: torch.Tensor, weights: torch.Tensor) -> None:
        """Copy this rank's tokens (bf16 [T, H]) and router weights (fp32 [T, K]) into its region
        again, for a backward that replays rows (functional/training.py). The weights go where the
        forward published them: each route's entry is read by the one rank that holds the route,
        before that rank pushes the route's weight gradient into the same entry."""
        self.rows_x[: x.shape[0]].copy_(x)
        self.scalars[: weights.shape[0]].copy_(weights)

    def barrier(self, site: int, timeout_s: float) -> None:
        """Device-side barrier of the EP group (no-op for P = 1)."""
        if self.P == 1:
            return
        comm_ops.barrier(self.signal_bases, self.rank, self.counter, int(timeout_s * 1e9), site, self.status)

    def _schedule_outputs(self, tile_rows: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        L = self.experts_per_rank
        capacity = self._table_rows.get(tile_rows)
        if capacity is None:
            capacity = schedule_ops.table_rows(self.P, self.layout.max_tokens, self.layout.topk, L, tile_rows)
            self._table_rows[tile_rows] = capacity
        # One allocation for the three (each allocation costs host time), each part starting on
        # a 16-byte boundary.
        pad = lambda n: (n + 3) // 4 * 4
        at_counts = pad(2 * capacity)
        at_offsets = at_counts + pad(L)
        buf = torch.empty(at_offsets + pad(L + 1), dtype=torch.int32, device=self.device)
        table = buf[:2 * capacity].view(capacity, 2)
        counts = buf[at_counts:at_counts + L]
        offsets = buf[at_offsets:at_offsets + L + 1]
        return table, counts, offsets, capacity

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, scalars: torch.Tensor, site: int, timeout_s: float,
                 tile_rows: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A forward's prologue, queued by one host call (``mok::dispatch_prologue``): publish x
        bf16 [T, H], ids int64 [T, K] and scalars fp32 [T, K] (contiguous) for the peers to pull,
        the barrier of the EP group at ``site``, then the schedule kernel over every rank's ids.

        Returns:
            (table int32 [R_cap, 2], counts int32 [L], offsets int32 [L + 1], R_cap).
        """
        table, counts, offsets, capacity = self._schedule_outputs(tile_rows)
        lay = self.layout
        prologue_ops.dispatch_prologue(x, ids, scalars, self.region, lay.rows, lay.ids, lay.scalars, lay.ntok,
                                       self.signal_bases, self.counter, int(timeout_s * 1e9), site, self.status,
                                       self.ids_ptrs, self.ntok_ptrs, self.rank, lay.max_tokens,
                                       self.experts_per_rank, tile_rows, table, counts, offsets, self.scratch)
        return table, counts, offsets, capacity


# ----------------------------------------------------------------------------------------------
# Creation and the cache.

_workspaces: Dict[tuple, Workspace] = {}
_every_workspace: "weakref.WeakSet[Workspace]" = weakref.WeakSet()  # virtual ranks' too


def _zeroed_region(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def _agree_on_capacity(ep_group: dist.ProcessGroup, tokens: int, timeout_s: float) -> int:
    """The largest token count of any rank, through a bounded rendezvous of the ranks."""
    payloads = faults.exchange(ep_group, SITE_WORKSPACE, "workspace", timeout_s, tokens=tokens)
    return max(int(p["tokens"]) for p in payloads)


def _symmetric_region(ep_group: dist.ProcessGroup, nbytes: int, device: torch.device) -> Tuple[torch.Tensor, List[int]]:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # MoK never uses multicast
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(ep_group.group_name)
    region = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(region, ep_group)
    region.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=ep_group)  # nobody signals a peer before the peer has zeroed its flags
    region._mok_handle = handle  # keep the mapping alive as long as the region
    return region, list(handle.buffer_ptrs)


def get_workspace(ep_group: EPGroup, device: torch.device, *, tokens: int, hidden: int, topk: int,
                  experts_per_rank: int, config: MoKConfig) -> Workspace:
    """The workspace of this rank for the call's shape, created at the first call.

    Creation is collective on a process group (a bounded rendezvous agrees on the token capacity,
    then a symmetric-memory rendezvous): every rank must make its first call together, as it
    does in a model's first forward. Raises :class:`MoKCapacityError` for a later call with
    more tokens than the capacity (a single rank, P = 1, simply grows its workspace).
    """
    P, rank = group_size_rank(ep_group)
    dev_index = device.index if device.index is not None else torch.cuda.current_device()
    shape_key = (dev_index, hidden, topk, experts_per_rank)

    if isinstance(ep_group, LocalEPRank):
        shared = ep_group.group.shared_workspaces
        if shape_key not in shared:
            if config.max_tokens_per_rank is None:
                raise MoKCapacityError(
                    "virtual EP ranks (LocalEPGroup) need MoKConfig.max_tokens_per_rank: the "
                    "workspaces of all ranks are created together, before every rank's token "
                    "count is known")
            T = config.max_tokens_per_rank
            layout = SymmetricLayout.plan(P, T, topk, hidden)
            regions = [_zeroed_region(layout.total, device) for _ in range(P)]
            torch.cuda.synchronize(device)  # zeroed before any rank's stream signals into it
            bases = [r.data_ptr() for r in regions]
            shared[shape_key] = [Workspace(ep_group=ep_group.group.ranks[r], rank=r, layout=layout,
                                           region=regions[r], bases=bases, experts_per_rank=experts_per_rank)
                                 for r in range(P)]
        ep_group.group.last_shape_key = shape_key  # where a rank that stops a call tells the others
        ws = shared[shape_key][rank]
        ws.check_tokens(tokens)
        return ws

    group_key = "single" if ep_group is None else ep_group.group_name
    key = (group_key,) + shape_key
    ws = _workspaces.get(key)
    if ws is not None:
        if ep_group is None and tokens > ws.layout.max_tokens:
            ws = None  # one rank: nobody else to agree with, so grow
        else:
            faults.note_gpu_call(ep_group, ws)
            ws.check_tokens(tokens)
            return ws
    if ep_group is None:
        T = max(tokens, config.max_tokens_per_rank or 0, 1)
        layout = SymmetricLayout.plan(1, T, topk, hidden)
        region = _zeroed_region(layout.total, device)
        ws = Workspace(ep_group=None, rank=0, layout=layout, region=region, bases=[region.data_ptr()],
                       experts_per_rank=experts_per_rank)
    else:
        T = config.max_tokens_per_rank or _agree_on_capacity(ep_group, tokens, float(config.timeout_s))
        T = max(T, 1)
        layout = SymmetricLayout.plan(P, T, topk, hidden)
        region, bases = _symmetric_region(ep_group, layout.total, device)
        ws = Workspace(ep_group=ep_group, rank=rank, layout=layout, region=region, bases=bases,
                       experts_per_rank=experts_per_rank)
        _workspaces[key] = ws
        faults.note_gpu_call(ep_group, ws)
        ws.check_tokens(tokens)
    _workspaces[key] = ws
    return ws


def check_errors(ep_group: EPGroup = None) -> None:
    """Raise any error MoK recorded in this process: a bad expert id, a capacity overflow, a peer
    that timed out or stopped. Synchronises the current CUDA device first when CUDA is in use.

    MoK never synchronises inside a layer call; problems are raised at the next call of a
    layer with that workspace, or here. Call it where a step ends, if you want errors there.
    Errors stay recorded (the workspace is unusable after one): every later call raises again.

    Args:
        ep_group: only the workspaces of this EP group (a process group or one
            :class:`LocalEPRank`); None: every workspace of the process.

    Raises:
        MoKRuntimeError (MoKTimeoutError, MoKPeerError): the error; when several ranks or
            workspaces recorded one, the root cause's type with every message.
        TypeError: ``ep_group`` is not an EP group.
    """
    from .groups import check_ep_group
    from .reference_backend import reference_failures

    check_ep_group(ep_group)
    errors = list(reference_failures(ep_group)) + faults.group_failures(ep_group)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if _every_workspace:
            torch.cuda.synchronize()
        for ws in list(_every_workspace):
            if ep_group is not None and ws.ep_group is not ep_group:
                continue
            err = ws.recorded_error(ws.timeout_s)
            if err is not None:
                errors.append(err)
    faults.raise_all(errors)


def release_workspaces() -> None:
    """Drop every cached workspace and every recorded failure of this process (tests; a model
    that changes shape for good). Collective in effect: every rank of a group must release."""
    from .reference_backend import release_reference_workspaces

    _workspaces.clear()
    release_reference_workspaces()
    faults.forget_groups()
