"""Launch each grouped GEMM variant once on one benchmark case, for a profiler to look at.

    ncu --clock-control none --nvtx --nvtx-include measure/ \
        python tools/perf/gemm_profile_case.py --model kimi-k2 --ep 8 --routing uniform --kernels fc1,fc2 --variants m128n256t,m128n256tc --torch

Uses the inputs of ``megatron_mok.bench.gemm`` (same counts, same padded layout), runs each
requested (kernel, variant) once after one warm-up launch, and, with ``--torch``, the
``torch._grouped_mm`` of the same GEMM; the timed launches sit in one NVTX range, ``measure``, in
the order printed at the end.
"""

from __future__ import annotations

import argparse
import math

import torch

from megatron_mok.bench import gemm as bench
from megatron_mok.ops import grouped_gemm as gg


def variant_of(name: str) -> gg.Variant:
    """'m128n256tc' -> Variant(128, 256, tma_store=True, multicast=True)."""
    body = name[1:]
    m, rest = body.split("n", 1)
    flags = rest.lstrip("0123456789")
    n = rest[: len(rest) - len(flags)]
    return gg.Variant(int(m), int(n), "t" in flags, "c" in flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-k2", choices=sorted(bench.MODELS))
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--kernels", default="fc1,fc2",
                    help="of fc1, fc1-no-gu, fc1-plain, fc2, and the weight gradients wgrad-fc1, wgrad-fc2 "
                         "(bf16, TMA-staged, with the counts) and wgrad-fc1-acc, wgrad-fc2-acc (into an fp32 "
                         "main_grad per expert), which take no variant")
    ap.add_argument("--variants", default="m128n256t,m128n256tc")
    ap.add_argument("--torch", action="store_true", help="also run torch._grouped_mm on the same GEMM")
    ap.add_argument("--shape", default=None, help="H,I,E instead of the model's (e.g. odd multiples of 64 and 128)")
    ap.add_argument("--time", action="store_true", help="print CUDA-event medians instead of profiling")
    args = ap.parse_args()
    H, I, E = bench.MODELS[args.model] if args.shape is None else map(int, args.shape.split(","))
    L = E // args.ep
    gen = torch.Generator().manual_seed(1)
    counts = bench.expert_counts(L, bench.TOKENS_PER_RANK * bench.TOPK, args.routing, gen)
    w1 = torch.randn(L, 2 * I, H, device="cuda").bfloat16() / math.sqrt(H)
    w2 = torch.randn(L, H, I, device="cuda").bfloat16() / math.sqrt(I)
    c = bench.Case(w1, w2, H, I, L, counts, args.tile)
    launches = []
    for kernel in args.kernels.split(","):
        if kernel.startswith("wgrad-"):  # as the backends run them: dW1 = dgu^T x, dW2 = dy^T h
            c.dgu.normal_()  # scratch of the Case: any finite values
            c.h.normal_()
            a, b = (c.dgu, c.x) if kernel.startswith("wgrad-fc1") else (c.dy, c.h)
            if kernel.endswith("-acc"):
                mains = [torch.zeros(a.shape[1], b.shape[1], device="cuda") for _ in range(L)]
                f = lambda a=a, b=b, m=mains: gg.weight_grad_into(a, b, c.offsets, m, counts=c.counts_d)
            else:
                out = torch.empty(L, a.shape[1], b.shape[1], dtype=torch.bfloat16, device="cuda")
                f = lambda a=a, b=b, o=out: gg.launch_weight_grad(a, b, c.offsets, o, tma_store=True, counts=c.counts_d)
            launches.append((kernel, f))
            continue
        for name in args.variants.split(","):
            v = variant_of(name)
            if v not in gg.VARIANTS["fc1" if kernel.startswith("fc1") else kernel]:
                print(f"skip {kernel} {name}: not built")
                continue
            if kernel == "fc1":
                f = lambda v=v: gg.launch_fc1_swiglu(c.x, c.w1, c.offsets, c.counts_d, c.rw, c.h, c.gu, variant=v)
            elif kernel == "fc1-no-gu":  # h only: what the saved pre-activation's stores cost
                f = lambda v=v: gg.launch_fc1_swiglu(c.x, c.w1, c.offsets, c.counts_d, c.rw, c.h, None, variant=v)
            elif kernel == "fc1-plain":  # gu = x W1^T with the plain-store kernel: torch's computation
                if v not in gg.VARIANTS["fc2"]:
                    continue
                f = lambda v=v: gg.launch_fc2(c.x, c.w1, c.offsets, c.gu, variant=v)
            else:
                f = lambda v=v: gg.launch_fc2(c.h, c.w2, c.offsets, c.y, variant=v)
            launches.append((f"{kernel}-{name}", f))
        if args.torch:
            if kernel.startswith("fc1"):
                f = lambda: torch._grouped_mm(c.x, c.w1.transpose(1, 2), offs=c.ends)
            else:
                f = lambda: torch._grouped_mm(c.h, c.w2.transpose(1, 2), offs=c.ends)
            launches.append((f"{kernel}-torch", f))
    for name, f in launches:
        f()  # warm-up (and module load)
    torch.cuda.synchronize()
    if args.time:
        for name, f in launches:
            print(f"{args.model} EP={args.ep} {args.routing} {name:28s} {bench.time_ms(f):7.3f} ms", flush=True)
        return
    torch.cuda.nvtx.range_push("measure")  # ncu --nvtx --nvtx-include measure/ skips the warm-ups
    for name, f in launches:
        f()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("launched:", ", ".join(n for n, _ in launches))


if __name__ == "__main__":
    main()
