"""Benchmark of the Hopper grouped GEMM kernels against ``torch._grouped_mm`` on the same data.

``python -m megatron_mok.bench.gemm`` runs, for the routed-expert shapes of Kimi-K2,
DeepSeek-V3 and Qwen3-235B at EP = 8, 2 and 1 (4096 tokens per rank, top-8, so about 32768
rows per rank spread over E / EP local experts), with uniform and skewed (Zipf-like, some
experts empty) expert loads, on the expert-grouped layout padded to 128 and to 64 rows:

    fc1+SwiGLU  ours (fused)     vs torch._grouped_mm, and it plus the separate SwiGLU kernel
    fc1         ours (plain GEMM, the pre-activation only) vs torch._grouped_mm
    fc2         ours             vs torch._grouped_mm
    fc2 dgrad   ours (+SwiGLU backward, router-weight gradient, h) vs torch._grouped_mm, and
                it plus the separate SwiGLU backward kernel
    fc1 dgrad, fc1 wgrad, fc2 wgrad (bf16 out)              vs torch._grouped_mm
    fc1 wgrad accumulated into an fp32 main_grad            vs torch._grouped_mm + add_

Each of our results is checked against torch's on the same inputs before it is timed. Times are
CUDA-event medians after warm-up; TFLOP/s count the useful FLOPs 2 * rows * N * K with rows the
real (unpadded) rows. The floor is max(FLOPs / 790 TFLOP/s, bytes / 4.1 TB/s) with the bytes of
one pass over the inputs and outputs (the H200 rates of
:data:`megatron_mok.bench.floors.H200`, rounded down).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from ..ops import grouped_gemm as gg

MODELS = {  # name: (H, I, E); top-8 for all three
    "kimi-k2": (7168, 2048, 384),
    "deepseek-v3": (7168, 2048, 256),
    "qwen3-235b": (4096, 1536, 128),
}
TOKENS_PER_RANK = 4096
TOPK = 8
PEAK_FLOPS = 790e12  # dense bf16 GEMM measured on the H200
PEAK_BYTES = 4.1e12  # HBM copy, read + write


def expert_counts(L: int, rows: int, routing: str, gen: torch.Generator) -> List[int]:
    """Rows each of the L local experts receives.

    uniform: every route picks an expert uniformly. skewed: a Zipf(1.2) popularity over the
    experts in random order, with one expert in eight receiving nothing.
    """
    if routing == "uniform":
        p = torch.ones(L, dtype=torch.float64)
    elif routing == "skewed":
        p = 1.0 / torch.arange(1, L + 1, dtype=torch.float64) ** 1.2
        p = p[torch.randperm(L, generator=gen)]
        p[torch.randperm(L, generator=gen)[: L // 8]] = 0
    else:
        raise ValueError(f"routing {routing!r}: uniform or skewed")
    picks = torch.multinomial(p, rows, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=L).tolist()


def offsets_of(counts: List[int], tile: int) -> List[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + -(-c // tile) * tile)
    return out


def time_ms(fn: Callable[[], object], budget_s: float = 0.08, max_iters: int = 10) -> float:
    """Median CUDA-event time of ``fn`` in ms, after warm-up; iterations fill ~budget_s."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-5)
    iters = int(min(max_iters, max(3, budget_s / est)))
    events = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def rel_err(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 26) -> float:
    """||out - ref|| / ||ref||, in float32 chunks of the flattened tensors (bounded memory)."""
    o, r = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for i in range(0, o.numel(), chunk):
        a, b = o[i:i + chunk].float(), r[i:i + chunk].float()
        num += float((a - b).pow(2).sum())
        den += float(b.pow(2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


@dataclass
class Row:
    model: str
    ep: int
    routing: str
    tile: int
    experts: int
    rows: int
    rows_padded: int
    max_rows: int
    empty_experts: int
    kernel: str
    flops: float
    bytes: float
    ours_ms: float
    ours_variant: str
    variants: Dict[str, float]
    torch_ms: float
    torch_plus_ms: Optional[float]
    check: float

    @property
    def floor_ms(self) -> float:
        return max(self.flops / PEAK_FLOPS, self.bytes / PEAK_BYTES) * 1e3

    def to_json(self) -> Dict[str, object]:
        d = dict(self.__dict__)
        d.update(floor_ms=self.floor_ms, ours_tflops=self.flops / self.ours_ms / 1e9,
                 torch_tflops=self.flops / self.torch_ms / 1e9)
        return d

    def line(self) -> str:
        tf = lambda ms: self.flops / ms / 1e9  # noqa: E731
        plus = f" | +sep {self.torch_plus_ms:7.3f} ms" if self.torch_plus_ms is not None else ""
        base = self.torch_plus_ms if self.torch_plus_ms is not None else self.torch_ms
        return (f"{self.model:12s} EP={self.ep} {self.routing:7s} t{self.tile:<3d} {self.kernel:16s} "
                f"ours {self.ours_ms:7.3f} ms {tf(self.ours_ms):5.0f} TF/s [{self.ours_variant:9s}] | "
                f"torch {self.torch_ms:7.3f} ms {tf(self.torch_ms):5.0f} TF/s{plus} | "
                f"x{base / self.ours_ms:4.2f} | floor {self.floor_ms:6.3f} | err {self.check:.1e}")


def _swiglu_ops():
    try:
        from ..ops import swiglu as sw

        return sw
    except ImportError:
        return None


class Case:
    """Inputs of one (model, EP, routing, tile) configuration; weights shared per model."""

    def __init__(self, w1_all, w2_all, H, I, L, counts, tile):
        dev = w1_all.device
        self.H, self.I, self.L, self.tile = H, I, L, tile
        self.counts = counts
        self.offs = offsets_of(counts, tile)
        self.R = self.offs[-1]
        self.w1, self.w2 = w1_all[:L], w2_all[:L]
        self.offsets = torch.tensor(self.offs, dtype=torch.int32, device=dev)
        self.counts_d = torch.tensor(counts, dtype=torch.int32, device=dev)
        self.ends = self.offsets[1:]
        real = torch.zeros(self.R, dtype=torch.bool, device=dev)
        for l in range(L):
            real[self.offs[l]:self.offs[l] + counts[l]] = True
        self.real = real
        R = self.R
        self.x = torch.randn(R, H, device=dev).bfloat16() * real[:, None]
        self.dy = torch.randn(R, H, device=dev).bfloat16() * real[:, None]
        self.rw = torch.rand(R, device=dev) * real
        self.h = torch.empty(R, I, dtype=torch.bfloat16, device=dev)
        self.gu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
        self.y = torch.empty(R, H, dtype=torch.bfloat16, device=dev)
        self.dgu = torch.empty(R, 2 * I, dtype=torch.bfloat16, device=dev)
        self.h2 = torch.empty(R, I, dtype=torch.bfloat16, device=dev)
        self.dx = torch.empty(R, H, dtype=torch.bfloat16, device=dev)
        self.dw = torch.empty(R, dtype=torch.float32, device=dev)
        self.scratch = torch.empty(max(1, gg.dgrad_scratch_floats(R, I)), dtype=torch.float32, device=dev)


MULTICAST = "include"  # set from --multicast: include, exclude or only


def variants(kernel: str, tile: int):
    """The built variants of ``kernel`` that take a ``tile`` layout (filtered by --multicast)."""
    keep = {"include": lambda v: True, "exclude": lambda v: not v.multicast, "only": lambda v: v.multicast}[MULTICAST]
    return [v for v in sorted(gg.VARIANTS[kernel]) if tile % v.block_m == 0 and keep(v)]


def vname(v) -> str:
    return f"m{v.block_m}n{v.wg_n}" + ("t" if v.tma_store else "") + ("c" if v.multicast else "")


def run_case(c: Case, label: dict, sw, rows_out: List[Row], wgrad_fp32: bool) -> None:
    H, I, L = c.H, c.I, c.L
    R_real = sum(c.counts)
    active = sum(1 for n in c.counts if n > 0)
    meta = dict(label, tile=c.tile, experts=L, rows=R_real, rows_padded=c.R, max_rows=max(c.counts),
                empty_experts=L - active)
    w_bytes1 = active * 2 * I * H * 2
    w_bytes2 = active * H * I * 2

    def add(kernel, flops, nbytes, ours: Dict[str, float], torch_ms, torch_plus, check):
        best = min(ours, key=ours.get)
        rows_out.append(Row(kernel=kernel, flops=flops, bytes=nbytes, ours_ms=ours[best], ours_variant=best,
                            variants=ours, torch_ms=torch_ms, torch_plus_ms=torch_plus, check=check, **meta))
        print(rows_out[-1].line(), flush=True)

    real = c.real[:, None]
    # ---- fc1 + SwiGLU (router weight applied inside, pre-activation saved: the backend's use)
    gu_t = torch._grouped_mm(c.x, c.w1.transpose(1, 2), offs=c.ends)
    if sw is not None:
        h_t = sw.swiglu_forward(gu_t, c.rw, c.offsets)
        sep = lambda: sw.swiglu_forward(torch._grouped_mm(c.x, c.w1.transpose(1, 2), offs=c.ends), c.rw, c.offsets)  # noqa: E731
    else:
        h_t = F.silu(gu_t[:, :I]) * gu_t[:, I:] * c.rw[:, None]
        sep = lambda: (lambda a: F.silu(a[:, :I]) * a[:, I:] * c.rw[:, None])(  # noqa: E731
            torch._grouped_mm(c.x, c.w1.transpose(1, 2), offs=c.ends))
    ours, err = {}, 0.0
    for v in variants("fc1", c.tile):
        f = lambda: gg.launch_fc1_swiglu(c.x, c.w1, c.offsets, c.counts_d, c.rw, c.h, c.gu, variant=v)  # noqa: E731
        f()
        err = max(err, rel_err(c.h * real, h_t * real), rel_err(c.gu * real, gu_t * real))
        ours[vname(v)] = time_ms(f)
    t_mm = time_ms(lambda: torch._grouped_mm(c.x, c.w1.transpose(1, 2), offs=c.ends))
    if ours:
        add("fc1+swiglu", 2 * R_real * 2 * I * H, c.R * H * 2 + w_bytes1 + c.R * 3 * I * 2, ours, t_mm,
            time_ms(sep), err)
    else:  # no variant of this filter takes the layout: the other kernels still need gu and h
        gg.launch_fc1_swiglu(c.x, c.w1, c.offsets, c.counts_d, c.rw, c.h, c.gu,
                             variant=gg.DEFAULTS["fc1"][c.tile])
    # ---- fc1's pre-activation alone (the plain row GEMM, without the fused SwiGLU epilogue);
    # into a scratch buffer, so gu keeps the fused kernel's output
    ours, err = {}, 0.0
    gu2 = torch.empty_like(c.gu)
    for v in variants("fc2", c.tile):
        f = lambda v=v, out=gu2: gg.launch_fc2(c.x, c.w1, c.offsets, out, variant=v)  # noqa: E731
        f()
        err = max(err, rel_err(gu2 * real, gu_t * real))
        ours[vname(v)] = time_ms(f)
    if ours:
        add("fc1", 2 * R_real * 2 * I * H, c.R * H * 2 + w_bytes1 + c.R * 2 * I * 2, ours, t_mm, None, err)
    del gu_t, gu2

    # ---- fc2
    y_t = torch._grouped_mm(c.h, c.w2.transpose(1, 2), offs=c.ends)
    ours, err = {}, 0.0
    for v in variants("fc2", c.tile):
        f = lambda: gg.launch_fc2(c.h, c.w2, c.offsets, c.y, variant=v)  # noqa: E731
        f()
        err = max(err, rel_err(c.y * real, y_t * real))
        ours[vname(v)] = time_ms(f)
    if ours:
        add("fc2", 2 * R_real * H * I, c.R * I * 2 + w_bytes2 + c.R * H * 2, ours,
            time_ms(lambda: torch._grouped_mm(c.h, c.w2.transpose(1, 2), offs=c.ends)), None, err)
    del y_t

    # ---- fc2 dgrad + SwiGLU backward (+ router-weight gradient, + h for the fc2 wgrad)
    g_t = torch._grouped_mm(c.dy, c.w2, offs=c.ends)
    if sw is not None:
        dgu_t, dw_t, _ = sw.swiglu_backward(c.gu, c.rw, g_t, c.offsets, True)
        sep = lambda: sw.swiglu_backward(c.gu, c.rw, torch._grouped_mm(c.dy, c.w2, offs=c.ends), c.offsets, True)  # noqa: E731
    else:
        dgu_t, dw_t, sep = None, None, None
    ours, err = {}, 0.0
    for v in variants("fc2_dgrad_swiglu", c.tile):
        f = lambda: gg.launch_fc2_dgrad_swiglu(c.dy, c.w2, c.gu, c.offsets, c.counts_d, c.rw, c.dgu, c.h2,  # noqa: E731
                                               c.dw, c.scratch, variant=v)
        f()
        if dgu_t is not None:
            err = max(err, rel_err(c.dgu * real, dgu_t * real), rel_err(c.dw * c.real, dw_t * c.real))
        ours[vname(v)] = time_ms(f)
    if ours:
        add("fc2dgrad+swiglu", 2 * R_real * H * I, c.R * (H + 2 * I) * 2 + w_bytes2 + c.R * 3 * I * 2, ours,
            time_ms(lambda: torch._grouped_mm(c.dy, c.w2, offs=c.ends)), time_ms(sep) if sep else None, err)
    # ---- the plain fc2 dgrad (for a separate SwiGLU backward)
    ours, err = {}, 0.0
    for v in variants("dgrad", c.tile):
        f = lambda: gg.launch_fc2_dgrad(c.dy, c.w2, c.offsets, c.h2, variant=v)  # noqa: E731
        f()
        err = max(err, rel_err(c.h2 * real, g_t * real))
        ours[vname(v)] = time_ms(f)
    if ours:
        add("fc2dgrad", 2 * R_real * H * I, c.R * H * 2 + w_bytes2 + c.R * I * 2, ours,
            time_ms(lambda: torch._grouped_mm(c.dy, c.w2, offs=c.ends)), None, err)
    # the fc2 weight gradient below takes h from the fused kernel, as the backend would
    gg.launch_fc2_dgrad_swiglu(c.dy, c.w2, c.gu, c.offsets, c.counts_d, c.rw, c.dgu, c.h2, c.dw, c.scratch,
                               variant=gg.DEFAULTS["fc2_dgrad_swiglu"][c.tile])
    del g_t, dgu_t, dw_t

    # ---- fc1 dgrad
    dx_t = torch._grouped_mm(c.dgu, c.w1, offs=c.ends)
    ours, err = {}, 0.0
    for v in variants("dgrad", c.tile):
        f = lambda: gg.launch_fc1_dgrad(c.dgu, c.w1, c.offsets, c.dx, variant=v)  # noqa: E731
        f()
        err = max(err, rel_err(c.dx * real, dx_t * real))
        ours[vname(v)] = time_ms(f)
    if ours:
        add("fc1dgrad", 2 * R_real * 2 * I * H, c.R * 2 * I * 2 + w_bytes1 + c.R * H * 2, ours,
            time_ms(lambda: torch._grouped_mm(c.dgu, c.w1, offs=c.ends)), None, err)
    del dx_t
    if MULTICAST == "only":
        return  # the weight gradients have no multicast variant

    # ---- weight gradients (bf16 out), then fc1's accumulated into fp32 main_grad
    for name, a, b in (("fc1wgrad", c.dgu, c.x), ("fc2wgrad", c.dy, c.h2)):
        M, N = a.shape[1], b.shape[1]
        t_out = torch._grouped_mm(a.t(), b, offs=c.ends)
        out = torch.empty(L, M, N, dtype=torch.bfloat16, device=a.device)
        ours, err = {}, 0.0
        for tma in (False, True):
            f = lambda out=out, tma=tma: gg.launch_weight_grad(a, b, c.offsets, out, counts=c.counts_d,  # noqa: E731
                                                               tma_store=tma)
            f()
            err = max(err, rel_err(out, t_out))
            ours["m128n256" + ("t" if tma else "")] = time_ms(f)
        del t_out
        t_ms = time_ms(lambda: torch._grouped_mm(a.t(), b, offs=c.ends))
        add(name, 2 * R_real * M * N, c.R * (M + N) * 2 + L * M * N * 2, ours, t_ms, None, err)
        del out
        if name == "fc1wgrad" and wgrad_fp32:
            main = torch.zeros(L, M, N, dtype=torch.float32, device=a.device)
            f = lambda: gg.launch_weight_grad(a, b, c.offsets, main, counts=c.counts_d, accumulate=True)  # noqa: E731
            ours = {"m128n256": time_ms(f)}
            t_ms = time_ms(lambda: main.add_(torch._grouped_mm(a.t(), b, offs=c.ends)))
            add("fc1wgrad+=fp32", 2 * R_real * M * N, c.R * (M + N) * 2 + L * M * N * 8, ours, t_ms, None, 0.0)
            del main
        torch.cuda.empty_cache()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ep", default="8,2,1")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--tiles", default="128,64")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later configs are skipped")
    ap.add_argument("--fp32-wgrad-max-gb", type=float, default=24.0,
                    help="run the fp32 main_grad accumulation when the fp32 gradient fits this size")
    ap.add_argument("--multicast", choices=("include", "exclude", "only"), default="include",
                    help="which kernel variants to time: with or without the cluster-multicast ones")
    ap.add_argument("--out", default=None, help="write one JSON object per result line here")
    args = ap.parse_args(argv)
    global MULTICAST
    MULTICAST = args.multicast
    if not torch.cuda.is_available():
        print("no CUDA GPU: the grouped GEMM benchmark needs an sm_90 GPU", file=sys.stderr)
        return 2
    start = time.perf_counter()
    sw = _swiglu_ops()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; separate SwiGLU: "
          f"{'mok swiglu kernels' if sw is not None else 'torch eager'}", flush=True)
    rows: List[Row] = []
    skipped: List[str] = []
    failures: List[str] = []
    gen = torch.Generator().manual_seed(args.seed)
    models = args.models.split(",")
    # One weight buffer per (H, I): DeepSeek-V3's experts are a prefix of Kimi-K2's.
    weights: Dict[tuple, tuple] = {}
    for model in models:
        H, I, E = MODELS[model]
        E = max(E, weights.get((H, I), (None, None, 0))[2])
        if (H, I) not in weights or weights[(H, I)][2] < E:
            w1_all = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda")
            w2_all = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda")
            for e in range(0, E, 16):
                w1_all[e:e + 16].normal_(0, 1 / math.sqrt(H))
                w2_all[e:e + 16].normal_(0, 1 / math.sqrt(I))
            weights[(H, I)] = (w1_all, w2_all, E)
    for ep in map(int, args.ep.split(",")):
        for model in models:
            H, I, E = MODELS[model]
            w1_all, w2_all, _ = weights[(H, I)]
            L = E // ep
            for routing in args.routing.split(","):
                counts = expert_counts(L, TOKENS_PER_RANK * TOPK, routing, gen)
                for tile in map(int, args.tiles.split(",")):
                    if time.perf_counter() - start > args.time_budget:
                        skipped.append(f"{model} EP={ep} {routing} tile {tile}")
                        continue
                    c = Case(w1_all, w2_all, H, I, L, counts, tile)
                    fp32 = L * 2 * I * H * 4 <= args.fp32_wgrad_max_gb * 1e9
                    try:
                        run_case(c, dict(model=model, ep=ep, routing=routing), sw, rows, fp32)
                    except Exception as err:  # keep measuring the other cases; report the failure
                        print(f"FAILED {model} EP={ep} {routing} tile {tile}: {type(err).__name__}: {err}",
                              flush=True)
                        failures.append(f"{model} EP={ep} {routing} tile {tile}: {err}")
                    del c
                    torch.cuda.empty_cache()
    del weights
    torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r.to_json()) + "\n")
    print("\nsummary: torch._grouped_mm time / ours per kernel (best variant per case; > 1: ours faster)")
    for kernel in dict.fromkeys(r.kernel for r in rows):
        sel = [r for r in rows if r.kernel == kernel]
        speed = [r.torch_ms / r.ours_ms for r in sel]
        speed_sep = [r.torch_plus_ms / r.ours_ms for r in sel if r.torch_plus_ms is not None]
        msg = f"  {kernel:16s} speed vs torch mm: min {min(speed):.2f} median {statistics.median(speed):.2f}"
        if speed_sep:
            msg += f"; vs mm + separate SwiGLU: min {min(speed_sep):.2f} median {statistics.median(speed_sep):.2f}"
        msg += f"; max check err {max(r.check for r in sel):.1e}"
        print(msg)
    if skipped:
        print(f"skipped (time budget): {'; '.join(skipped)}")
    if failures:
        print(f"FAILED cases: {len(failures)}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
