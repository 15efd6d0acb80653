"""The GPU's time between two megakernel calls of `mok_moe` queued back to back: profiles
calls with torch.profiler and prints, per call, the time from one call's megakernel to the
next call's, and each kernel's and copy's median duration.

    torchrun --nproc-per-node 2 tools/perf/call_kernels.py --experts 48     (P = 2)
    python tools/perf/call_kernels.py --experts 48                          (P = 1)

The work between the persistent kernels of two calls (the prologue: publish, barrier, schedule,
reset; the status word to the host) is the part of a call that the kernel's own timeline
(megakernel_timeline.py) does not show. Needs the CUDA library (an sm_90 GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Dict, List, Sequence, Tuple

Event = Tuple[str, float, float]
"""A kernel or copy on the GPU: (name, start, end), in microseconds."""


def per_call(events: Sequence[Event], marker: str) -> Dict[str, object]:
    """Splits `events` (in start order) into calls at each event whose name contains `marker`
    (the call's last kernel) and returns medians over the calls between the first and the last
    marker: "idle_us" (from a marker's end to the next event's start), "between_us" (from a
    marker's end to the next marker's start), "marker_us" (the next marker's duration),
    "period_us" (marker end to marker end), "calls" (how many), and "kernels": (name, launches,
    median duration) for every event between two markers, the marker included, in the order
    they first ran; a name's second and later launches within one call are counted apart, as
    "name [2]" and so on (a kernel that runs twice a call does not mix its two launches'
    durations). Raises ValueError with fewer than two markers."""
    marks = [i for i, (name, _, _) in enumerate(events) if marker in name]
    if len(marks) < 2:
        raise ValueError(f"{len(marks)} events named like {marker!r}: need two calls or more")
    idle, between, marker_us, period = [], [], [], []
    durations: Dict[str, List[float]] = {}
    for a, b in zip(marks[:-1], marks[1:]):
        end = events[a][2]
        idle.append(events[a + 1][1] - end)
        between.append(events[b][1] - end)
        marker_us.append(events[b][2] - events[b][1])
        period.append(events[b][2] - end)
        seen: Dict[str, int] = {}
        for name, start, stop in events[a + 1:b + 1]:
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name} [{seen[name]}]"
            durations.setdefault(key, []).append(stop - start)
    return {"idle_us": statistics.median(idle), "between_us": statistics.median(between),
            "marker_us": statistics.median(marker_us), "period_us": statistics.median(period),
            "calls": len(marks) - 1,
            "kernels": [(name, len(d), statistics.median(d)) for name, d in durations.items()]}


def format_per_call(summary: Dict[str, object], label: str) -> str:
    """The lines `main` prints for one rank."""
    lines = [f"{label}: per call, medians over {summary['calls']}: last kernel's end to the next call's "
             f"last kernel {summary['between_us']:.1f} us (idle {summary['idle_us']:.1f} us before the first "
             f"work), that kernel {summary['marker_us']:.1f} us, period {summary['period_us']:.1f} us"]
    lines += [f"{label}:   {name[:70]}: {n} launches, {us:.1f} us" for name, n, us in summary["kernels"]]
    return "\n".join(lines)


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megatron_mok import MoKConfig
    from megatron_mok.functional import mok_moe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=48, help="experts per GPU")
    ap.add_argument("--warmup", type=int, default=200, help="calls before the profile (the card at its power state)")
    ap.add_argument("--calls", type=int, default=20, help="profiled calls (keep below ~100: the launch queue)")
    args = ap.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        rank = 0
    P = dist.get_world_size() if distributed else 1
    T, H, I, K, L = args.tokens, args.hidden, args.ffn, args.topk, args.experts
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T, P * L, device="cuda", generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device="cuda", generator=g)
    fc1 = (torch.randn(L, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(L, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    group = dist.group.WORLD if distributed else None
    config = MoKConfig()

    def call():
        return mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, backend="megakernel")
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    if distributed:
        dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    events = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0),
                    key=lambda e: e[1])
    print(format_per_call(per_call(events, "forward_kernel"), f"rank {rank}/{P} L={L}"), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
