"""Where one MoE layer's backward goes, at P = 1: its kernels and their times, the backward's
median time and the layer's activation memory, for chosen sizes of the backward's row chunks.

Per chunk size (``--chunk-rows``, 0: the library's rule) and expert count: one untimed forward +
backward, then the activation memory (peak allocated during one forward + backward above what
was allocated before it, minus the gradients it returns, as the layer benchmark counts it), the
median forward and backward times (CUDA events, ``--iters`` calls) and, with ``--kernels``, the
backward's kernels from ``torch.profiler`` (total time and launches per kernel name). A chunk
size other than 0 replaces ``training_chunk_rows`` for the run (forward and backward).

    python tools/perf/backward_breakdown.py --experts 48 192 --chunk-rows 0 8192 --kernels
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import mok_moe
from megatron_mok.functional import training


def uniform_ids(T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [T, K] distinct expert ids, uniform."""
    return torch.rand(T, E, generator=gen, device=gen.device).argsort(dim=1)[:, :K]


def kernel_table(prof, top: int) -> str:
    """The ``top`` CUDA kernels of a profile by total time: ms, launches, name."""
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0) or 0
        if t > 0:
            rows.append((t / 1e3, evt.count, evt.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"    {ms:8.3f} ms {n:4d}x  {name[:110]}" for ms, n, name in rows[:top]]
    return "\n".join(lines + [f"    {total:8.3f} ms in all kernels"])


def gpu_gaps(prof, min_us: float) -> str:
    """The GPU's idle gaps of at least ``min_us`` between consecutive kernels and copies of a
    profile (Chrome trace timestamps), each with the name of the kernel after it, and their sum."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    work = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    lines, idle, end = [], 0.0, None
    for start, stop, name in work:
        if end is not None and start - end >= min_us:
            idle += start - end
            lines.append(f"    gap {start - end:8.1f} us before {name[:100]}")
        end = stop if end is None else max(end, stop)
    span = (work[-1][1] - work[0][0]) if work else 0.0
    return "\n".join(lines + [f"    {idle / 1e3:.3f} ms idle in gaps >= {min_us:g} us, span {span / 1e3:.3f} ms"])


def run_case(args, L: int, chunk: int, gen: torch.Generator) -> None:
    T, H, I, K = args.tokens, args.hidden, args.ffn, args.topk
    dev = torch.device("cuda")
    training._plan.cache_clear()
    original = training.training_chunk_rows
    if chunk:
        training.training_chunk_rows = lambda ring_rows, tile_rows: chunk
    try:
        config = MoKConfig(max_tokens_per_rank=T)
        fc1 = torch.empty(L, 2 * I, H, dtype=torch.bfloat16, device=dev).normal_(0, H ** -0.5, generator=gen)
        fc2 = torch.empty(L, H, I, dtype=torch.bfloat16, device=dev).normal_(0, I ** -0.5, generator=gen)
        fc1.requires_grad_()
        fc2.requires_grad_()
        ids = uniform_ids(T, K, L, gen)
        x = torch.randn(T, H, generator=gen, device=dev).bfloat16().requires_grad_()
        w = torch.rand(T, K, generator=gen, device=dev).requires_grad_()
        dy = torch.randn(T, H, generator=gen, device=dev).bfloat16()
        leaves = (x, w, fc1, fc2)

        def forward():
            return mok_moe(x, ids, w, fc1, fc2, config=config, backend=args.backend)

        def clear():
            for t in leaves:
                t.grad = None

        forward().backward(dy)
        clear()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward().backward(dy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
        fwd, bwd, host_fwd, host_bwd = [], [], [], []
        for _ in range(args.iters):
            clear()
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            e[1].record()
            y.backward(dy)
            t2 = time.perf_counter()
            e[2].record()
            torch.cuda.synchronize()
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
            host_fwd.append((t1 - t0) * 1e3)
            host_bwd.append((t2 - t1) * 1e3)
        need = T * K * (2 * H + 4 + 4 * I)
        print(f"{args.backend} L={L} chunk_rows={chunk or 'rule'}: fwd {statistics.median(fwd):.3f} ms, "
              f"bwd {statistics.median(bwd):.3f} ms (median of {args.iters}); activation "
              f"{(peak - grads) / 2 ** 20:.0f} MiB = {(peak - grads) / need:.2f}x the routed rows' need "
              f"({need / 2 ** 20:.0f} MiB), peak {peak / 2 ** 20:.0f} MiB; host time to return: forward "
              f"{statistics.median(host_fwd):.3f} ms, backward {statistics.median(host_bwd):.3f} ms", flush=True)
        if args.kernels:  # the backward alone, then forward + backward for the gaps
            clear()
            y = forward()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                y.backward(dy)
                torch.cuda.synchronize()
            print(kernel_table(prof, args.top), flush=True)
            clear()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                forward().backward(dy)
                torch.cuda.synchronize()
            print("  forward + backward, GPU idle gaps:", flush=True)
            print(gpu_gaps(prof, args.gap_us), flush=True)
        clear()
    finally:
        training.training_chunk_rows = original
        training._plan.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, nargs="+", default=[48, 192], help="experts (P = 1)")
    ap.add_argument("--chunk-rows", type=int, nargs="+", default=[0], help="0: the library's rule")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kernels", action="store_true", help="profile the backward's kernels")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--gap-us", type=float, default=5.0, help="smallest GPU idle gap listed")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for L in args.experts:
        for chunk in args.chunk_rows:
            run_case(args, L, chunk, gen)


if __name__ == "__main__":
    main()
