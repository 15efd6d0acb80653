"""Every rank of an EP group runs a call with the same settings, or every rank stops with the
same error.

The ranks of a call read each other's memory through layouts and schedules that each rank
derives from its own sizes and tunables, so a difference (another ``tile_rows``, another hidden
size, another backend) would give wrong answers or out-of-bounds peer accesses, not an error.
At the first call of each (EP group, signature) every rank exchanges its signature (the
config's every field, the sizes that fix the layouts, the dtypes and the backend it chose) and
compares it with every other rank's; later calls with the same signature cost a set lookup.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from ..config import MoKConfig, MoKConfigError
from .groups import EPGroup, LocalEPRank, global_rank_name
from .validate import MoEShape

_agreed: Set[tuple] = set()


class MoKMismatchError(MoKConfigError):
    """The ranks of an EP group called MoK with different settings; raised on every rank."""


def agree_on_call(ep_group: EPGroup, config: MoKConfig, shape: MoEShape, dtype: torch.dtype, backend: str) -> None:
    """:func:`agree` on the signature of a call (:func:`call_signature`); nothing for P = 1."""
    if ep_group is None:
        return
    agree(ep_group, call_signature(config, shape.hidden, shape.topk, shape.experts_per_rank, shape.ffn_hidden,
                                   dtype, backend))


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


def agree(ep_group: EPGroup, signature: Tuple[Tuple[str, str], ...]) -> None:
    """Check that every rank of ``ep_group`` calls with ``signature`` (:func:`call_signature`).

    On a process group this is collective at the first call of each signature (an
    ``all_gather_object``): every rank must reach it, as every rank runs the same MoE layers in
    the same order. Virtual ranks (:class:`LocalEPRank`) compare with the ranks of their group
    that made the same call (their n-th) before them.

    Raises:
        MoKMismatchError: on every rank of a process group (on the calling virtual rank), naming
            the ranks, the field and the values that differ.
    """
    if ep_group is None:
        return
    if isinstance(ep_group, LocalEPRank):
        # The ranks' calls are issued one rank after another: rank r's n-th call is compared with
        # the n-th call of the ranks that made it already (kept until every rank has).
        group, rank = ep_group.group, ep_group.rank
        n = group.calls[rank]
        by_rank: Dict[int, tuple] = group.signatures.setdefault(n, {})
        for other, theirs in by_rank.items():
            if theirs != signature:
                _raise_mismatch(ep_group, {other: theirs, rank: signature})
        by_rank[rank] = signature
        group.calls[rank] = n + 1
        if len(by_rank) == group.size:
            del group.signatures[n]
        return
    key = (ep_group.group_name, signature)
    if key in _agreed:
        return
    gathered: List[tuple] = [None] * ep_group.size()
    dist.all_gather_object(gathered, signature, group=ep_group)
    if any(theirs != signature for theirs in gathered):
        _raise_mismatch(ep_group, dict(enumerate(gathered)))
    _agreed.add(key)


def _raise_mismatch(ep_group: EPGroup, by_rank: Dict[int, tuple]) -> None:
    """Raise the error naming every field on which the ranks of ``by_rank`` differ."""
    ranks = sorted(by_rank)
    names = [name for name, _ in by_rank[ranks[0]]]
    lines = []
    for i, name in enumerate(names):
        values = {r: dict(by_rank[r]).get(name, "<missing>") for r in ranks}
        if len(set(values.values())) > 1:
            lines.append(f"  {name}: " + ", ".join(f"{global_rank_name(ep_group, r)} has {v}"
                                                   for r, v in values.items()))
    raise MoKMismatchError(
        "MoK: the ranks of the expert-parallel group called the MoE layer with different settings:\n"
        + "\n".join(lines)
        + "\nEvery rank must use the same MoKConfig (the same --mok-* flags), model sizes and dtype.")
