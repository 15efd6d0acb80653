"""Where the host time of one ``mok_moe`` call goes: profiles calls queued back to back (no
synchronisation between them, as in training) with cProfile and prints the functions that take
the host's time, by own time and by cumulative time.

    python scripts/host_profile.py --experts 6 --backend megakernel
    torchrun --nproc-per-node 2 scripts/host_profile.py --experts 6 --backend cuda   (P = 2)

The host time matters when nothing else is queued on the GPU (a synchronised benchmark, the
first layer after a sync): the launch of the persistent kernel waits for all of it. Needs the
CUDA library (an sm_90 GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

from megatron_mok import MoKConfig
from megatron_mok.functional import check_errors, mok_moe


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
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K] if E >= K else \
        torch.randint(0, E, (T, K), device="cuda", generator=g)
    w = torch.rand(T, K, device="cuda", generator=g).requires_grad_(args.grad)
    fc1 = (torch.randn(L, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_(args.grad)
    fc2 = (torch.randn(L, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16().requires_grad_(args.grad)
    config = MoKConfig(max_tokens_per_rank=T)

    def call():
        return mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, backend=args.backend)

    with torch.set_grad_enabled(args.grad):
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        check_errors()
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
              f"host {host_ms:.3f} ms per call (under cProfile)")
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            print(f"--- by {key}, {args.iters} calls")
            print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])
    if group is not None:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
