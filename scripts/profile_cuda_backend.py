"""Time the ``cuda`` backend's forward and backward, whole and stage by stage, next to the
floors of DESIGN.md section 6. On one GPU, P = 1 reproduces the expert load of EP = P' when
the rank holds E / P' experts and T tokens (the same T * K routes land on its experts); only
the NVLink part is missing. Under torchrun (one process per GPU) it runs the real EP group and
reports the off-rank GB/s of the pull (dispatch) and push (combine) kernels.

    python scripts/profile_cuda_backend.py --tokens 4096 --hidden 7168 --ffn 2048 \
        --experts 192 --topk 8 [--routing uniform|zipf|duplicates]
    torchrun --nproc-per-node 2 scripts/profile_cuda_backend.py --experts 192

--experts is per rank. Prints one line per stage (median ms over --iters, every rank) and the
totals with TFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from megatron_mok import MoKConfig
from megatron_mok.functional import mok_moe
from megatron_mok.functional.workspace import get_workspace
from megatron_mok.ops import comm as comm_ops
from megatron_mok.ops import swiglu as swiglu_ops

GEMM_TFLOPS = 792.0   # dense bf16 GEMM on H200 (shared/device-facts.md)
HBM_GBPS = 4153.0     # device-to-device copy, read + write


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()  # every rank times the stage at the same time
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=192)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--routing", default="uniform", choices=["uniform", "zipf", "duplicates"])
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    T, H, I, L, K = a.tokens, a.hidden, a.ffn, a.experts, a.topk
    P = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if P > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        group = dist.group.WORLD
    rank = dist.get_rank() if group is not None else 0
    torch.manual_seed(rank)
    dev = torch.device("cuda")
    E = P * L
    x = torch.randn(T, H, device=dev).bfloat16().requires_grad_()
    if a.routing == "duplicates" or K > E:
        ids = torch.randint(0, E, (T, K), device=dev)
    elif a.routing == "zipf":
        pop = 1.0 / torch.arange(1, E + 1, device=dev, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(pop.expand(T, E), K, replacement=False)
    else:
        ids = torch.rand(T, E, device=dev).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device=dev).requires_grad_()
    fc1 = (torch.randn(L, 2 * I, H, device=dev) / H ** 0.5).bfloat16().requires_grad_()
    fc2 = (torch.randn(L, H, I, device=dev) / I ** 0.5).bfloat16().requires_grad_()
    dy = torch.randn(T, H, device=dev).bfloat16()
    cfg = MoKConfig()

    flops = 6 * T * K * H * I
    weight_bytes = 3 * H * I * 2 * L
    floor_ms = max(flops / GEMM_TFLOPS / 1e9, weight_bytes / HBM_GBPS / 1e6)
    fwd = median_ms(lambda: mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=cfg, backend="cuda"), a.iters)

    def fwd_bwd():
        # autograd.grad, not .backward(): accumulating into .grad would add a read and a write
        # of every weight gradient (3 x 16.9 GB at L = 192) to each iteration.
        y = mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=cfg, backend="cuda")
        torch.autograd.grad(y, (x, w, fc1, fc2), dy)

    total = median_ms(fwd_bwd, a.iters)
    tag = f"[rank {rank}/{P}] "
    print(f"{tag}shape T={T} H={H} I={I} L={L} (E={E}) K={K} routing={a.routing}")
    print(f"{tag}forward  {fwd:8.3f} ms  {flops / fwd / 1e9:6.1f} TFLOP/s   floor {floor_ms:.3f} ms (no NVLink term)")
    print(f"{tag}backward {total - fwd:8.3f} ms  {2 * flops / (total - fwd) / 1e9:6.1f} TFLOP/s")

    # Stage by stage (forward), on the same workspace.
    ws = get_workspace(group, dev, tokens=T, hidden=H, topk=K, experts_per_rank=L, config=cfg)
    SEG = cfg.tile_rows
    table, counts, offsets, cap = ws.dispatch(x.detach(), ids, w.detach(), 1, 60.0, SEG)
    ends = offsets[1:]
    x_disp, w_disp = comm_ops.pull_rows(ws.bases, ws.layout.rows, True, ws.layout.scalars, table, offsets,
                                        K, cap, H, True, 0)
    ab = torch._grouped_mm(x_disp, fc1.detach().transpose(1, 2), offs=ends)
    hw = swiglu_ops.swiglu_forward(ab, w_disp, offsets)
    out = torch._grouped_mm(hw, fc2.detach().transpose(1, 2), offs=ends)
    rows = int(offsets[-1])
    remote_rows = int(((table[:rows, 0] >= 0) & (table[:rows, 0] != rank)).sum())
    stages = {
        "publish": lambda: ws.publish(x.detach(), ids, w.detach()),
        "schedule": lambda: ws.build_schedule(SEG),
        "pull": lambda: comm_ops.pull_rows(ws.bases, ws.layout.rows, True, ws.layout.scalars, table, offsets,
                                           K, cap, H, True, 0),
        "fc1": lambda: torch._grouped_mm(x_disp, fc1.detach().transpose(1, 2), offs=ends),
        "swiglu": lambda: swiglu_ops.swiglu_forward(ab, w_disp, offsets),
        "fc2": lambda: torch._grouped_mm(hw, fc2.detach().transpose(1, 2), offs=ends),
        "push": lambda: comm_ops.push_rows(ws.bases, ws.layout.slots, 0, table, offsets, K, out, None, 0),
        "sum": lambda: comm_ops.sum_slots(ws.slots[:T], ids, E, None, ws.status),
    }
    row_bytes = rows * H * 2
    for name, fn in stages.items():
        ms = median_ms(fn, a.iters)
        extra = ""
        if name in ("pull", "push") and P == 1:
            extra = f"  {2 * row_bytes / ms / 1e6:7.1f} GB/s (read+write)"
        elif name in ("pull", "push"):
            extra = (f"  {remote_rows * H * 2 / ms / 1e6:7.1f} GB/s off-rank ({remote_rows} of {rows} rows "
                     f"cross NVLink)")
        if name in ("fc1", "fc2"):
            n = 2 * I if name == "fc1" else H
            kdim = H if name == "fc1" else I
            extra = f"  {2 * rows * n * kdim / ms / 1e9:6.1f} TFLOP/s on {rows} padded rows"
        print(f"{tag}  {name:9s}{ms:8.3f} ms{extra}")

    # Backward stages.
    d_out = out  # stands in for the pulled dy rows (same shape and layout)
    g = torch._grouped_mm(d_out, fc2.detach(), offs=ends)
    d_ab, dw_rows, hw2 = swiglu_ops.swiglu_backward(ab, w_disp, g, offsets, True)
    f1, f2 = fc1.detach(), fc2.detach()
    wgrad = lambda a_t, b_: torch._grouped_mm(a_t, b_, offs=ends)
    bstages = {
        "b:pull dy": lambda: comm_ops.pull_rows(ws.bases, ws.layout.rows, True, 0, table, offsets, K, cap, H,
                                                False, 0),
        "b:fc2 dgrad": lambda: torch._grouped_mm(d_out, f2, offs=ends),
        "b:swiglu": lambda: swiglu_ops.swiglu_backward(ab, w_disp, g, offsets, True),
        "b:fc2 wgrad": lambda: wgrad(d_out.t(), hw2),
        "b:fc1 wgrad": lambda: wgrad(d_ab.t(), x_disp),
        "b:fc1 dgrad": lambda: torch._grouped_mm(d_ab, f1, offs=ends),
        "b:push": lambda: comm_ops.push_rows(ws.bases, ws.layout.slots, ws.layout.scalars, table, offsets, K,
                                             out, dw_rows, 0),
        "b:sum": lambda: comm_ops.sum_slots(ws.slots[:T], ids, E, ws.scalars[:T], ws.status),
    }
    gemm_flops = {"b:fc2 dgrad": 2 * rows * I * H, "b:fc2 wgrad": 2 * rows * I * H,
                  "b:fc1 wgrad": 4 * rows * I * H, "b:fc1 dgrad": 4 * rows * I * H}
    for name, fn in bstages.items():
        ms = median_ms(fn, a.iters)
        extra = f"  {gemm_flops[name] / ms / 1e9:6.1f} TFLOP/s" if name in gemm_flops else ""
        print(f"{tag}  {name:12s}{ms:8.3f} ms{extra}")
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
