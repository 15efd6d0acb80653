"""Where the host time of one ``mok_moe`` call goes: profiles calls queued back to back (no
synchronisation between them, as in training) with cProfile and prints the functions that take
the host's time, by own time and by cumulative time.

    python tools/perf/host_profile.py --experts 6 --backend megakernel
    torchrun --nproc-per-node 2 tools/perf/host_profile.py --experts 6 --backend cuda   (P = 2)

The host time matters when nothing else is queued on the GPU (a synchronised benchmark, the
first layer after a sync): the launch of the persistent kernel waits for all of it. With
--to-launch it instead times synchronised calls (each alone, as a synchronised benchmark makes
them) and prints, per step of the megakernel backend's host path, the median host time from the
call's start to the step (its start or return), ending with the launch of the persistent kernel,
and the GPU time of the whole call; --torch-trace DIR adds a torch.profiler trace of a few such
calls (CUDA runtime calls with their host durations). Needs the CUDA library (an sm_90 GPU).

Keep --iters below ~100 for the profile: calls queued back to back fill the CUDA launch queue
after about that many, and the host then blocks in whichever launch finds it full.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import os
import pstats
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_mok import MoKConfig
from megatron_mok.bench.timing import align_ranks
from megatron_mok.functional import check_errors, mok_moe

# Steps of the megakernel backend's host path, in the order a call reaches them: (label, module
# attribute path under megatron_mok, "start" or "end") of each function whose start or return is
# timed from the call's start. A path this version of the package lacks, or a function the call
# does not reach, is left out of the table (and named under it), so the list may hold a step
# under the names of several versions.
LAUNCH_STEPS = [
    ("input checks start (check_inputs)", "functional.check_inputs", "start"),
    ("input checks (check_inputs)", "functional.check_inputs", "end"),
    ("group size and rank", "functional.group_size_rank", "end"),
    ("backend choice (select_backend)", "functional.select_backend", "end"),
    ("the backend's run starts", "functional.megakernel_backend.MegakernelBackend.run", "start"),
    ("workspace lookup", "functional.megakernel_backend.get_workspace", "end"),
    ("launch plan (_prepared_launch)", "functional.megakernel_backend._prepared_launch", "end"),
    ("weight arguments", "functional.expert_ffn.weight_arguments", "end"),
    ("the autograd function's forward starts", "functional.megakernel_backend._MegakernelMoE.forward", "start"),
    ("the forward starts (_run_forward)", "functional.megakernel_backend._run_forward", "start"),
    ("status check (raise_if_failed)", "functional.workspace.Workspace.raise_if_failed", "end"),
    ("prologue: publish, barrier and schedule (dispatch)", "functional.workspace.Workspace.dispatch", "end"),
    ("megakernel launch (its checks, args, tensor maps, reset kernel, launch)", "ops.megakernel.megakernel_forward.impl", "end"),
    ("launch_forward starts", "ops.megakernel.launch_forward", "start"),
    ("megakernel launch (args, tensor maps, reset kernel, launch)", "ops.megakernel.launch_forward", "end"),
    ("status word to the host (mirror_status)", "functional.workspace.Workspace.mirror_status", "end"),
]


def _resolve(path: str):
    import megatron_mok

    *parents, name = path.split(".")
    obj = megatron_mok
    for part in parents:
        obj = getattr(obj, part)
    return obj, name


@contextlib.contextmanager
def timed_steps(steps, clock: Callable[[], float]):
    """Within the block, every function of ``steps`` ((label, attribute path under megatron_mok,
    "start" or "end")) appends ``clock()`` at its start or return to ``marks[label]``; the
    functions are restored after. Yields ``marks``; paths this version lacks are skipped."""
    marks: Dict[str, List[float]] = {label: [] for label, _, _ in steps}
    originals = []
    for label, path, at in steps:
        try:
            owner, name = _resolve(path)
        except AttributeError:
            continue
        if not hasattr(owner, name):
            continue
        raw = inspect.getattr_static(owner, name)
        fn = getattr(owner, name)

        def timed(*a, _fn=fn, _label=label, _at=at, **kw):
            if _at == "start":
                marks[_label].append(clock())
                return _fn(*a, **kw)
            out = _fn(*a, **kw)
            marks[_label].append(clock())
            return out
        originals.append((owner, name, raw))
        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
    try:
        yield marks
    finally:
        for owner, name, raw in reversed(originals):
            setattr(owner, name, raw)


def time_to_launch(call: Callable[[], object], iters: int, group) -> Tuple[Dict[str, float], List[str]]:
    """Median host milliseconds from the start of a synchronised ``call`` to each step of
    :data:`LAUNCH_STEPS`, and the call's GPU time; and the labels of the steps not reached once
    per call (not in this version, or not on this call's path)."""
    start = [0.0]
    gpu: List[float] = []
    recorded: List[float] = []
    returned: List[float] = []
    with timed_steps(LAUNCH_STEPS, lambda: time.perf_counter() - start[0]) as marks:
        for _ in range(iters):
            align_ranks(group, torch.device("cuda", torch.cuda.current_device()))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start[0] = time.perf_counter()
            a.record()
            recorded.append(time.perf_counter() - start[0])
            call()
            returned.append(time.perf_counter() - start[0])
            b.record()
            b.synchronize()
            gpu.append(a.elapsed_time(b))
    out = {"start event recorded": 1e3 * statistics.median(recorded)}
    out.update({label: 1e3 * statistics.median(v) for label, v in marks.items() if len(v) == iters})
    missed = [label for label, v in marks.items() if len(v) != iters]
    out["the call returns"] = 1e3 * statistics.median(returned)
    out["GPU time of the call"] = statistics.median(gpu)
    return out, missed


def torch_trace(call: Callable[[], object], iters: int, group, out_dir: str, rank: int) -> None:
    """Profiles ``iters`` synchronised calls with ``torch.profiler`` (CPU ops, CUDA runtime calls
    and kernels), writes the Chrome trace to ``out_dir/host_trace_rank{rank}.json`` and prints,
    for the last call, every host event in the call's range: its start from the range's start,
    its duration and its name (the CUDA runtime calls show which host call waits on what)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        for i in range(iters):
            align_ranks(group, torch.device("cuda", torch.cuda.current_device()))
            with record_function(f"mok_call_{i}"):
                call()
            torch.cuda.synchronize()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"host_trace_rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank != 0:
        return
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    last = max((e for e in events if e.name == f"mok_call_{iters - 1}"), key=lambda e: e.time_range.start)
    t0, t1 = last.time_range.start, last.time_range.end
    inside = sorted((e for e in events if t0 <= e.time_range.start <= t1 and e is not last),
                    key=lambda e: e.time_range.start)
    print(f"torch.profiler, last of {iters} synchronised calls: {(t1 - t0):.0f} us on the host ({path})")
    for e in inside:
        print(f"  {e.time_range.start - t0:8.1f} us  +{e.time_range.end - e.time_range.start:7.1f}  {e.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=6, help="experts per GPU")
    ap.add_argument("--backend", default="megakernel")
    ap.add_argument("--grad", action="store_true", help="calls that need a backward (forward only is timed)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--to-launch", action="store_true",
                    help="time synchronised calls: host time to each step's end, up to the launch")
    ap.add_argument("--torch-trace", metavar="DIR",
                    help="with --to-launch: also profile 5 synchronised calls with torch.profiler "
                         "(Chrome trace in DIR, the last call's host events printed)")
    args = ap.parse_args()

    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        group = dist.group.WORLD
    P = dist.get_world_size() if group is not None else 1
    rank = dist.get_rank() if group is not None else 0
    T, K, H, I, L = args.tokens, args.topk, args.hidden, args.ffn, args.experts
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_(args.grad)
    E = P * L
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K].contiguous() if E >= K else \
        torch.randint(0, E, (T, K), device="cuda", generator=g)
    w = torch.rand(T, K, device="cuda", generator=g).requires_grad_(args.grad)
    fc1 = (torch.randn(L, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_(args.grad)
    fc2 = (torch.randn(L, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16().requires_grad_(args.grad)
    config = MoKConfig(max_tokens_per_rank=T)

    def call():
        return mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, backend=args.backend)

    if args.to_launch:
        if args.backend != "megakernel":
            raise SystemExit("--to-launch times the megakernel backend's steps")
        with torch.set_grad_enabled(args.grad):
            for _ in range(3):
                call()
            steps, missed = time_to_launch(call, args.iters, group)
            check_errors()
            if args.torch_trace:
                torch_trace(call, 5, group, args.torch_trace, rank)
                check_errors()
        if rank == 0:
            print(f"P={P} T={T} K={K} H={H} I={I} L={L}/GPU grad={args.grad}: synchronised calls, "
                  f"medians of {args.iters}, ms from the call's start")
            gpu_ms = steps.pop("GPU time of the call")
            for label, ms in sorted(steps.items(), key=lambda kv: kv[1]):
                print(f"  {ms:7.3f}  {label}")
            print(f"  {gpu_ms:7.3f}  GPU time of the call")
            if missed:
                print("  not timed (not reached once a call): " + "; ".join(missed))
        if group is not None:
            dist.barrier()
            dist.destroy_process_group()
        return

    with torch.set_grad_enabled(args.grad):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        check_errors()
        h0 = time.perf_counter()
        for _ in range(args.iters):
            y = call()
        plain_ms = (time.perf_counter() - h0) * 1e3 / args.iters
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        h0 = time.perf_counter()
        prof.enable()
        for _ in range(args.iters):
            y = call()
        prof.disable()
        host_ms = (time.perf_counter() - h0) * 1e3 / args.iters
        torch.cuda.synchronize()
        check_errors()
    del y
    if rank == 0:
        print(f"P={P} T={T} K={K} H={H} I={I} L={L}/GPU backend={args.backend} grad={args.grad}: "
              f"host {plain_ms:.3f} ms per call back to back, {host_ms:.3f} ms under cProfile")
        stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own s, cumulative s, callers)}
        for col, label in ((3, "cumulative"), (2, "own")):
            print(f"--- by {label} time, us per call of {args.backend} (calls per call)")
            for (file, line, name), row in sorted(stats.items(), key=lambda kv: -kv[1][col])[:args.top]:
                where = f"{os.path.basename(file)}:{line}" if line else file
                print(f"  {row[col] / args.iters * 1e6:8.1f}  ({row[1] / args.iters:5.1f})  {name}  {where}")
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
