"""Every rank of an EP group finishes a MoK call, or every rank stops with a clear error naming
the rank, the place and what to do: the errors, the host-side rendezvous with a timeout, and how
a rank that stops tells the others.

Three mechanisms (docs/architecture.md, "Errors, timeouts and agreement"):

* **Rendezvous on the host** (:func:`rendezvous`): a bounded exchange of small payloads through
  the ``torch.distributed`` store (the TCP store every process group is built on). Every rank
  writes its payload and waits, at most ``MoKConfig.timeout_s``, until every rank has; a rank
  that gives up records it in the store, so that a rank arriving later stops too instead of
  entering a collective nobody else will enter. It names the missing ranks, works for gloo
  and NCCL groups alike, and costs a few round trips to the store. The reference backend
  meets at every step of every call (forward dispatch and combine, backward dispatch and
  combine); the GPU backends only at the first call with new settings (the settings exchange)
  and at the workspace's creation: their per-call waits are the device barriers.
* **Failure words on the device** (csrc/include/mok/common.h): a GPU rank that stops before it
  queues a call (its own checks failed) stores a failure word into every peer's signal array;
  the peers' next barrier records it, their outputs of that call are NaN and their next call
  raises :class:`MoKPeerError` naming the rank. A barrier that times out sets the rank's
  failure word as well.
* **Sticky failures**: after a timeout (or ranks found out of step) the EP group's MoK state is
  unusable, as after an NCCL error: every later call and :func:`check_errors` raise again.
"""

from __future__ import annotations

import pickle
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist

from ..config import MoKConfigError
from .backend import BackendUnavailable
from .groups import EPGroup, LocalEPRank, global_rank_name, group_size_rank
from .validate import MoKInputError


class MoKRuntimeError(RuntimeError):
    """A problem detected during an earlier MoK call (a bad expert id, a token count above
    capacity, a peer that did not arrive or that stopped). The workspace is unusable afterwards:
    ranks may be out of step, so training must stop (as after an NCCL error)."""


class MoKTimeoutError(MoKRuntimeError):
    """A peer rank did not arrive at a MoK barrier or rendezvous within ``MoKConfig.timeout_s``."""


class MoKPeerError(MoKRuntimeError):
    """Another rank of the EP group stopped a MoK call (its own checks failed, or it gave up
    waiting for a rank); raised on the other ranks, naming it. On the reference backend and at
    a host rendezvous this is raised at that call; on the GPU backends the call's output is NaN
    and the next call (or :func:`megatron_mok.functional.check_errors`) raises it."""


class MoKCapacityError(ValueError):
    """A call has more tokens than the workspace was sized for."""


# Where a wait happened (MOK_STATUS_WHERE and the host rendezvous). 1-4 and 7-18 are the device's
# waits (the cuda backend's barriers, the megakernel's waits; the reference backend meets at
# 1-4 on the host too), 20-21 host rendezvous of the GPU backends.
SITE_OWN_CHECKS = 0
SITE_FWD_DISPATCH, SITE_FWD_COMBINE, SITE_BWD_DISPATCH, SITE_BWD_COMBINE = 1, 2, 3, 4
SITE_SETTINGS, SITE_WORKSPACE = 20, 21
SITE_NAMES = {
    SITE_OWN_CHECKS: "its own checks, before it queued the call",
    1: "forward dispatch (waiting for every rank to publish its tokens)",
    2: "forward combine (waiting for every rank to push its expert outputs)",
    3: "backward (waiting for every rank to publish its output gradients)",
    4: "backward (waiting for every rank to push its input gradients)",
    # The megakernel records 7, 8, 10 and 11 inside its launch (csrc/include/mok/megakernel.h).
    7: "forward megakernel, inside this rank's launch (fc1 waiting for its pulled rows)",
    8: "forward megakernel, inside this rank's launch (fc2 waiting for its row block's fc1)",
    10: "forward megakernel, inside this rank's launch (pull waiting for a free ring slot, i.e. "
        "for the fc2 tiles of the block before it)",
    11: "forward megakernel combine (waiting for every rank to push its expert outputs)",
    # The backward megakernel's waits (12-18, csrc/include/mok/megakernel.h, docs/training.md 2.5).
    12: "backward megakernel, inside this rank's launch (D2 waiting for its block's pulled output gradients, "
        "or a replayed block's recomputed fc1 pre-activation)",
    13: "backward megakernel, inside this rank's launch (replay waiting for its block's pulled rows)",
    14: "backward megakernel, inside this rank's launch (D1 waiting for its block's SwiGLU backward)",
    15: "backward megakernel, inside this rank's launch (weight gradient waiting for its unit's SwiGLU "
        "backward)",
    16: "backward megakernel, inside this rank's launch (pull waiting for a free slot, i.e. for the D1 "
        "and weight-gradient tiles of the block before it)",
    17: "backward megakernel, inside this rank's launch (weight gradient waiting for the previous unit's "
        "carry of its tiles)",
    18: "backward megakernel combine (waiting for every rank to push its input gradients)",
    SITE_SETTINGS: "settings exchange of the first call with these settings (every rank compares its "
                   "MoKConfig, sizes, dtype and backend)",
    SITE_WORKSPACE: "workspace creation (every rank agrees on the token capacity)",
}


def site_name(site: int) -> str:
    return SITE_NAMES.get(site, f"site {site}")


# Why a rank stopped (csrc/include/mok/common.h, MokFailureCode).
FAILURE_INPUT, FAILURE_CONFIG, FAILURE_BACKEND, FAILURE_CAPACITY, FAILURE_TIMEOUT, FAILURE_PEER, FAILURE_OTHER = \
    range(1, 8)
FAILURE_NAMES = {
    FAILURE_INPUT: "MoKInputError (its arguments failed mok_moe's checks)",
    FAILURE_CONFIG: "MoKConfigError (its configuration failed MoK's checks or differed from the other ranks')",
    FAILURE_BACKEND: "BackendUnavailable (the backend cannot run that call there)",
    FAILURE_CAPACITY: "MoKCapacityError (more tokens than the MoK workspace holds)",
    FAILURE_TIMEOUT: "MoKTimeoutError (it waited for another rank past MoKConfig.timeout_s; its error names "
                     "that rank)",
    FAILURE_PEER: "MoKPeerError (it learned that another rank had stopped)",
    FAILURE_OTHER: "an error",
}


def failure_code(err: BaseException) -> int:
    """The MokFailureCode of an exception a rank stops with."""
    if isinstance(err, MoKCapacityError):
        return FAILURE_CAPACITY
    if isinstance(err, MoKTimeoutError):
        return FAILURE_TIMEOUT
    if isinstance(err, MoKPeerError):
        return FAILURE_PEER
    if isinstance(err, MoKInputError):
        return FAILURE_INPUT
    if isinstance(err, BackendUnavailable):
        return FAILURE_BACKEND
    if isinstance(err, MoKConfigError):
        return FAILURE_CONFIG
    return FAILURE_OTHER


# ----------------------------------------------------------------------------------------------
# Messages shared by every backend (so a CPU run reads what a GPU run reads).


def timeout_message(ep_group: EPGroup, rank: int, missing: Sequence[int], timeout_s: float, site: int,
                    outputs_nan: bool) -> str:
    who = ", ".join(global_rank_name(ep_group, r) for r in missing) or "a rank"
    return (f"MoK: {global_rank_name(ep_group, rank)} waited more than {timeout_s:g} s for {who} at the "
            f"{site_name(site)}; that rank did not enter the same MoK layer call (every rank of the EP group "
            "must run the MoE layers in the same order, forward and backward), or it failed or stalled. "
            + ("Outputs of that call are NaN. " if outputs_nan else "")
            + "The EP group's MoK state is unusable: stop every rank (raise MoKConfig.timeout_s if that rank "
              "was only slow).")


def late_message(ep_group: EPGroup, rank: int, gave_up: int, timeout_s: float, site: int) -> str:
    return (f"MoK: {global_rank_name(ep_group, rank)} reached the {site_name(site)} after "
            f"{global_rank_name(ep_group, gave_up)} had stopped waiting for it there (MoKConfig.timeout_s = "
            f"{timeout_s:g} s on that rank): this rank was late by more than the timeout (a stalled host, or "
            "calls made in a different order). The EP group's MoK state is unusable: stop every rank.")


def peer_failed_message(ep_group: EPGroup, rank: int, failed: int, code: int, detail: str, *,
                        at_this_call: bool, site: Optional[int] = None) -> str:
    if at_this_call:
        outcome = "so every rank of the EP group stops this call"
    else:
        where = f" learned it at the {site_name(site)};" if site is not None else ""
        outcome = (f"{global_rank_name(ep_group, rank)}{where} its output of that call is NaN, and the MoK "
                   "workspace is unusable: every rank of the EP group must stop")
    return (f"MoK: {global_rank_name(ep_group, failed)} stopped "
            + ("this" if at_this_call else "an earlier") + f" MoK call with {FAILURE_NAMES.get(code, 'an error')}"
            + (f": {detail}" if detail else "; its own error says why")
            + f"; {outcome}. Fix what {global_rank_name(ep_group, failed)} reported.")


def own_stop_message(ep_group: EPGroup, rank: int, code: int) -> str:
    return (f"MoK: {global_rank_name(ep_group, rank)} stopped an earlier MoK call with "
            f"{FAILURE_NAMES.get(code, 'an error')} before queueing it (that error was raised then); its MoK "
            "workspace is out of step with its peers' and unusable. Every rank of the EP group must stop.")


def bad_id_message(ep_group: EPGroup, holders: Sequence[tuple], num_experts: int) -> str:
    """``holders``: (rank, bad id) pairs."""
    held = "; ".join(f"topk_ids of {global_rank_name(ep_group, r)} held expert id {v}" for r, v in holders)
    return (f"MoK: {held} in an earlier call; ids must lie in [0, {num_experts}) (E = experts per rank x EP "
            "size) or be -1 for an unused slot. Those routes were left out, the output of that call is NaN on "
            "every rank of the EP group, and the MoK workspace is unusable: stop, and fix the router of that "
            "rank (megatron_mok.functional.check_errors() after a step reports this without waiting for the "
            "next call).")


def capacity_message(ep_group: EPGroup, rank: int, tokens: int, capacity: int) -> str:
    return (f"this call has {tokens} tokens on {global_rank_name(ep_group, rank)}, but the MoK workspace holds "
            f"{capacity} per rank (agreed at the first call); set MoKConfig.max_tokens_per_rank "
            "(--mok-max-tokens-per-rank) to the largest token count any rank will see")


def renew(err: BaseException) -> BaseException:
    """A fresh exception of the same type and message (a sticky failure raised again, without
    the tracebacks of the earlier raises)."""
    try:
        return type(err)(*err.args)
    except Exception:  # noqa: BLE001 (an exception type with another signature)
        return MoKRuntimeError(str(err))


def raise_all(errors: List[BaseException]) -> None:
    """Raise the errors of :func:`check_errors`: one as it is; several as the first root cause's
    type (a timeout or a bad value before the errors of ranks that only learned of it) with
    every message."""
    if not errors:
        return
    if len(errors) == 1:
        raise renew(errors[0])
    first = sorted(errors, key=lambda e: isinstance(e, MoKPeerError))[0]
    unique = list(dict.fromkeys(str(e) for e in errors))
    raise type(first)(f"MoK recorded {len(unique)} errors:\n" + "\n".join(f"- {m}" for m in unique))


# ----------------------------------------------------------------------------------------------
# Per process group state.


@dataclass
class GroupState:
    """What this process knows about one EP process group."""

    rendezvous: int = 0                  # rendezvous made so far (the same on every rank)
    failure: Optional[BaseException] = None  # sticky: a timeout or ranks out of step
    last_path: Optional[str] = None      # "reference" or "gpu": how this rank's last call ran
    last_workspace: Optional[Any] = None  # weakref to the GPU workspace of the last call
    keys: List[str] = field(default_factory=list)


_groups: Dict[str, GroupState] = {}


def group_state(ep_group: dist.ProcessGroup) -> GroupState:
    name = ep_group.group_name
    state = _groups.get(name)
    if state is None:
        state = _groups[name] = GroupState()
    return state


def group_failures(ep_group: EPGroup = None) -> List[BaseException]:
    """The sticky failures of every process group (or of ``ep_group``)."""
    if ep_group is not None:
        if not isinstance(ep_group, dist.ProcessGroup):
            return []
        state = _groups.get(ep_group.group_name)
        return [state.failure] if state is not None and state.failure is not None else []
    return [s.failure for s in _groups.values() if s.failure is not None]


def forget_groups() -> None:
    """Drop every group's sticky failure (tests). Rendezvous counters are kept: every rank must
    keep counting the same rendezvous."""
    for state in _groups.values():
        state.failure = None


def note_gpu_call(ep_group: EPGroup, workspace) -> None:
    """Record the workspace a GPU backend's call on ``ep_group`` uses (where this rank tells its
    peers if it has to stop a later call before queueing it)."""
    if isinstance(ep_group, dist.ProcessGroup):
        state = group_state(ep_group)
        state.last_path = "gpu"
        state.last_workspace = weakref.ref(workspace)


# ----------------------------------------------------------------------------------------------
# The host rendezvous.


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception as err:  # noqa: BLE001
        raise RuntimeError(f"MoK: the torch.distributed store is not reachable ({err}); MoK's rendezvous of the "
                           "ranks of an EP group needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)") from err


_POLL_MIN_S, _POLL_MAX_S = 0.0002, 0.01


def _wait_for(store, key: str, timeout_s: float) -> Optional[bytes]:
    """The value of ``key`` once it exists, or None after ``timeout_s`` seconds. Polls with a
    growing pause (store.wait would log a warning at every timeout)."""
    deadline = time.monotonic() + timeout_s
    pause = _POLL_MIN_S
    while True:
        if store.check([key]):
            return store.get(key)
        now = time.monotonic()
        if now >= deadline:
            return None
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, _POLL_MAX_S)


def rendezvous(ep_group: dist.ProcessGroup, site: int, payload: Any, timeout_s: float, *,
               wait: bool = True) -> Optional[List[Any]]:
    """Every rank of ``ep_group`` meets here with a small picklable ``payload``; returns the
    payloads of every rank (index = EP rank).

    Bounded: a rank waits at most ``timeout_s`` for the others, then raises
    :class:`MoKTimeoutError` naming the missing ranks and ``site``, and records in the store that
    it gave up, so a rank arriving later raises too (naming the rank that gave up) instead of
    going on alone. Either makes the group's MoK state fail (sticky). Every rank must make the
    same rendezvous in the same order (they are counted per group).

    ``wait=False``: write this rank's payload and return None at once (a rank that stops a call
    tells the others without waiting for them).
    """
    state = group_state(ep_group)
    if state.failure is not None:
        raise renew(state.failure)
    P, rank = group_size_rank(ep_group)
    n = state.rendezvous
    state.rendezvous += 1
    store = _store()
    prefix = f"mok/{ep_group.group_name}/{n}"
    store.set(f"{prefix}/{rank}", pickle.dumps(payload))
    arrived = store.add(f"{prefix}/arrived", 1)
    timed_out = False
    if arrived >= P:
        outcome = store.compare_set(f"{prefix}/done", "", "ok")
    elif not wait:
        return None
    else:
        outcome = _wait_for(store, f"{prefix}/done", timeout_s)
        if outcome is None:
            timed_out = True
            missing = [r for r in range(P) if not store.check([f"{prefix}/{r}"])]
            outcome = store.compare_set(f"{prefix}/done", "", f"gave-up:{rank}:{','.join(map(str, missing))}")
    if outcome == b"ok":
        values = None
        if wait:
            values = [pickle.loads(v) for v in store.multi_get([f"{prefix}/{r}" for r in range(P)])]
        if n >= 2:  # every rank has read rendezvous n - 2 (each set its n - 1 payload after)
            old = f"mok/{ep_group.group_name}/{n - 2}"
            for key in [f"{old}/{rank}"] + ([f"{old}/arrived", f"{old}/done"] if rank == 0 else []):
                try:
                    store.delete_key(key)
                except Exception:  # noqa: BLE001 (a store without deletion: the keys stay)
                    pass
        return values
    if not wait:
        return None
    _, gave_up, missing_text = outcome.decode().split(":", 2)
    missing = [int(r) for r in missing_text.split(",") if r]
    if timed_out or rank not in missing:
        err: MoKRuntimeError = MoKTimeoutError(timeout_message(ep_group, rank, [r for r in missing if r != rank],
                                                               timeout_s, site, outputs_nan=False))
    else:
        err = MoKTimeoutError(late_message(ep_group, rank, int(gave_up), timeout_s, site))
    state.failure = err
    raise err


def exchange(ep_group: dist.ProcessGroup, site: int, step: str, timeout_s: float, signature=None,
             **fields) -> List[dict]:
    """:func:`rendezvous` with the checks every MoK rendezvous makes: a rank that stopped this
    call raises :class:`MoKPeerError` here on every other rank; ranks at different steps (one in
    a forward, another in a backward) raise :class:`MoKMismatchError` and make the group fail;
    ``signature`` (when given) must be every rank's (else :class:`MoKMismatchError` naming the
    ranks, the fields and the values). Returns every rank's payload dict."""
    from .agreement import MoKMismatchError, mismatch_message

    P, rank = group_size_rank(ep_group)
    payloads = rendezvous(ep_group, site, dict(step=step, site=site, signature=signature, **fields), timeout_s)
    failed = [(r, p["failure"]) for r, p in enumerate(payloads) if p.get("failure")]
    if failed:
        r, (code, _name, message) = failed[0]
        raise MoKPeerError(peer_failed_message(ep_group, rank, r, code, message, at_this_call=True)
                           + "".join(f" ({global_rank_name(ep_group, q)} stopped too: {m})"
                                     for q, (_, _, m) in failed[1:]))
    steps = {r: p["step"] for r, p in enumerate(payloads)}
    if signature is not None and all(p.get("signature") is not None for p in payloads):
        by_rank = {r: p["signature"] for r, p in enumerate(payloads)}
        if any(s != signature for s in by_rank.values()):
            raise MoKMismatchError(mismatch_message(ep_group, by_rank))
    if len(set(steps.values())) > 1:
        err = MoKMismatchError(
            "MoK: the ranks of the expert-parallel group are at different steps: "
            + ", ".join(f"{global_rank_name(ep_group, r)} at the {site_name(payloads[r]['site'])}" for r in steps)
            + ". Every rank must run the same MoE layer calls in the same order (forward and backward, "
              "recomputation included). The EP group's MoK state is unusable: stop every rank.")
        group_state(ep_group).failure = err
        raise err
    return payloads


# ----------------------------------------------------------------------------------------------
# A rank that stops a call before running it tells the others.


def announce_failure(ep_group: EPGroup, err: BaseException, *, failed_rank: Optional[int] = None,
                     failed_code: Optional[int] = None, compared: bool = False) -> None:
    """Tell the other ranks of ``ep_group`` that this rank stops the current call with ``err``
    (raised before it queued anything), so that none of them waits for it in vain:

    * virtual ranks: the ranks issued after it raise :class:`MoKPeerError` at this call, before
      they queue anything (:func:`agreement.agree`); the ranks issued before it, already queued,
      stop at their dispatch barrier through this rank's failure word (their outputs are NaN and
      their next call raises);
    * a process group whose last call ran on a GPU backend: the failure word, the same way;
    * otherwise (the reference backend, or no call yet on the group): the call's first
      rendezvous, without waiting; every other rank raises :class:`MoKPeerError` at this call.

    ``failed_rank``, ``failed_code``: the rank that stopped first and why (default: this one,
    ``err``); ``compared``: the call already went through the virtual ranks' agreement (which
    recorded it). Best effort: never raises (the caller raises ``err``)."""
    try:
        _announce(ep_group, err, failed_rank, failed_code, compared)
    except Exception:  # noqa: BLE001 (the original error matters more than a failed announcement)
        pass


def record_virtual_stop(ep_group: LocalEPRank, failed: int, code: int, message: str) -> None:
    """Record virtual rank ``ep_group``'s current call as stopped (``failed`` stopped it first):
    the ranks issued after it raise :class:`MoKPeerError` at that call (agreement.agree)."""
    group, rank = ep_group.group, ep_group.rank
    n = group.calls[rank]
    by_rank = group.signatures.setdefault(n, {})
    by_rank[rank] = ("failed", failed, code, message)
    group.calls[rank] = n + 1
    if len(by_rank) == group.size:
        del group.signatures[n]


def _announce(ep_group: EPGroup, err: BaseException, failed_rank: Optional[int], failed_code: Optional[int],
              compared: bool) -> None:
    P, rank = group_size_rank(ep_group)
    if P == 1 or ep_group is None:
        return
    code = failure_code(err) if failed_code is None else failed_code
    failed = rank if failed_rank is None else failed_rank
    if isinstance(ep_group, LocalEPRank):
        group = ep_group.group
        if not compared:  # mark this rank's call as stopped for the ranks issued after it
            record_virtual_stop(ep_group, failed, code, str(err))
        key = getattr(group, "last_shape_key", None)
        workspaces = group.shared_workspaces.get(key) if key is not None else None
        if workspaces is not None:
            workspaces[rank].signal_failure(code, failed)
        return
    state = group_state(ep_group)
    if state.failure is not None:
        return
    if state.last_path == "gpu":
        ws = state.last_workspace() if state.last_workspace is not None else None
        if ws is not None:
            ws.signal_failure(code, failed)
        return
    rendezvous(ep_group, SITE_FWD_DISPATCH, dict(step="call", site=SITE_FWD_DISPATCH,
                                                 failure=(code, type(err).__name__, str(err))), 0.0, wait=False)
