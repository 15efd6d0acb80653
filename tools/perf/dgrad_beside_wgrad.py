"""Does a weight-streaming data gradient run faster beside a store-heavy weight gradient than after
it? The premise of one backward launch for both (docs/training.md, section 2.1), tested with the
standalone kernels: the fc1 data gradient (the default variant) and the fc1 weight gradient (bf16),
Kimi-K2 (H 7168, I 2048, 4096 tokens, top-8), uniform routing, 48 and 192 experts per GPU. Each
alone on every SM and on each share of the SMs, one after the other, and both at once on two
streams with the SMs split (``num_ctas``: half and half, two thirds to either). CUDA events on the
first stream, the second joined back into it; medians of ``--rounds`` rounds. One GPU:

    python tools/perf/dgrad_beside_wgrad.py [--experts 48 192] [--rounds 3]
"""
import argparse
import statistics

import torch

H, I, K, T = 7168, 2048, 8, 4096


def run(L: int, rounds: int) -> None:
    from megatron_mok.bench.gemm import expert_counts, offsets_of, time_ms
    from megatron_mok.ops import grouped_gemm as gg

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(L)
    counts = expert_counts(L, T * K, "uniform", gen)
    offs = offsets_of(counts, 128)
    R = offs[-1]
    real = torch.zeros(R, dtype=torch.bool, device="cuda")
    for e, c in enumerate(counts):
        real[offs[e]:offs[e] + c] = True
    offsets = torch.tensor(offs, dtype=torch.int32, device="cuda")
    counts_d = torch.tensor(counts, dtype=torch.int32, device="cuda")
    dgu = (torch.randn(R, 2 * I, device="cuda") * real[:, None]).bfloat16()
    x = (torch.randn(R, H, device="cuda") * real[:, None]).bfloat16()
    w1 = (torch.randn(L, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
    dx = torch.empty(R, H, dtype=torch.bfloat16, device="cuda")
    dw1 = torch.empty(L, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    v = gg.variant("dgrad", 128)
    s2 = torch.cuda.Stream()

    def dgrad(n=0):
        gg.launch_fc1_dgrad(dgu, w1, offsets, dx, variant=v, num_ctas=n)

    def wgrad(n=0):
        gg.launch_weight_grad(dgu, x, offsets, dw1, counts=counts_d, num_ctas=n)

    def both(n1, n2):
        def run_both():
            s2.wait_stream(torch.cuda.current_stream())
            dgrad(n1)
            with torch.cuda.stream(s2):
                wgrad(n2)
            torch.cuda.current_stream().wait_stream(s2)
        return run_both

    cases = {"data gradient alone": lambda: dgrad(), "weight gradient alone": lambda: wgrad(),
             "one after the other": lambda: (dgrad(), wgrad())}
    shares = (sms // 2, 2 * sms // 3, sms // 3)
    for n in shares:
        cases[f"data gradient on {n} SMs"] = lambda n=n: dgrad(n)
        cases[f"weight gradient on {n} SMs"] = lambda n=n: wgrad(n)
    for n1 in shares:
        cases[f"at once, {n1} + {sms - n1} SMs"] = both(n1, sms - n1)
    res = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            res[k].append(time_ms(fn, budget_s=0.2, max_iters=10))
    for k, t in res.items():
        print(f"L={L:3d} {k:30s} {statistics.median(t):7.3f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[48, 192], help="experts per GPU, one run each")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every case; the medians are printed")
    args = ap.parse_args()
    for L in args.experts:
        run(L, args.rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
