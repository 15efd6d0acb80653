"""Start-up check that every expert-parallel group lies in one NVLink domain.

The ``cuda`` and ``megakernel`` backends move token rows with direct loads and stores into the
memory of the other ranks of the EP group (pull dispatch, push combine over NVLink). That needs
the whole group in one NVLink domain:

* the GPUs of one host (one host is one domain), with peer access between every pair;
* or GPUs of several hosts that NVML places in the same multi-node NVLink fabric: the same
  cluster UUID and clique id (``nvmlDeviceGetGpuFabricInfo``; an NVL72 rack, or the NVLink
  partition of one). A GPU whose fabric registration is not complete, or that has no fabric
  (HGX/DGX H100/H200 nodes: "not supported"), is in no multi-node domain.

Where it is decided:

* at argument validation (:func:`check_ep_domains_at_startup`, called from ``validate_args``),
  when the job was started by torchrun: each rank puts what NVML says about its GPU in
  torchrun's key-value store and reads its EP group's answers, before any process group or
  model exists; the EP groups come from Megatron's own rank layout;
* otherwise (a launcher without torchrun's store, programmatic use such as Megatron-Bridge) at
  the construction of the first MoK layer of each EP group (:func:`check_ep_group`), over the
  EP process group.

Either way a problem is one :class:`EPTopologyError` naming the ranks and hosts that fall
outside the group's domain. NVML is read with ctypes from ``libnvidia-ml.so.1`` (the driver's);
no Python package is needed.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["EPTopologyError", "GpuPlace", "query_gpu_place", "nvml_fabric", "ep_domain_problem",
           "peer_access_problem", "check_ep_group", "check_ep_domains_at_startup", "expert_parallel_groups",
           "exchange_places"]

FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
"""``nvmlGpuFabricState_t`` values."""
_NVML_SUCCESS = 0
_NVML_LIBRARY = "libnvidia-ml.so.1"
_STORE_TIMEOUT_S = 600.0


class EPTopologyError(RuntimeError):
    """The EP group's GPUs cannot reach each other's memory as the MoK GPU backends need."""


@dataclass(frozen=True)
class GpuPlace:
    """Where one rank's GPU sits.

    Attributes:
        host: the host name.
        device: the CUDA device index on that host (as the process sees it).
        cluster_uuid: the NVLink fabric's cluster UUID (hex), or None when the GPU is in no
            multi-node NVLink domain.
        clique_id: the fabric clique id, or None (same condition).
        fabric: NVML's fabric state ("completed", "not supported", ...) or why it could not be
            read.
    """

    host: str
    device: int
    cluster_uuid: Optional[str] = None
    clique_id: Optional[int] = None
    fabric: str = "not supported"

    @property
    def domain(self) -> Optional[Tuple[str, int]]:
        """(cluster UUID, clique id) of the multi-node NVLink domain, or None."""
        if self.cluster_uuid is None or self.clique_id is None:
            return None
        return self.cluster_uuid, self.clique_id

    def describe_fabric(self) -> str:
        if self.domain is not None:
            return f"NVLink cluster {self.cluster_uuid[:8]}..., clique {self.clique_id}"
        return f"no multi-node NVLink fabric: NVML fabric state {self.fabric!r}"


class _FabricInfo(ctypes.Structure):
    """``nvmlGpuFabricInfo_t`` (nvml.h): the v1 struct of ``nvmlDeviceGetGpuFabricInfo``."""

    _fields_ = [("clusterUuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int), ("cliqueId", ctypes.c_uint),
                ("state", ctypes.c_ubyte)]


def nvml_fabric(uuid: str, library: str = _NVML_LIBRARY) -> Tuple[Optional[str], Optional[int], str]:
    """NVML's fabric information of the GPU with UUID ``uuid`` ("GPU-..."): (cluster UUID as hex
    or None, clique id or None, state or why it could not be read). A cluster UUID of all zeros,
    or a registration that is not complete or failed, gives (None, None, why)."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError as err:
        return None, None, f"NVML unavailable ({err})"
    if not hasattr(nvml, "nvmlDeviceGetGpuFabricInfo"):
        return None, None, "NVML of this driver has no fabric information"
    if nvml.nvmlInit_v2() != _NVML_SUCCESS:
        return None, None, "nvmlInit failed"
    try:
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != _NVML_SUCCESS:
            return None, None, f"NVML does not know GPU {uuid}"
        info = _FabricInfo()
        code = nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        if code != _NVML_SUCCESS:
            return None, None, "not supported" if code == 3 else f"nvmlDeviceGetGpuFabricInfo returned {code}"
        state = FABRIC_STATES.get(info.state, f"state {info.state}")
        if state != "completed":
            return None, None, state
        if info.status != _NVML_SUCCESS:
            return None, None, f"completed with error {info.status}"
        cluster = bytes(info.clusterUuid).hex()
        if not int(cluster, 16):
            return None, None, "completed without a cluster UUID"
        return cluster, int(info.cliqueId), state
    finally:
        nvml.nvmlShutdown()


def _uuid_of(device: int) -> str:
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else "GPU-" + uuid


def query_gpu_place(device: int, fabric: Callable[[str], Tuple[Optional[str], Optional[int], str]] = nvml_fabric
                    ) -> GpuPlace:
    """This process's host and what NVML says about CUDA device ``device``'s NVLink fabric."""
    cluster, clique, state = fabric(_uuid_of(device))
    return GpuPlace(host=socket.gethostname(), device=device, cluster_uuid=cluster, clique_id=clique, fabric=state)


def _ranges(ranks: Sequence[int]) -> str:
    """"0-7, 9" for [0, ..., 7, 9]."""
    out, ranks = [], sorted(ranks)
    start = prev = None
    for r in ranks + [None]:
        if start is not None and (r is None or r != prev + 1):
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if r is not None and start is None:
            start = r
        prev = r
    return ", ".join(out)


def ep_domain_problem(members: Sequence[Tuple[int, GpuPlace]], *, ep_size: Optional[int] = None) -> Optional[str]:
    """Why the EP group of ``members`` ((global rank, place) in EP-rank order) is not in one
    NVLink domain, or None. One host is one domain; across hosts every GPU needs the fabric
    domain (cluster UUID, clique id) of the group's first rank. The message names the ranks and
    hosts outside that domain and what to do."""
    if not members:
        return None
    hosts = []
    for _, place in members:
        if place.host not in hosts:
            hosts.append(place.host)
    if len(hosts) == 1:
        return None
    first_rank, first = members[0]
    outside: Dict[str, List[int]] = {}
    fabric_of: Dict[str, str] = {}
    for rank, place in members:
        inside = place.host == first.host or (first.domain is not None and place.domain == first.domain)
        if not inside:
            outside.setdefault(place.host, []).append(rank)
            fabric_of.setdefault(place.host, place.describe_fabric())
    if not outside:
        return None
    all_ranks = [r for r, _ in members]
    listed = "; ".join(f"ranks {_ranges(ranks)} on host {host} ({fabric_of[host]})" for host, ranks in outside.items())
    size = ep_size or len(members)
    return (f"expert_model_parallel_size={size}: the EP group of ranks {_ranges(all_ranks)} spans hosts "
            f"{', '.join(hosts)} and is not one NVLink domain, which MoK's GPU backends need (they move tokens "
            f"with direct loads and stores into the other GPUs' memory). Outside the domain of rank {first_rank} "
            f"(host {first.host}, {first.describe_fabric()}): {listed}; keep every EP group inside one host or "
            "one multi-node NVLink domain (an NVL72 rack): Megatron puts an EP group on consecutive ranks "
            "(order tp-cp-ep-dp-pp), so lower --expert-model-parallel-size (or the tensor/context-parallel "
            "sizes before it), or use --moe-token-dispatcher-type alltoall or flex across domains")


def peer_access_problem(members: Sequence[Tuple[int, GpuPlace]], can_access=None) -> Optional[str]:
    """Why two ranks of ``members`` on this host cannot use peer loads/stores, or None.

    Args:
        members: (global rank, place) of the EP group's ranks.
        can_access: ``f(device_a, device_b) -> bool`` for two devices of this host; defaults to
            ``torch.cuda.can_device_access_peer``. Devices this process cannot see are skipped.
    """
    if can_access is None:
        can_access = torch.cuda.can_device_access_peer
    here = socket.gethostname()
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = [(rank, place.device) for rank, place in members if place.host == here and place.device < visible]
    for i, (rank_a, dev_a) in enumerate(local):
        for rank_b, dev_b in local[i + 1:]:
            if dev_a != dev_b and not can_access(dev_a, dev_b):
                return (f"expert_model_parallel_size={len(members)}: ranks {rank_a} and {rank_b} on host {here} use "
                        f"GPUs {dev_a} and {dev_b}, which have no peer access to each other (no NVLink/P2P path), "
                        "and MoK's GPU backends move tokens with direct peer loads and stores; place each EP group on "
                        "NVLink-connected GPUs, or use --moe-token-dispatcher-type alltoall or flex")
    return None


def _raise_if(problem: Optional[str]) -> None:
    if problem is not None:
        raise EPTopologyError(f"--moe-token-dispatcher-type mok: {problem}")


# ----------------------------------------------------------------------------------------------
# At argument validation: torchrun's store, Megatron's rank layout.

_CHECKED_GROUPS: set = set()
"""Global-rank tuples of the EP groups already checked in this process."""


def expert_parallel_groups(*, world_size: int, tensor_parallel: int, expert_tensor_parallel: int,
                           expert_parallel: int, pipeline_parallel: int, order: str = "tp-cp-ep-dp-pp",
                           expert_gtp_remat: int = 1) -> List[List[int]]:
    """The EP groups (global ranks) Megatron's ``initialize_model_parallel`` will make, from
    Megatron's own rank generator for the expert layers."""
    from megatron.core import parallel_state

    dense = expert_tensor_parallel * expert_parallel * pipeline_parallel * expert_gtp_remat
    if world_size % dense:
        return []  # Megatron's own initialisation reports this
    inject = getattr(parallel_state, "_inject_gtp_remat_axis", None)
    expert_order = inject(order, after="ep") if inject is not None else order
    kwargs = {"gtp_remat": expert_gtp_remat} if inject is not None else {}
    generator = parallel_state.RankGenerator(tp=expert_tensor_parallel, ep=expert_parallel, dp=world_size // dense,
                                             pp=pipeline_parallel, cp=1, order=expert_order, **kwargs)
    return generator.get_ranks("ep")


def exchange_places(store, rank: int, place: GpuPlace, ranks: Iterable[int]) -> Dict[int, GpuPlace]:
    """Put this rank's place in ``store`` and read those of ``ranks`` (waiting for them)."""
    store.set(str(rank), json.dumps(asdict(place)))
    return {r: GpuPlace(**json.loads(store.get(str(r)).decode())) for r in ranks}


def _torchrun_store(timeout_s: float):
    """torchrun's key-value store (the agent's, which the workers join as clients), under a
    prefix of its own for this run and restart, or None when not started by torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = (f"megatron_mok/ep_domain/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    return dist.PrefixStore(prefix, store)


def check_ep_domains_at_startup(args, *, store=None, place: Optional[GpuPlace] = None) -> bool:
    """At argument validation: check that this rank's EP group is one NVLink domain.

    Needs torchrun's store (or ``store``) to learn the other ranks' places; without one,
    returns False and the check happens when the first MoK layer is built
    (:func:`check_ep_group`). Returns True when the group was checked (and is fine).

    Args:
        args: Megatron's validated arguments (rank, world size, parallel sizes).
        store: a key-value store shared by all ranks (tests); default torchrun's.
        place: this rank's place (tests); default NVML's answer for this rank's GPU.

    Raises:
        EPTopologyError: naming the ranks and hosts outside the group's domain.
    """
    world = int(getattr(args, "world_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    if ep == 1 or world == 1:
        return True
    groups = expert_parallel_groups(
        world_size=world, tensor_parallel=args.tensor_model_parallel_size,
        expert_tensor_parallel=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
        expert_parallel=ep, pipeline_parallel=args.pipeline_model_parallel_size,
        order="tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp",
        expert_gtp_remat=getattr(args, "expert_gtp_weight_remat_size", 1) or 1)
    rank = int(args.rank)
    mine = next((g for g in groups if rank in g), None)
    if mine is None:
        return False
    if store is None:
        store = _torchrun_store(_STORE_TIMEOUT_S)
        if store is None:
            return False
    if place is None:
        place = query_gpu_place(int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    places = exchange_places(store, rank, place, mine)
    members = [(r, places[r]) for r in mine]
    _raise_if(ep_domain_problem(members, ep_size=ep))
    _raise_if(peer_access_problem(members))
    _CHECKED_GROUPS.add(tuple(mine))
    return True


# ----------------------------------------------------------------------------------------------
# At layer construction: the EP process group.


def check_ep_group(ep_group: Optional[dist.ProcessGroup]) -> None:
    """Raise :class:`EPTopologyError` when the ranks of ``ep_group`` are not one NVLink domain
    (or two of its GPUs on one host lack peer access). Collective over the EP group (every rank
    calls it), once per group, unless :func:`check_ep_domains_at_startup` checked the group.
    Call it only when a GPU backend will run.

    Args:
        ep_group: the expert-parallel process group (None or size 1: nothing to check).
    """
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return
    ranks = tuple(dist.get_process_group_ranks(ep_group))
    if ranks in _CHECKED_GROUPS:
        return
    gathered: List[Optional[dict]] = [None] * len(ranks)
    place = query_gpu_place(torch.cuda.current_device())
    dist.all_gather_object(gathered, asdict(place), group=ep_group)
    members = [(r, GpuPlace(**g)) for r, g in zip(ranks, gathered)]
    _raise_if(ep_domain_problem(members))
    _raise_if(peer_access_problem(members))
    _CHECKED_GROUPS.add(ranks)
