"""Where the backward compute launch's time goes: one traced ``mok_megakernel_backward_compute``
per expert count, against the standalone kernels of the unfused chain on the same inputs.

Kimi-K2 by default (H 7168, I 2048, 4096 tokens, top-8, P = 1), 128-row segments. Per expert
count it prints the CUDA-event medians of the launch and of the chain's kernels (the fc2 data
gradient with the SwiGLU backward, both weight gradients, the fc1 data gradient with the push
and without it), then from one traced launch, per item kind (D2, D1, W): the tiles, their mean
run time (the consumers' first full stage to their epilogue's end) against the standalone
kernel's time per tile (kernel time x CTAs / tiles), the producer's mean wait for the item's
inputs; the consumers' idle time between tiles split into waiting for inputs and the rest
(loads not yet landed), by the kind of the next tile; the D2 offload's lag; and the run times
by tenth of the launch. One GPU:

    python tools/perf/backward_timeline.py --experts 48 192 [--out DIR]

With --out DIR it saves each launch's raw records (DIR/backward_trace_<E>.npz).
"""
import argparse
import os
import statistics

import numpy as np
import torch

KINDS = {8: "D2", 9: "D1", 10: "W"}
WORDS = 6
TAKE, READY, START, DONE, META, CTA = range(WORDS)


def decode(rec: np.ndarray, grid: int):
    """Items (dict of arrays, times in us from the first CTA's start) and CTA spans."""
    cap = rec.shape[0]
    cta = rec[cap - grid:][::-1]
    t0 = cta[:, TAKE].min()
    items = rec[0:cap - grid:2]
    extra = rec[1:cap - grid:2]
    n = int((items[:, TAKE] > 0).sum())
    items, extra = items[:n], extra[:n]
    us = lambda v: (v - t0) / 1e3
    meta = items[:, META]
    kind = meta & 0xFF
    tiles = np.where(kind == 10, extra[:, META], 1)
    keep = np.isin(kind, list(KINDS)) & (items[:, DONE] > 0)
    items, extra, meta, kind, tiles = items[keep], extra[keep], meta[keep], kind[keep], tiles[keep]
    return dict(kind=kind, cta=items[:, CTA], take=us(items[:, TAKE]), ready=us(items[:, READY]),
                start=us(items[:, START]), done=us(items[:, DONE]), crew=us(extra[:, DONE]), tiles=tiles,
                block=(meta >> 8) & 0xFFFFFFFF, col=meta >> 40), dict(start=us(cta[:, TAKE]), end=us(cta[:, DONE]))


def summarize(it, ctas, per_tile_ref) -> None:
    run = it["done"] - it["start"]
    wait = it["ready"] - it["take"]
    span = ctas["end"].max()
    print(f"  launch span {span:.0f} us, CTAs {len(ctas['start'])}, items {len(run)}")
    print(f"  {'kind':4s} {'tiles':>6s} {'run us/tile':>12s} {'standalone':>11s} {'ratio':>6s} {'input wait us':>14s}")
    for k, name in KINDS.items():
        m = it["kind"] == k
        if not m.any():
            continue
        t = it["tiles"][m].sum()
        per = run[m].sum() / t
        ref = per_tile_ref.get(name, float("nan"))
        print(f"  {name:4s} {t:6d} {per:12.2f} {ref:11.2f} {per / ref:6.3f} {wait[m].mean():14.2f}")
    busy = run.sum() / (len(ctas["start"]) * span)
    # Idle between tiles, per CTA in start order: the part before the next item's inputs were
    # acquired (its producer waited) and the rest (its loads had not landed).
    idle = {name: [0.0, 0.0, 0] for name in KINDS.values()}
    tail = 0.0
    for c in np.unique(it["cta"]):
        idx = np.where(it["cta"] == c)[0]
        idx = idx[np.argsort(it["start"][idx])]
        prev_done = ctas["start"][c] if c < len(ctas["start"]) else 0.0
        for j in idx:
            gap = max(0.0, it["start"][j] - prev_done)
            waited = min(gap, max(0.0, it["ready"][j] - prev_done))
            acc = idle[KINDS[int(it["kind"][j])]]
            acc[0] += waited
            acc[1] += gap - waited
            acc[2] += 1
            prev_done = it["done"][j]
        tail += span - prev_done
    n = len(ctas["start"])
    print(f"  consumers busy {100 * busy:.1f}% of CTAs x span; idle per CTA before a tile (input wait / loads):")
    for name, (w, l, c) in idle.items():
        if c:
            print(f"    {name:3s} {w / n:8.1f} / {l / n:8.1f} us  ({(w + l) / c:.2f} us per item)")
    print(f"    tail after the CTA's last tile: {tail / n:.1f} us per CTA")
    d2 = it["kind"] == 8
    if d2.any():
        lag = it["crew"][d2] - it["done"][d2]
        print(f"  D2 offload lag (crew released - consumers done): mean {lag.mean():.2f} us, max {lag.max():.2f}")
    print("  mean run us per tile by tenth of the span (D2 / D1 / W):")
    for q in range(10):
        lo, hi = q * span / 10, (q + 1) * span / 10
        cells = []
        for k in KINDS:
            m = (it["kind"] == k) & (it["start"] >= lo) & (it["start"] < hi)
            cells.append(f"{run[m].sum() / max(1, it['tiles'][m].sum()):6.1f} ({int(it['tiles'][m].sum()):4d})"
                         if m.any() else "     -       ")
        print(f"    {q}: " + "  ".join(cells))


def run(L: int, args) -> None:
    from megatron_mok.bench.gemm import expert_counts, offsets_of, time_ms
    from megatron_mok.ops import grouped_gemm as gg
    from megatron_mok.ops import megakernel_backward as bwd

    T, H, I, K = args.tokens, args.hidden, args.ffn, args.topk
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(L)
    counts = expert_counts(L, T * K, args.routing, gen)
    offs = offsets_of(counts, 128)
    R = offs[-1]
    real = torch.zeros(R, dtype=torch.bool, device=dev)
    for e, c in enumerate(counts):
        real[offs[e]:offs[e] + c] = True
    offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
    counts_d = torch.tensor(counts, dtype=torch.int32, device=dev)
    rows = lambda n: (torch.randn(R, n, device=dev) * real[:, None]).bfloat16()
    dy, x, gu0 = rows(H), rows(H), rows(2 * I)
    rw = torch.rand(R, device=dev) * real
    w1 = (torch.randn(L, 2 * I, H, device=dev) / H ** 0.5).bfloat16()
    w2 = (torch.randn(L, H, I, device=dev) / I ** 0.5).bfloat16()
    # Every real row a distinct (token, slot) of rank 0; padding rows -1.
    routes = T * K
    table = torch.full((R, 2), -1, dtype=torch.int32, device=dev)
    table[real, 0] = 0
    table[real, 1] = torch.randperm(routes, device=dev)[:int(real.sum())].to(torch.int32)
    slots_offset = 0
    scalars_offset = routes * H * 2
    region = torch.zeros(scalars_offset + 4 * routes, dtype=torch.uint8, device=dev)
    bases = torch.tensor([region.data_ptr()], dtype=torch.int64, device=dev)
    status = torch.zeros(8, dtype=torch.int32, device=dev)
    gu, dgu = gu0.clone(), torch.empty_like(gu0)
    h = torch.empty(R, I, dtype=torch.bfloat16, device=dev)
    dx = torch.empty_like(x)
    dwr = torch.empty(R, device=dev)
    scratch = torch.empty(gg.dgrad_scratch_floats(R, I), device=dev)
    dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
    v_d2, v_d1 = gg.variant("fc2_dgrad_swiglu", 128), gg.variant("dgrad", 128)
    v_push = gg.push_variant("dgrad", 128)
    launch = lambda trace=None: bwd.backward_compute(dy, x, gu, rw, w1, w2, offsets, counts_d, table, bases,
                                                     slots_offset, scalars_offset, status, 10.0, 0, d_fc1=dw1,
                                                     d_fc2=dw2, trace=trace)
    steps = {
        "D2: fc2 data gradient + SwiGLU": lambda: gg.launch_fc2_dgrad_swiglu(dy, w2, gu0, offsets, counts_d, rw, dgu,
                                                                            h, dwr, scratch, variant=v_d2),
        "W: fc2 weight gradient": lambda: gg.launch_weight_grad(dy, h, offsets, dw2, counts=counts_d, tma_store=True),
        "W: fc1 weight gradient": lambda: gg.launch_weight_grad(dgu, x, offsets, dw1, counts=counts_d,
                                                                tma_store=True),
        "D1: fc1 data gradient + push": lambda: gg.launch_fc1_dgrad_push(dgu, w1, offsets, table, bases, slots_offset,
                                                                        dwr, scalars_offset, variant=v_push),
        "D1 plain: fc1 data gradient": lambda: gg.launch_fc1_dgrad(dgu, w1, offsets, dx, variant=v_d1),
        "the launch": launch,
    }
    res = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, fn in steps.items():
            res[k].append(time_ms(fn, budget_s=0.3, max_iters=20))
    assert status.abs().sum().item() == 0, f"status {status.tolist()}"
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\nL = {L} experts, {R} layout rows ({sum(counts)} real), {args.routing} routing")
    for k, v in med.items():
        print(f"  {k:34s} {v:7.3f} ms")
    chain = sum(v for k, v in med.items() if not k.startswith("D1 plain") and k != "the launch")
    print(f"  {'chain (D2 + W + W + D1 push)':34s} {chain:7.3f} ms")
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = R // 128
    n_d2, n_d1 = blocks * (I // 256), blocks * (H // 256)
    w_tiles = 0
    for c in counts:  # standalone weight-gradient tiles: 128 x 256 outputs, both matrices, experts with rows
        if c:
            w_tiles += (2 * I // 128) * (H // 256) + (H // 128) * (I // 256)
    per_tile_ref = {"D2": 1e3 * med["D2: fc2 data gradient + SwiGLU"] * grid / n_d2,
                    "D1": 1e3 * med["D1: fc1 data gradient + push"] * grid / n_d1,
                    "W": 1e3 * (med["W: fc2 weight gradient"] + med["W: fc1 weight gradient"]) * grid / w_tiles}
    cap = 2 * (n_d2 + n_d1 + w_tiles) + grid + 64
    trace = torch.zeros(cap, WORDS, dtype=torch.int64, device=dev)
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    launch(trace)
    torch.cuda.synchronize()
    assert status.abs().sum().item() == 0, f"status {status.tolist()}"
    rec = trace.cpu().numpy()
    it, ctas = decode(rec, grid)
    summarize(it, ctas, per_tile_ref)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        np.savez_compressed(os.path.join(args.out, f"backward_trace_{L}.npz"), records=rec, grid=grid,
                            counts=np.array(counts), **{k.split(":")[0].replace(" ", "_"): v for k, v in med.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[48, 192])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for L in args.experts:
        run(L, args)


if __name__ == "__main__":
    main()
