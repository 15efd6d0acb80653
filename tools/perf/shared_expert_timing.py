"""What fusing a shared expert into the MoK call costs or saves, per layer call (forward +
backward, synchronised, median of the slowest rank, the variants alternating call by call):

* ``separate``: routed experts through ``mok_moe``, the shared expert beside it with plain torch
  matmuls (what Megatron's ``SharedExpertMLP`` does without Transformer Engine);
* ``segments``: the shared expert as one more local expert of every rank, its weights passed
  as a second weight segment (read where they lie: what ``--mok-fuse-shared-expert`` does);
* ``copy``: the same with routed and shared weights concatenated first (what weight segments
  save).

    torchrun --nproc-per-node 2 tools/perf/shared_expert_timing.py --experts 192
    python tools/perf/shared_expert_timing.py --experts 6            (P = 1)

Needs the CUDA library (an sm_90 GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ab_stats import interleaved_rounds
from megatron_mok.functional import check_errors, mok_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=6, help="routed experts per GPU")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        rank, P = dist.get_rank(), dist.get_world_size()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        rank, P = 0, 1
    T, H, I, K, L = args.tokens, args.hidden, args.ffn, args.topk, args.experts
    g = torch.Generator(device="cuda").manual_seed(4321 + rank)
    leaf = lambda t: t.bfloat16().requires_grad_()
    x = leaf(torch.randn(T, H, device="cuda", generator=g))
    ids = torch.rand(T, P * L, device="cuda", generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device="cuda", generator=g).requires_grad_()
    fc1 = leaf(torch.randn(L, 2 * I, H, device="cuda", generator=g) / H ** 0.5)
    fc2 = leaf(torch.randn(L, H, I, device="cuda", generator=g) / I ** 0.5)
    sh1 = leaf(torch.randn(1, 2 * I, H, device="cuda", generator=g) / H ** 0.5)
    sh2 = leaf(torch.randn(1, H, I, device="cuda", generator=g) / I ** 0.5)
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    group = dist.group.WORLD if distributed else None
    # Fused: every rank holds L + 1 local experts, the last its shared expert; each token gets
    # one more slot (weight 1) for its own rank's shared expert.
    fused_ids = torch.cat([(ids // L) * (L + 1) + ids % L,
                           torch.full((T, 1), rank * (L + 1) + L, device="cuda", dtype=ids.dtype)], 1)

    def fused_w():
        return torch.cat([w, torch.ones(T, 1, device="cuda")], 1)

    def separate():
        y = mok_moe(x, ids, w, fc1, fc2, ep_group=group)
        gate, up = F.linear(x, sh1[0]).chunk(2, dim=-1)
        return y + F.linear(F.silu(gate) * up, sh2[0])

    def segments():
        return mok_moe(x, fused_ids, fused_w(), (fc1, sh1), (fc2, sh2), ep_group=group)

    def copy():
        return mok_moe(x, fused_ids, fused_w(), torch.cat([fc1, sh1]), torch.cat([fc2, sh2]), ep_group=group)

    variants = [("separate", separate), ("segments", segments), ("copy", copy)]
    def clear_grads():
        for t in (x, w, fc1, fc2, sh1, sh2):
            t.grad = None

    steps = [(name, lambda fn=fn: fn().backward(dy)) for name, fn in variants]
    times = interleaved_rounds(steps, args.rounds, dist.group.WORLD if distributed else None,
                               torch.device("cuda", torch.cuda.current_device()), setup=clear_grads)
    check_errors()
    if rank == 0:
        base = statistics.median(times["separate"])
        for name, _ in variants:
            med = statistics.median(times[name])
            print(f"P={P} L={L} T={T} H={H} I={I} K={K}: {name:9s} forward + backward {med:7.3f} ms "
                  f"({med - base:+.3f} ms against separate; median of {args.rounds}, slowest rank)", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
