"""Activation memory and time of one MoE layer's forward + backward on P virtual ranks of one GPU
(``LocalEPGroup``): where the training ring bounds memory (P > 1), against the build before it.

Per routing: one untimed call (workspace, library), then the peak allocated during one forward +
backward of every rank above what was allocated before it, minus the gradients it returns
("activation memory" as peak minus gradients, which any build can be measured by; the layer
benchmark counts from the recorded allocations, ~56 MiB a rank more at the Kimi-K2 shape, where dx
and the router-weight gradient come after the peak), and the median time of a few calls.

    python tools/perf/training_memory.py --ranks 4 --experts 8 --routing uniform hot
    python tools/perf/training_memory.py --ranks 4 --training-ring-rows 0     (replay every row)

Runs with any build of the package on PYTHONPATH; ``--training-ring-rows`` needs one that has it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import LocalEPGroup, mok_moe


def routing_ids(kind: str, T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [T, K] distinct expert ids: uniform, or with expert 0 in every token's first slot."""
    ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    if kind == "hot":
        hot = (ids == 0).any(dim=1)
        ids[~hot, 0] = 0  # slot 0 takes expert 0 where it is not chosen already
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8, help="experts per rank")
    ap.add_argument("--routing", nargs="+", default=["uniform", "hot"], choices=("uniform", "hot"))
    ap.add_argument("--backend", default="megakernel")
    ap.add_argument("--training-ring-rows", type=int, default=None)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    P, T, H, I, K, L = args.ranks, args.tokens, args.hidden, args.ffn, args.topk, args.experts
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    extra = {} if args.training_ring_rows is None else {"training_ring_rows": args.training_ring_rows}
    config = MoKConfig(max_tokens_per_rank=T, **extra)
    group = LocalEPGroup(P)
    fc1 = [(torch.randn(L, 2 * I, H, generator=gen) / H ** 0.5).bfloat16().to(dev).requires_grad_() for _ in range(P)]
    fc2 = [(torch.randn(L, H, I, generator=gen) / I ** 0.5).bfloat16().to(dev).requires_grad_() for _ in range(P)]
    for kind in args.routing:
        ids = [routing_ids(kind, T, K, P * L, gen).to(dev) for _ in range(P)]
        xs = [torch.randn(T, H, generator=gen).bfloat16().to(dev).requires_grad_() for _ in range(P)]
        ws = [torch.rand(T, K, generator=gen).to(dev).requires_grad_() for _ in range(P)]
        dys = [torch.randn(T, H, generator=gen).bfloat16().to(dev) for _ in range(P)]

        def step() -> None:
            main = torch.cuda.current_stream()
            ys = []
            for r in range(P):
                group.streams[r].wait_stream(main)
                with torch.cuda.stream(group.streams[r]):
                    ys.append(mok_moe(xs[r], ids[r], ws[r], fc1[r], fc2[r], ep_group=group.ranks[r], config=config,
                                      backend=args.backend))
            for r in range(P):
                with torch.cuda.stream(group.streams[r]):
                    ys[r].backward(dys[r])
            for s in group.streams:
                main.wait_stream(s)
            torch.cuda.synchronize()

        def clear_grads() -> None:
            for t in (*xs, *ws, *fc1, *fc2):
                t.grad = None

        step()
        clear_grads()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() - before
        grads = sum(t.grad.numel() * t.grad.element_size() for t in (*xs, *ws, *fc1, *fc2) if t.grad is not None)
        times = []
        for _ in range(args.iters):
            clear_grads()
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        clear_grads()
        received = torch.bincount(torch.cat(ids).reshape(-1) // L, minlength=P)
        print(f"{args.backend}, P = {P} virtual ranks, T = {T}, H = {H}, I = {I}, top-{K}, {L} experts per rank, "
              f"routing {kind}, training_ring_rows {args.training_ring_rows}: activation memory "
              f"{(peak - grads) / 2 ** 20:.0f} MiB (all ranks; peak {peak / 2 ** 20:.0f}, gradients "
              f"{grads / 2 ** 20:.0f}); routed rows per rank {received.tolist()}; forward + backward of all "
              f"ranks {statistics.median(times):.2f} ms (median of {args.iters})", flush=True)


if __name__ == "__main__":
    main()
