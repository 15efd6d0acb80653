"""Every rank of an EP group runs a call with the same settings, or every rank stops with the
same error.

The ranks of a call read each other's memory through layouts and schedules that each rank
derives from its own sizes and tunables, so a difference (another ``tile_rows``, another hidden
size, another backend) would give wrong answers or out-of-bounds peer accesses, not an error.
Every rank compares its call signature (the config's every field, the sizes that fix the
layouts, the dtypes and the backend it chose) with every other rank's before any data moves:

* the GPU backends at the first call of each (EP group, signature), through a bounded
  rendezvous of the ranks (``faults.exchange``; later calls with the same signature cost a set
  lookup);
* the reference backend at every call, in the rendezvous that opens it (it meets the other
  ranks there anyway);
* virtual ranks (:class:`LocalEPRank`) in the process, each call against the same call of the
  ranks issued before it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Set, Tuple

import torch

from ..config import MoKConfig, MoKConfigError
from .faults import (FAILURE_CONFIG, SITE_SETTINGS, MoKPeerError, exchange, peer_failed_message,
                     record_virtual_stop)
from .groups import EPGroup, LocalEPRank, global_rank_name
from .validate import MoEShape

_agreed: Set[tuple] = set()


class MoKMismatchError(MoKConfigError):
    """The ranks of an EP group called MoK with different settings; raised on every rank."""


def agree_on_call(ep_group: EPGroup, config: MoKConfig, shape: MoEShape, dtype: torch.dtype, backend: str) -> None:
    """:func:`agree` on the signature of a call (:func:`call_signature`); nothing for P = 1, and
    nothing on a process group for the reference backend, which compares the signature in the
    rendezvous that opens each of its calls (``reference_backend``)."""
    if ep_group is None or (backend == "reference" and not isinstance(ep_group, LocalEPRank)):
        return
    agree(ep_group, call_signature(config, shape.hidden, shape.topk, shape.experts_per_rank, shape.ffn_hidden,
                                   dtype, backend), timeout_s=float(config.timeout_s))


@functools.lru_cache(maxsize=256)
def call_signature(config: MoKConfig, hidden: int, topk: int, experts_per_rank: int, ffn_hidden: int,
                   dtype: torch.dtype, backend: str) -> Tuple[Tuple[str, str], ...]:
    """The settings every rank of the EP group must share for a call, as (field, value) pairs:
    every field of ``config`` (``megakernel.*`` for the nested tunables), H, K, experts per rank,
    I, the tokens' dtype and the backend. The token count is not part of it: it may differ
    between ranks (the workspace capacity is agreed separately). Cached: every layer asks on
    every call."""
    fields: List[Tuple[str, str]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            fields += [(f"{f.name}.{g.name}", repr(getattr(value, g.name))) for g in dataclasses.fields(value)]
        else:
            fields.append((f.name, repr(value)))
    fields += [("hidden size H", repr(hidden)), ("top-k K", repr(topk)),
               ("experts per rank", repr(experts_per_rank)), ("expert FFN size I", repr(ffn_hidden)),
               ("dtype", str(dtype)), ("backend", backend)]
    return tuple(fields)


def agree(ep_group: EPGroup, signature: Tuple[Tuple[str, str], ...], *, timeout_s: float = 60.0) -> None:
    """Check that every rank of ``ep_group`` calls with ``signature`` (:func:`call_signature`).

    On a process group this is a rendezvous of every rank (bounded by ``timeout_s``) at the first
    call of each signature: every rank must reach it, as every rank runs the same MoE layers in
    the same order. Virtual ranks (:class:`LocalEPRank`) compare with the ranks of their group
    that made the same call (their n-th) before them.

    Raises:
        MoKMismatchError: on every rank of a process group (on the calling virtual rank), naming
            the ranks, the field and the values that differ.
        MoKPeerError: a rank stopped this call (its own checks failed) before it got here.
        MoKTimeoutError: a rank did not arrive within ``timeout_s`` (naming it).
    """
    if ep_group is None:
        return
    if isinstance(ep_group, LocalEPRank):
        # The ranks' calls are issued one rank after another: rank r's n-th call is compared with
        # the n-th call of the ranks that made it already (kept until every rank has).
        group, rank = ep_group.group, ep_group.rank
        n = group.calls[rank]
        by_rank: Dict[int, tuple] = group.signatures.setdefault(n, {})
        stopped = [theirs for theirs in by_rank.values() if theirs and theirs[0] == "failed"]
        if stopped:  # a rank issued before this one stopped this call: this one stops too
            _, failed, code, message = stopped[0]
            record_virtual_stop(ep_group, failed, code, message)
            err = MoKPeerError(peer_failed_message(ep_group, rank, failed, code, message, at_this_call=True))
            err.failed_rank, err.failed_code = failed, code
            raise err
        for other, theirs in by_rank.items():
            if theirs != signature:
                message = mismatch_message(ep_group, {other: theirs, rank: signature})
                record_virtual_stop(ep_group, rank, FAILURE_CONFIG, message)
                raise MoKMismatchError(message)
        by_rank[rank] = signature
        group.calls[rank] = n + 1
        if len(by_rank) == group.size:
            del group.signatures[n]
        return
    if ep_group.size() == 1:
        return
    key = (ep_group.group_name, signature)
    if key in _agreed:
        return
    exchange(ep_group, SITE_SETTINGS, "call", timeout_s, signature=signature)
    _agreed.add(key)


def mismatch_message(ep_group: EPGroup, by_rank: Dict[int, tuple]) -> str:
    """The message naming every field on which the ranks of ``by_rank`` differ."""
    ranks = sorted(by_rank)
    names = list(dict.fromkeys(name for r in ranks for name, _ in by_rank[r]))
    lines = []
    for name in names:
        values = {r: dict(by_rank[r]).get(name, "<missing>") for r in ranks}
        if len(set(values.values())) > 1:
            lines.append(f"  {name}: " + ", ".join(f"{global_rank_name(ep_group, r)} has {v}"
                                                   for r, v in values.items()))
    return ("MoK: the ranks of the expert-parallel group called the MoE layer with different settings:\n"
            + "\n".join(lines)
            + "\nEvery rank must use the same MoKConfig (the same --mok-* flags), model sizes and dtype.")
