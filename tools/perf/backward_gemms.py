"""The layer backward's four GEMMs alone, standalone and back to back: how much of the unfused
backward is its GEMMs, and so how much one fused launch could save by overlapping the rest.

Kimi-K2 by default (H 7168, I 2048, 4096 tokens, top-8), uniform routing, 128-row segments
(``--tile-rows 64``: 64-row segments and the GEMMs' defaults for them), the
experts' counts given (as the backends run them): the fc2 data gradient with the SwiGLU backward
and the router-weight gradient, the fc2 and fc1 weight gradients (bf16, TMA-staged), the plain
fc1 data gradient (the backends push its rows home from the epilogue where experts are large).
Each alone and the four in a row, CUDA-event medians of ``--rounds`` rounds of back-to-back calls
(under the power cap, as the layer benchmark's timed iterations run). One GPU:

    python tools/perf/backward_gemms.py --experts 8 48 192
"""
import argparse
import statistics

import torch


def run(L: int, args) -> None:
    from megatron_mok.bench.gemm import expert_counts, offsets_of, time_ms
    from megatron_mok.ops import grouped_gemm as gg

    T, H, I, K = args.tokens, args.hidden, args.ffn, args.topk
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(L)
    counts = expert_counts(L, T * K, "uniform", gen)
    offs = offsets_of(counts, args.tile_rows)
    R = offs[-1]
    real = torch.zeros(R, dtype=torch.bool, device=dev)
    for e, c in enumerate(counts):
        real[offs[e]:offs[e] + c] = True
    offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
    counts_d = torch.tensor(counts, dtype=torch.int32, device=dev)
    rows = lambda n: (torch.randn(R, n, device=dev) * real[:, None]).bfloat16()
    dy, x, gu = rows(H), rows(H), rows(2 * I)
    rw = torch.rand(R, device=dev) * real
    w1 = (torch.randn(L, 2 * I, H, device=dev) / H ** 0.5).bfloat16()
    w2 = (torch.randn(L, H, I, device=dev) / I ** 0.5).bfloat16()
    dgu, h, dx = torch.empty_like(gu), torch.empty(R, I, dtype=torch.bfloat16, device=dev), torch.empty_like(x)
    dwr = torch.empty(R, device=dev)
    scratch = torch.empty(gg.dgrad_scratch_floats(R, I), device=dev)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    v_d2, v_d1 = gg.variant("fc2_dgrad_swiglu", args.tile_rows), gg.variant("dgrad", args.tile_rows)
    steps = {
        "fc2 data gradient + SwiGLU": lambda: gg.launch_fc2_dgrad_swiglu(dy, w2, gu, offsets, counts_d, rw, dgu, h,
                                                                        dwr, scratch, variant=v_d2),
        "fc2 weight gradient": lambda: gg.launch_weight_grad(dy, h, offsets, dw2, counts=counts_d, tma_store=True),
        "fc1 weight gradient": lambda: gg.launch_weight_grad(dgu, x, offsets, dw1, counts=counts_d, tma_store=True),
        "fc1 data gradient": lambda: gg.launch_fc1_dgrad(dgu, w1, offsets, dx, variant=v_d1),
    }
    chain = lambda: [f() for f in steps.values()]
    flop = 12.0 * T * K * H * I
    cases = {**steps, "the four in a row": chain}
    res = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, fn in cases.items():
            res[k].append(time_ms(fn, budget_s=0.3, max_iters=20))
    alone = 0.0
    for k, t in res.items():
        ms = statistics.median(t)
        alone += ms if k in steps else 0.0
        extra = f"  ({flop / ms / 1e9:.0f} TFLOP/s of the backward's {flop / 1e12:.2f} TFLOP)" if k not in steps else ""
        print(f"L={L:3d} {k:28s} {ms:7.3f} ms{extra}", flush=True)
    print(f"L={L:3d} {'sum of the four alone':28s} {alone:7.3f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 48, 192], help="experts per GPU, one run each")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tile-rows", type=int, choices=(128, 64), default=128, help="the segments' padding")
    args = ap.parse_args()
    for L in args.experts:
        run(L, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
