"""Start-up check that the expert-parallel group can use MoK's GPU backends.

The ``cuda`` and ``megakernel`` backends move token rows with direct loads and stores into the
memory of the other ranks of the EP group (pull dispatch, push combine over NVLink). That needs
every pair of ranks of the group to have peer access: GPUs of one node joined by NVLink, or
GPUs of several nodes of one multi-node NVLink domain (NVL72-style racks, where the driver
exposes IMEX channels). An EP group spanning ordinary nodes (InfiniBand between them) cannot
run these backends; this module turns that into an error at layer construction instead of a
hang or a crash in the first forward.
"""

from __future__ import annotations

import os
import socket
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..functional.backends import BackendUnavailable, gpu_unavailable_reason

__all__ = ["EPTopologyError", "gpu_backend_will_run", "check_ep_peer_access", "peer_access_problem"]

_IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"


class EPTopologyError(RuntimeError):
    """The EP group's GPUs cannot reach each other's memory as the MoK GPU backends need."""


def gpu_backend_will_run(backend: str) -> bool:
    """Whether ``backend`` ("auto", "cuda", "megakernel", "reference") will run a GPU backend
    on the current CUDA device. An explicitly requested GPU backend that cannot run here raises
    :class:`BackendUnavailable` with the reason."""
    if backend == "reference" or not torch.cuda.is_available():
        if backend in ("cuda", "megakernel"):
            raise BackendUnavailable(f"--mok-backend {backend} needs a CUDA GPU; none is available")
        return False
    reason = gpu_unavailable_reason(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    if reason is None:
        return True
    if backend in ("cuda", "megakernel"):
        raise BackendUnavailable(f"--mok-backend {backend} cannot run: {reason}")
    return False


def _describe_this_rank() -> Tuple[str, int, bool]:
    return socket.gethostname(), torch.cuda.current_device(), os.path.isdir(_IMEX_CHANNELS)


def peer_access_problem(ranks: List[Tuple[str, int, bool]],
                        can_access=None) -> Optional[str]:
    """Why the EP ranks described by ``ranks`` cannot use peer loads/stores, or None.

    Args:
        ranks: per EP rank, (host name, CUDA device index on that host, whether the host exposes
            IMEX channels, i.e. sits in a multi-node NVLink domain).
        can_access: ``f(device_a, device_b) -> bool`` for two devices of this host; defaults to
            ``torch.cuda.can_device_access_peer``. Devices this process cannot see are skipped.
    """
    if can_access is None:
        can_access = torch.cuda.can_device_access_peer
    hosts = {}
    for ep_rank, (host, device, imex) in enumerate(ranks):
        hosts.setdefault(host, []).append((ep_rank, device, imex))
    if len(hosts) > 1 and not all(imex for _, _, imex in ranks):
        names = ", ".join(f"{h} (EP ranks {[r for r, _, _ in members]})" for h, members in hosts.items())
        return (f"the EP group spans {len(hosts)} nodes ({names}) that are not in one multi-node "
                f"NVLink domain ({_IMEX_CHANNELS} is missing on some), and MoK's GPU backends move "
                "tokens with direct peer loads/stores over NVLink. Keep --expert-model-parallel-size "
                "within one node (or one NVL72 rack), or use --mok-backend reference (slow)")
    here = socket.gethostname()
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = [(r, d) for r, d, _ in hosts.get(here, []) if d < visible]
    for i, (rank_a, dev_a) in enumerate(local):
        for rank_b, dev_b in local[i + 1:]:
            if dev_a != dev_b and not can_access(dev_a, dev_b):
                return (f"EP ranks {rank_a} and {rank_b} on {here} use GPUs {dev_a} and {dev_b}, "
                        "which have no peer access to each other (no NVLink/P2P path), and MoK's "
                        "GPU backends move tokens with direct peer loads/stores. Place the EP group "
                        "on NVLink-connected GPUs, or use --mok-backend reference (slow)")
    return None


_CHECKED_GROUPS: set = set()
"""Rank tuples of the EP groups already checked in this process."""


def check_ep_peer_access(ep_group: Optional[dist.ProcessGroup]) -> None:
    """Raise :class:`EPTopologyError` when the ranks of ``ep_group`` lack the peer access the
    MoK GPU backends need. Collective over the EP group (every rank must call it); done once
    per group. Call it only when a GPU backend will run (:func:`gpu_backend_will_run`).

    Args:
        ep_group: the expert-parallel process group (None or size 1: nothing to check).
    """
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return
    key = tuple(dist.get_process_group_ranks(ep_group))
    if key in _CHECKED_GROUPS:
        return
    gathered: List[Optional[Tuple[str, int, bool]]] = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(gathered, _describe_this_rank(), group=ep_group)
    problem = peer_access_problem(gathered)  # type: ignore[arg-type]
    if problem is not None:
        raise EPTopologyError(f"--moe-token-dispatcher-type mok: {problem}")
    _CHECKED_GROUPS.add(key)
