"""Expert-parallel groups: a ``torch.distributed`` process group, or P virtual ranks in one
process on one GPU (:class:`LocalEPGroup`, docs/design.md, "Virtual ranks").

Virtual ranks let the cross-rank logic (peer pointers, flags, barriers) run where only one GPU
is lent: each rank has its own buffers and its own stream, and the ranks' kernels run
concurrently on the one device. They do not replace real multi-GPU runs.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import os

import torch
import torch.distributed as dist


class LocalEPGroup:
    """P expert-parallel ranks simulated in one process on one CUDA device.

    Use one :class:`LocalEPRank` per rank as the ``ep_group`` of ``mok_moe``, and run each
    rank's calls on its own stream (``torch.cuda.stream(group.streams[r])``), issuing the
    ranks' calls one after another from the host; the device runs them concurrently.
    """

    def __init__(self, size: int, device: Optional[torch.device] = None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"LocalEPGroup size={size!r} must be an integer of at least 1 (the number of "
                             "virtual ranks)")
        if device is not None and not isinstance(device, (torch.device, str, int)):
            raise TypeError(f"LocalEPGroup device={device!r} ({type(device).__name__}) must be None (the current "
                            "CUDA device), a torch.device, a string such as 'cuda:0' or a device index")
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"LocalEPGroup device={device!r}: virtual ranks run the GPU backends, on a CUDA "
                             "device")
        if not torch.cuda.is_available():
            raise RuntimeError("LocalEPGroup needs a CUDA device (virtual ranks run MoK's GPU backends on one "
                               "GPU); this machine has none visible. Without a GPU, run P ranks as processes with "
                               "the reference backend (torch.distributed, gloo)")
        _require_eager_module_loading()
        self.size = size
        self.device = torch.device(device if device is not None else torch.cuda.current_device())
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.streams = [torch.cuda.Stream(self.device) for _ in range(size)] if self.device.type == "cuda" else []
        self.ranks = [LocalEPRank(self, r) for r in range(size)]
        # Shared by the ranks: every rank's workspace of one shape is created together.
        self.shared_workspaces: dict = {}
        # Call signatures by call index, until every rank has made that call (agreement.agree).
        self.signatures: dict = {}
        self.calls = [0] * size
        # The workspace shape the ranks used last (where a rank that stops a call tells the others).
        self.last_shape_key = None

    def __getitem__(self, rank: int) -> "LocalEPRank":
        if isinstance(rank, bool) or not isinstance(rank, int) or not -self.size <= rank < self.size:
            raise IndexError(f"LocalEPGroup has {self.size} ranks (0 to {self.size - 1}); rank {rank!r} is not one")
        return self.ranks[rank]

    def __len__(self) -> int:
        return self.size


def _require_eager_module_loading() -> None:
    """Virtual ranks spin-wait on each other inside one CUDA context. With lazy module loading
    (CUDA's default), the first launch of a kernel may wait for the context to go idle, while a
    rank's barrier kernel spins until another rank's kernels run: a deadlock until the timeout.
    Eager loading avoids it; it must be chosen before CUDA starts in the process."""
    if os.environ.get("CUDA_MODULE_LOADING") == "EAGER":
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "LocalEPGroup needs CUDA_MODULE_LOADING=EAGER, set before CUDA is initialised in this "
            "process (lazy kernel loading can deadlock ranks that spin-wait on each other in one "
            "CUDA context); set it in the environment of the program")
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"


class LocalEPRank:
    """Rank ``rank`` of a :class:`LocalEPGroup`; pass it as ``ep_group``."""

    def __init__(self, group: LocalEPGroup, rank: int):
        self.group = group
        self.rank = rank

    def size(self) -> int:
        return self.group.size


EPGroup = Union[None, dist.ProcessGroup, LocalEPRank]


_process_group_size_rank: Dict[dist.ProcessGroup, Tuple[int, int]] = {}


def check_ep_group(ep_group) -> None:
    """Raise ``TypeError`` unless ``ep_group`` is None, a ``torch.distributed`` process group or
    a :class:`LocalEPRank`."""
    if isinstance(ep_group, LocalEPGroup):
        raise TypeError(f"ep_group is a LocalEPGroup of {ep_group.size} virtual ranks; pass one rank of it, "
                        "group[r] (a LocalEPRank), as each rank's ep_group")
    if isinstance(ep_group, int) and ep_group == dist.GroupMember.NON_GROUP_MEMBER:
        raise TypeError("ep_group is GroupMember.NON_GROUP_MEMBER: this rank is not a member of the process group "
                        "(torch.distributed.new_group returns that on the ranks it does not list); pass the "
                        "expert-parallel group this rank belongs to")
    if ep_group is not None and not isinstance(ep_group, (dist.ProcessGroup, LocalEPRank)):
        raise TypeError(
            f"ep_group={ep_group!r} ({type(ep_group).__name__}) is not supported; pass None (one rank), the "
            "expert-parallel torch.distributed.ProcessGroup (e.g. dist.group.WORLD or a group from "
            "dist.new_group), or a LocalEPRank of a LocalEPGroup (virtual ranks)")


def group_size_rank(ep_group: EPGroup) -> Tuple[int, int]:
    """(P, this rank's index) of an EP group; (1, 0) for None."""
    if ep_group is None:
        return 1, 0
    if isinstance(ep_group, LocalEPRank):
        return ep_group.group.size, ep_group.rank
    # A process group's size and rank never change; asking it (or dist.get_rank(group)) costs
    # ~10 us of host time, twice per layer call.
    known = _process_group_size_rank.get(ep_group)
    if known is None:
        known = _process_group_size_rank[ep_group] = (ep_group.size(), ep_group.rank())
    return known


def global_rank_name(ep_group: EPGroup, rank: int) -> str:
    """How to name EP rank ``rank`` in a message: with its global rank when there is one."""
    if isinstance(ep_group, dist.ProcessGroup):
        try:
            return f"EP rank {rank} (global rank {dist.get_global_rank(ep_group, rank)})"
        except (RuntimeError, ValueError):
            pass
    return f"EP rank {rank}"
