"""Where the forward megakernel's time goes: runs one traced launch per setting and prints its
timeline summary (docs/megakernel.md, "Timeline").

    python tools/perf/megakernel_timeline.py --experts 6 --settings 16:4096:8192 8:2048:8192
    torchrun --nproc-per-node 2 tools/perf/megakernel_timeline.py --experts 6 ...   (P = 2)

    torchrun --nproc-per-node 2 tools/perf/megakernel_timeline.py --experts 6 \\
        --ab pairs=off,on --blocks --rounds 30                     (A/B timing of a tunable)
    torchrun --nproc-per-node 2 tools/perf/megakernel_timeline.py --experts 6 --ab-settings 12:: 8::
    torchrun --nproc-per-node 2 tools/perf/megakernel_timeline.py --experts 192 --bound

Each setting is comm:minibatch:ring[:pairs[:group_blocks]], the candidate syntax of
``python -m megatron_mok.bench tune`` (empty fields: the defaults). Per setting and rank it
prints: the span of the launch and of its phases (first tile, last tile (its epilogue pushes the
rows home), combine-done, slot sum), per item kind the count, mean wait for the input and mean
run time (and the rate it means), the compute CTAs' busy share and their stalls by the kind of
tile they waited for, the tile boundaries (when the next tile was taken, had its input and
started, after the previous one ended; per CTA of a pair), and with --milestones the first and
last minibatches' milestones. With --out DIR it also saves a per-CTA timeline chart of rank 0
(DIR/<name>.png) and, with --npz, every rank's raw records.

With --bound it instead times the GEMM bound: blocks of megakernel calls and of
torch._grouped_mm fc1 + fc2 alone on the rank's expert load (A B B A B A A B, after alternating
untimed calls of both), each after untimed calls that bring the card to the power state it holds
under that load, and prints both medians, the ratio (target: 1.15x) and the medians per block;
with --host-lead MS the GPU spins MS before each timed call, so the host path before the launches
is not timed; with --back-to-back each block's calls are queued without synchronising (steady
state); with --clocks S each side then runs back to back for S seconds while nvidia-smi samples
the GPUs' SM clock and power draw (their medians per GPU and side).

With --ab FIELD=A,B it instead times the setting with one tunable set to A and to B (FIELD: comm,
minibatch, ring, pairs or group_blocks, as in the setting; e.g. group_blocks=8,16, pairs=on,off,
comm=6,8; the same value twice is an A/A run, the method's noise), with --ab-settings two
settings; each call synchronised and timed on the slowest rank, alternating call by call; it
prints the medians and the paired difference. With --blocks it times them in blocks
A B B A B A A B instead, each after untimed calls: under the power cap, alternating call by call
hides a difference in energy per call (tools/perf/ab_stats.py); correct several such runs for the
blocks' positions with tools/perf/ab_positions.py.
Needs the CUDA library (an sm_90 GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ab_stats import BLOCK_ORDER, b_minus_a, block_rounds, blocks_by_position, interleaved_rounds
from megatron_mok import MoKConfig
from megatron_mok.bench.routing import ROUTINGS, RoutingSpec, make_routing
from megatron_mok.bench.tune import Candidate
from megatron_mok.functional import check_errors, mok_moe

KINDS = {1: "fc1", 2: "fc2", 3: "pull", 6: "part"}
"""Item kinds of the trace (csrc/include/mok/megakernel/trace.cuh); part: a first block's pull
in parts (first_pull_parts of them). A CTA's own record has the kind
``constants().trace_cta_kind``."""
AB_FIELDS = {"comm": "comm_sms", "comm_sms_forward": "comm_sms", "minibatch": "minibatch_rows",
             "minibatch_rows": "minibatch_rows", "ring": "ring_rows", "ring_rows": "ring_rows",
             "pairs": "pairs", "group_blocks": "group_blocks", "group": "group_blocks"}
"""Names --ab takes -> the field of :class:`megatron_mok.bench.tune.Candidate`."""
SETTING_POSITION = {"comm_sms": 0, "minibatch_rows": 1, "ring_rows": 2, "pairs": 3, "group_blocks": 4}


def decode(records: np.ndarray, cta_kind: int):
    """Split the records (int64 [N, 6], columns ``constants().trace_fields``) into items (kind,
    block, col, cta, take, ready, start, done in ms from the launch's first CTA start) of the
    kinds in :data:`KINDS`, and CTA records (kind ``cta_kind``)."""
    meta = records[:, 4]
    kind = meta & 0xFF
    written = records[:, 0] > 0
    cta_rows = written & (kind == cta_kind)
    item_rows = written & np.isin(kind, list(KINDS))
    t0 = records[cta_rows, 0].min()
    ms = (records[:, :4] - t0) / 1e6
    items = dict(kind=kind[item_rows], block=(meta[item_rows] >> 8) & 0xFFFFFFFF, col=meta[item_rows] >> 40,
                 cta=records[item_rows, 5], take=ms[item_rows, 0], ready=ms[item_rows, 1],
                 start=ms[item_rows, 2], done=ms[item_rows, 3])
    ctas = dict(role=(meta[cta_rows] >> 8) & 0xFF, cta=records[cta_rows, 5], start=ms[cta_rows, 0],
                queue_end=ms[cta_rows, 1], combine=ms[cta_rows, 2], end=ms[cta_rows, 3])
    return items, ctas


def _blocks_of(counts: np.ndarray, block_rows: int) -> np.ndarray:
    return (np.asarray(counts) + block_rows - 1) // block_rows


def block_real_rows(counts: np.ndarray, n_blocks: int, block_rows: int) -> np.ndarray:
    """Real (non-padding) rows of each row block of the expert-grouped layout, from the rank's
    rows per local expert (int [L]); every expert's segment is padded to ``block_rows``."""
    starts = np.concatenate([[0], np.cumsum(_blocks_of(counts, block_rows) * block_rows)[:-1]])
    real = np.zeros(n_blocks, dtype=np.int64)
    for start, cnt in zip(starts, counts):
        for b in range(int(start) // block_rows, (int(start) + int(cnt) + block_rows - 1) // block_rows):
            if b < n_blocks:
                real[b] = min(block_rows, int(start) + int(cnt) - block_rows * b)
    return real


def block_remote_rows(counts_by_source: np.ndarray, rank: int, n_blocks: int, block_rows: int) -> np.ndarray:
    """Real rows of each row block whose home is another rank, from the rows each source rank
    routes to each local expert (int [P, L]): within an expert the layout holds the rows in
    (source rank, token, slot) order (csrc/src/schedule.cu)."""
    counts = counts_by_source.sum(axis=0)
    starts = np.concatenate([[0], np.cumsum(_blocks_of(counts, block_rows) * block_rows)[:-1]])
    remote = np.zeros(n_blocks, dtype=np.int64)
    for l, start in enumerate(starts):
        row = int(start)
        for s, cnt in enumerate(counts_by_source[:, l]):
            if s != rank:  # rows [row, row + cnt) of the layout go to rank s
                for b in range(row // block_rows, (row + int(cnt) + block_rows - 1) // block_rows):
                    if b < n_blocks:
                        remote[b] += min(row + int(cnt), block_rows * (b + 1)) - max(row, block_rows * b)
            row += int(cnt)
    return remote


def tile_boundaries(items, pairs: bool) -> List[str]:
    """Per kind of boundary between two consecutive tiles of a compute CTA (fc1 -> fc1, fc1 -> fc2,
    ...), the medians of when the next tile was taken, when its input was acquired and when its
    MMAs began, in us from the end of the previous tile (its counter release); in pair mode per
    CTA of the cluster (the leader is the even CTA). A start later than +0.3 us means the
    producer's chain (take, input wait, first loads) was not hidden by the previous tile's
    epilogue."""
    kinds = items["kind"]
    comp = np.isin(kinds, (1, 2))
    groups = {}
    for c in np.unique(items["cta"][comp]):
        sel = np.where(comp & (items["cta"] == c))[0]
        sel = sel[np.argsort(items["start"][sel])]
        prev, nxt = sel[:-1], sel[1:]
        done = items["done"][prev]
        rank = int(c) % 2 if pairs else 0
        for p_i, n_i, d in zip(prev, nxt, done):
            key = (rank, int(kinds[p_i]), int(kinds[n_i]))
            groups.setdefault(key, []).append(
                (items["take"][n_i] - d, items["ready"][n_i] - d, items["start"][n_i] - d))
    out = []
    for (rank, a, b), rows in sorted(groups.items()):
        take, ready, start = (float(np.median(col)) * 1e3 for col in zip(*rows))
        who = ("leader " if rank == 0 else "follower ") if pairs else ""
        out.append(f"  {who}fc{a} -> fc{b} (n={len(rows)}): next taken {take:+.2f}, input in {ready:+.2f}, "
                   f"MMAs start {start:+.2f} us after the previous tile's end")
    return out


def block_experts(counts: np.ndarray, block_rows: int) -> np.ndarray:
    """The local expert of each block in queue order (int [n_blocks]): queue positions keep the
    experts' segments, from the rank's rows per local expert (int [L])."""
    return np.repeat(np.arange(len(counts)), _blocks_of(counts, block_rows))


def pair_shares_weights(experts: np.ndarray, mb_blocks: int) -> np.ndarray:
    """Per block in queue order: whether its pair tile's two blocks (first + 2j, first + 2j + 1
    of its minibatch, plan.cuh) are one expert's, so the weight tile is multicast."""
    b = np.arange(len(experts))
    first = b // mb_blocks * mb_blocks
    partner = first + ((b - first) ^ 1)
    ok = partner < len(experts)
    shared = np.zeros(len(experts), dtype=bool)
    shared[ok] = experts[b[ok]] == experts[partner[ok]]
    return shared


def summarize(items, ctas, *, H: int, I: int, mb_rows: int, label: str, consts, real_rows=None,
              pairs: bool = False, remote_rows=None, experts=None) -> List[str]:
    """The timeline summary as lines of text. consts: the kernel's tile sizes
    (``megatron_mok.ops.megakernel.constants()``: block_rows, fc1_cols, fc2_cols,
    first_pull_parts). real_rows: per block, splits the tile times into blocks more than half
    full and the others; remote_rows: per block, the real rows whose home is another rank,
    splits them by that share; experts: per block, the local expert, splits pair tiles into
    those sharing the weight tile and those that do not."""
    block_rows = consts.block_rows
    out = [f"-- {label}"]
    span = ctas["end"].max()
    kinds = items["kind"]
    out.append(f"span {span:.3f} ms | last fc1 {items['done'][kinds == 1].max():.3f} | last fc2 "
               f"{items['done'][kinds == 2].max():.3f} | last pull {items['done'][np.isin(kinds, (3, 6))].max():.3f} | "
               f"combine-done seen {ctas['combine'].min():.3f}"
               f"-{ctas['combine'].max():.3f} | slot sum ends {ctas['end'].max():.3f} | CTA starts "
               f"{ctas['start'].min():.3f}-{ctas['start'].max():.3f}")
    # fc1 tiles: fc1_cols h columns = 2 x fc1_cols gate and up columns; bf16 rows read + written.
    flop = {1: 2 * block_rows * 2 * consts.fc1_cols * H, 2: 2 * block_rows * consts.fc2_cols * I}
    byts = {3: 2 * block_rows * H * 2, 6: 2 * (block_rows // consts.first_pull_parts) * H * 2}
    for k, name in KINDS.items():
        sel = kinds == k
        if not sel.any():
            continue
        run = items["done"][sel] - items["start"][sel]
        wait = items["ready"][sel] - items["take"][sel]
        med = float(np.median(run))
        rate = (f"{flop[k] / med / 1e9:.1f} TFLOP/s per CTA" if k in flop
                else f"{byts[k] / med / 1e6:.1f} GB/s per CTA")
        out.append(f"{name:5s} n={int(sel.sum()):6d} run median {med * 1e3:8.1f} us (p90 "
                   f"{np.percentile(run, 90) * 1e3:8.1f}) -> {rate} | wait mean {wait.mean() * 1e3:8.1f} us, "
                   f"max {wait.max() * 1e3:8.1f} us")
        if real_rows is not None and k in flop:
            small = real_rows[items["block"][sel]] <= block_rows // 2
            for what, part in ((f"> {block_rows // 2} real rows", ~small), (f"<= {block_rows // 2} real rows", small)):
                if part.any():
                    out.append(f"      blocks with {what}: n={int(part.sum())} run median "
                               f"{np.median(run[part]) * 1e3:.1f} us, CTA-time {run[part].sum():.1f} ms")
        if pairs and experts is not None and k in flop:
            shared = pair_shares_weights(experts, mb_rows // block_rows)[items["block"][sel]]
            for what, part in (("one expert (weights shared)", shared), ("two experts (weights not shared)", ~shared)):
                if part.any():
                    out.append(f"      pair tiles of {what}: n={int(part.sum())} run median "
                               f"{np.median(run[part]) * 1e3:.1f} us (p90 {np.percentile(run[part], 90) * 1e3:.1f}), "
                               f"CTA-time {run[part].sum():.1f} ms")
        if remote_rows is not None and real_rows is not None and k in flop:
            blk = items["block"][sel]
            share = remote_rows[blk] / np.maximum(real_rows[blk], 1)
            for what, part in (("no remote rows", share == 0), ("some remote rows", (share > 0) & (share < 1)),
                               ("only remote rows", share >= 1)):
                if part.any():
                    out.append(f"      blocks with {what}: n={int(part.sum())} run median "
                               f"{np.median(run[part]) * 1e3:.1f} us (p90 {np.percentile(run[part], 90) * 1e3:.1f}), "
                               f"CTA-time {run[part].sum():.1f} ms")
    # Compute CTAs: busy share of [their start, last tile done], stalls between tiles. Comm CTAs
    # that joined the compute queue after their pulls are counted apart.
    comp = np.isin(kinds, (1, 2))
    comm_ctas = set(ctas["cta"][ctas["role"] == 1].tolist())
    joined = [c for c in np.unique(items["cta"][comp]) if int(c) in comm_ctas]
    if joined:
        sel = comp & np.isin(items["cta"], joined)
        out.append(f"comm CTAs that joined the compute queue: {len(joined)}, {int(sel.sum())} tiles from "
                   f"{items['start'][sel].min():.3f} ms, CTA-time {(items['done'][sel] - items['start'][sel]).sum():.1f} ms")
    stall_by_kind = {1: 0.0, 2: 0.0}
    busy = 0.0
    window = 0.0
    first_gap = []
    for c in [c for c in np.unique(items["cta"][comp]) if int(c) not in comm_ctas]:
        sel = comp & (items["cta"] == c)
        order = np.argsort(items["start"][sel])
        st, dn, kd = items["start"][sel][order], items["done"][sel][order], kinds[sel][order]
        busy += float((dn - st).sum())
        cta_start = float(ctas["start"][ctas["cta"] == c][0])
        window += float(dn[-1] - cta_start)
        first_gap.append(float(st[0] - cta_start))
        gaps = st[1:] - dn[:-1]
        for k in (1, 2):
            stall_by_kind[k] += float(gaps[(kd[1:] == k) & (gaps > 0)].sum())
    n_comp = len(np.unique(items["cta"][comp])) - len(joined)
    out.append(f"compute CTAs {n_comp}: busy {100 * busy / window:.1f}% of their window; stalls before fc1 "
               f"{stall_by_kind[1] / n_comp:.3f} ms, before fc2 {stall_by_kind[2] / n_comp:.3f} ms per CTA; "
               f"first tile starts {statistics.median(first_gap):.3f} ms after the CTA (median)")
    out.append("tile boundaries (medians):")
    out += tile_boundaries(items, pairs)
    tail = ctas["end"].max() - items["done"][comp].max()
    out.append(f"after the last tile: {tail:.3f} ms (combine-done, slot sum)")
    # Minibatch milestones.
    mb_blocks = mb_rows // block_rows
    mb = items["block"] // mb_blocks
    n_mb = int(mb.max()) + 1
    rows = []
    for m in sorted(set(range(min(3, n_mb))) | set(range(max(0, n_mb - 2), n_mb))):
        def of(k):  # pulls: whole blocks or parts of first blocks
            return (mb == m) & (np.isin(kinds, (3, 6)) if k == 3 else kinds == k)

        def last(k):
            sel = of(k)
            return items["done"][sel].max() if sel.any() else float("nan")

        def first(k):
            sel = of(k)
            return items["start"][sel].min() if sel.any() else float("nan")
        rows.append(f"mb {m:3d}: pull {first(3):7.3f}-{last(3):7.3f} fc1 {first(1):7.3f}-{last(1):7.3f} "
                    f"fc2 {first(2):7.3f}-{last(2):7.3f}")
    out.append(f"{n_mb} minibatches of {mb_blocks} blocks (ms):")
    out.extend("  " + r for r in rows)
    return out


def chart(items, ctas, path: str, title: str) -> None:
    """Per-CTA timeline: one row per CTA, a bar per item (fc1, fc2, pull, slot sum)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {1: "tab:blue", 2: "tab:green", 3: "tab:orange", 6: "tab:olive"}
    fig, ax = plt.subplots(figsize=(14, 8))
    for k, name in KINDS.items():
        sel = items["kind"] == k
        ax.barh(items["cta"][sel], items["done"][sel] - items["start"][sel], left=items["start"][sel],
                height=0.8, color=colors[k], label=name, linewidth=0)
    ax.barh(ctas["cta"], ctas["end"] - ctas["combine"], left=ctas["combine"], height=0.8, color="tab:gray",
            label="slot sum", linewidth=0)
    ax.set_xlabel("ms since the first CTA started")
    ax.set_ylabel("CTA")
    ax.set_title(title)
    ax.legend(loc="upper right", ncols=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gemms_alone_call(rows: int, counts: np.ndarray, fc1: torch.Tensor, fc2: torch.Tensor):
    """A call of torch._grouped_mm for fc1 and then fc2 alone on `rows` expert-grouped rows
    (counts per local expert), no SwiGLU: the GEMM bound's reference side."""
    H, I = fc1.shape[2], fc2.shape[2]
    x = torch.randn(rows, H, device="cuda").bfloat16()
    h = torch.randn(rows, I, device="cuda").bfloat16()
    offs = torch.tensor(np.cumsum(counts), device="cuda", dtype=torch.int32)
    w1, w2 = fc1.transpose(-2, -1), fc2.transpose(-2, -1)

    def call():
        torch._grouped_mm(x, w1, offs=offs)
        torch._grouped_mm(h, w2, offs=offs)
    return call


def gemms_alone(rows: int, counts: np.ndarray, fc1: torch.Tensor, fc2: torch.Tensor, rank: int, P: int,
                iters: int) -> None:
    """Times :func:`gemms_alone_call` right away (a card that has been idle runs it above the
    clock it holds under load: prefer --bound) and prints the median per rank."""
    H, I = fc1.shape[2], fc2.shape[2]
    call = gemms_alone_call(rows, counts, fc1, fc2)
    for _ in range(3):
        call()
    times = []
    for _ in range(max(iters, 5)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    tf = 6 * rows * H * I / ms / 1e9
    print(f"rank {rank}/{P}: torch._grouped_mm fc1 + fc2 alone, {rows} rows: {ms:.3f} ms ({tf:.0f} TFLOP/s); "
          f"1.15x = {1.15 * ms:.3f} ms", flush=True)


def bound_timing(mk_call, gemms_call, rounds: int, warmup: int, distributed: bool, rank: int, label: str,
                 device: Optional[torch.device] = None, host_lead_ms: float = 0.0,
                 back_to_back: bool = False) -> Tuple[float, float]:
    """The GEMM bound, each side in the power state it holds under its own load: the
    megakernel call and torch._grouped_mm fc1 + fc2 alone on each rank's expert load in blocks
    (`block_rounds`, its default order, after 2 x `warmup` alternating untimed calls: each block
    `warmup` untimed calls, then `rounds` timed ones, each synchronised and timed on the slowest
    rank). Prints both medians, their ratio and the medians per block, and returns the medians
    (ms).

    device: where the calls run (default: the current CUDA device). host_lead_ms > 0: the GPU
    spins that long before each timed call (`hold_stream`), so both sides are timed without the
    host path before their launches, but at the higher clock of a lower duty cycle.
    back_to_back: each block's calls are queued back to back (`back_to_back_rounds`), the card
    loaded without a gap as in a training step."""
    group = dist.group.WORLD if distributed else None
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    times = block_rounds([("megakernel", mk_call), ("torch._grouped_mm", gemms_call)], rounds, group, device,
                         warmup=warmup, preheat=2 * warmup, host_lead_ms=host_lead_ms, back_to_back=back_to_back)
    check_errors()
    mk_ms, mm_ms = statistics.median(times["megakernel"]), statistics.median(times["torch._grouped_mm"])
    mode = ("calls back to back" if back_to_back else
            f"GPU time after a {host_lead_ms:g} ms host lead" if host_lead_ms > 0 else "synchronised calls")
    if rank == 0:
        print(f"{label}: megakernel {mk_ms:.3f} ms, torch._grouped_mm fc1 + fc2 alone {mm_ms:.3f} ms (medians of "
              f"{BLOCK_ORDER.count('A')} x {rounds} calls, blocks {BLOCK_ORDER} after {2 * warmup} alternating "
              f"untimed calls, each block after {warmup} untimed ones, slowest rank, "
              f"{mode}); ratio "
              f"{mk_ms / mm_ms:.3f}x (bound 1.15x); {block_medians(times, rounds)}", flush=True)
    return mk_ms, mm_ms


def block_medians(times: Dict[str, List[float]], rounds: int) -> str:
    """Each variant's median per block, in block order (``rounds`` calls a block): a drift or a
    block that stands out shows here."""
    return "; ".join(f"{name} by block " + " ".join(f"{statistics.median(v[i:i + rounds]):.3f}"
                                                     for i in range(0, len(v), rounds))
                     for name, v in times.items())


def clock_probe(variants, seconds: float, distributed: bool, rank: int, label: str) -> None:
    """Runs each (name, call) variant back to back for `seconds` on every rank while
    `nvidia-smi` samples every GPU's SM clock and power draw every 50 ms, and prints (rank 0) the
    median of each per GPU over the last 80% of the samples: whether a side that takes longer
    under the power cap runs at a lower clock (more energy per call) or at the same clock (more
    cycles per call). Every rank runs the same number of calls (the megakernel couples them)."""
    for name, call in variants:
        if distributed:
            dist.barrier()
        sampler = None
        if rank == 0:
            sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=index,clocks.sm,power.draw",
                                        "--format=csv,noheader,nounits", "-lms", "50"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        end = time.time() + seconds
        calls = 0
        stop = torch.zeros(1, dtype=torch.int32, device="cuda")
        while True:
            for _ in range(16):
                call()
            calls += 16
            torch.cuda.synchronize()
            stop.fill_(int(time.time() > end))
            if distributed:
                dist.broadcast(stop, 0)
            if stop.item():
                break
        if sampler is None:
            continue
        sampler.terminate()
        summary = clock_summary(sampler.communicate()[0])
        print(f"{label} {name}, {calls} calls back to back in {seconds:g} s: " + "; ".join(
            f"GPU {gpu}: SM clock {mhz:.0f} MHz, power {watts:.0f} W ({n} samples)"
            for gpu, (mhz, watts, n) in sorted(summary.items())), flush=True)


def clock_summary(text: str) -> Dict[int, Tuple[float, float, int]]:
    """`nvidia-smi --query-gpu=index,clocks.sm,power.draw --format=csv,noheader,nounits` lines ->
    {GPU index: (median SM clock MHz, median power W, samples kept)} over the last 80% of each
    GPU's samples (the first fifth is the clock settling); lines that do not parse are skipped."""
    per_gpu: Dict[int, List[Tuple[float, float]]] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            per_gpu.setdefault(int(fields[0]), []).append((float(fields[1]), float(fields[2])))
        except (ValueError, IndexError):
            continue
    out = {}
    for gpu, samples in per_gpu.items():
        kept = samples[len(samples) // 5:]
        out[gpu] = (statistics.median(c for c, _ in kept), statistics.median(w for _, w in kept), len(kept))
    return out


def ab_timing(variants, rounds: int, distributed: bool, rank: int, label: str, blocks_warmup: int = 0) -> None:
    """Timing of two (name, call) variants, each call synchronised and timed on the slowest rank.
    By default paired: alternating which goes first in each round, so slow drifts cancel, but
    under the power cap so does a difference in energy per call. With blocks_warmup > 0 in
    blocks (`block_rounds`, its default order) after that many untimed calls each, which keeps
    it."""
    group = dist.group.WORLD if distributed else None
    device = torch.device("cuda", torch.cuda.current_device())
    (na, _), (nb, _) = variants
    if blocks_warmup > 0:
        times = block_rounds(variants, rounds, group, device, warmup=blocks_warmup, preheat=2 * blocks_warmup)
        check_errors()
        if rank == 0:
            a, b = statistics.median(times[na]), statistics.median(times[nb])
            blocks = blocks_by_position(times[na], times[nb], rounds)
            print(f"{label}: {na} {a:.3f} ms, {nb} {b:.3f} ms (medians of {BLOCK_ORDER.count('A')} x {rounds} calls "
                  f"in blocks {BLOCK_ORDER} after {2 * blocks_warmup} alternating untimed calls, each block after "
                  f"{blocks_warmup} untimed ones, slowest rank); {nb} - {na}: {b - a:+.3f} ms, on block medians "
                  f"without the first block {b_minus_a(blocks, skip_first=True):+.3f} ms (correct it for the "
                  f"blocks' positions over several runs: tools/perf/ab_positions.py); "
                  f"{block_medians(times, rounds)}", flush=True)
        return
    times = interleaved_rounds(variants, rounds, group, device)
    check_errors()
    if rank == 0:
        diff = np.array(times[nb]) - np.array(times[na])
        print(f"{label}: {na} {statistics.median(times[na]):.3f} ms, {nb} {statistics.median(times[nb]):.3f} ms "
              f"(median of {rounds}, slowest rank); paired {nb} - {na}: median {np.median(diff):+.3f} ms, "
              f"{na} faster in {int((diff > 0).sum())} of {rounds} rounds", flush=True)


def ab_variants(setting: str, ab: str) -> List[Tuple[str, Candidate]]:
    """``--ab FIELD=A,B`` on ``setting`` -> [(label, candidate)] for A and B: the setting with
    FIELD (a key of :data:`AB_FIELDS`) set to each value, parsed by :meth:`Candidate.parse`
    (so the tune command's rules and messages apply). The same value twice (an A/A run) still
    gets two labels. Raises ValueError naming the bad part."""
    name, eq, values = ab.partition("=")
    parts = values.split(",")
    if not eq or len(parts) != 2:
        raise ValueError(f"--ab {ab!r} must be FIELD=A,B with FIELD one of {', '.join(AB_FIELDS)}")
    if name not in AB_FIELDS:
        raise ValueError(f"--ab {ab!r}: unknown field {name!r}; one of {', '.join(AB_FIELDS)}")
    position = SETTING_POSITION[AB_FIELDS[name]]
    base = setting.split(":")
    base += [""] * (5 - len(base))
    out = []
    for value in parts:
        fields = list(base)
        fields[position] = value
        out.append((f"{name}={value}", Candidate.parse(":".join(fields))))
    if out[0][0] == out[1][0]:
        out = [(f"{label} ({letter})", cand) for (label, cand), letter in zip(out, "AB")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=6, help="experts per GPU")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform",
                    help="uniform (default), or a skewed routing of the layer benchmark")
    ap.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of --routing zipf")
    ap.add_argument("--hot-fraction", type=float, default=1.0, help="share of tokens picking expert 0 (--routing hot)")
    ap.add_argument("--settings", nargs="+", default=["::"],
                    help="comm:minibatch:ring[:pairs[:group_blocks]] (empty fields: the default)")
    ap.add_argument("--iters", type=int, default=5, help="timed untraced calls per setting (median shown)")
    ap.add_argument("--out", default=None, help="write the rank-0 chart (and with --npz every rank's records) here")
    ap.add_argument("--npz", action="store_true", help="also save the raw records")
    ap.add_argument("--milestones", action="store_true", help="print the minibatch milestones")
    ap.add_argument("--gemms-alone", action="store_true",
                    help="also time torch._grouped_mm fc1 + fc2 alone on the rank's expert load (the GEMM bound's "
                         "reference side)")
    ap.add_argument("--ab", default=None, metavar="FIELD=A,B",
                    help=f"timing of the setting with one tunable set to A and to B instead of the timeline "
                         f"(FIELD: {', '.join(AB_FIELDS)}; e.g. group_blocks=8,16 or pairs=on,off)")
    ap.add_argument("--ab-settings", nargs=2, default=None, metavar="SETTING",
                    help="timing of two settings instead of the timeline")
    ap.add_argument("--bound", action="store_true",
                    help="instead of the timeline, time the GEMM bound: blocks of megakernel calls and of "
                         "torch._grouped_mm alone (A B B A B A A B), each after --block-warmup untimed calls")
    ap.add_argument("--blocks", action="store_true",
                    help="--ab / --ab-settings in blocks A B B A B A A B, each after --block-warmup untimed calls, "
                         "instead of call by call (keeps a difference in energy per call under the power cap)")
    ap.add_argument("--block-warmup", type=int, default=100, help="untimed calls before each block")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of --ab, --ab-settings and --bound")
    ap.add_argument("--back-to-back", action="store_true",
                    help="--bound: queue each block's calls back to back (steady state, the host ahead of the GPU, "
                         "as in training) instead of synchronising each call")
    ap.add_argument("--host-lead", type=float, default=0.0, metavar="MS",
                    help="--bound: the GPU spins MS before each timed call, so the host queues the call "
                         "meanwhile and its path is not timed; the spin lowers the duty cycle, so the clock "
                         "runs higher than in steady state (prefer --back-to-back) (default 0: synchronised "
                         "calls, the host path to the launches included)")
    ap.add_argument("--clocks", type=float, default=0.0, metavar="SECONDS",
                    help="--bound: afterwards run each side back to back for SECONDS while nvidia-smi samples "
                         "the SM clock and power draw, and print their medians per GPU")
    ap.add_argument("--training", action="store_true",
                    help="forward with grad: the launch also writes the activations the backward reads")
    args = ap.parse_args()
    if args.clocks and not args.bound:
        ap.error("--clocks runs after the bound: add --bound")
    if (args.back_to_back or args.host_lead) and not args.bound:
        ap.error("--back-to-back and --host-lead time the bound only: add --bound")
    if args.back_to_back and args.host_lead:
        ap.error("--back-to-back and --host-lead both keep the host path out of the time: choose one")
    if args.ab and args.ab_settings:
        ap.error("--ab and --ab-settings: choose one")
    try:  # every setting and A/B pair parses before any GPU work
        settings = [(text, Candidate.parse(text)) for text in args.settings]
        ab = [ab_variants(text, args.ab) for text in args.settings] if args.ab else None
        ab_settings = [(text, Candidate.parse(text)) for text in args.ab_settings] if args.ab_settings else None
    except ValueError as err:
        ap.error(str(err))

    from megatron_mok.functional.megakernel_backend import trace_launches
    from megatron_mok.ops import megakernel as mk_ops

    consts = mk_ops.constants()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl")
        rank, P = dist.get_rank(), dist.get_world_size()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        rank, P = 0, 1
    T, H, I, K, L = args.tokens, args.hidden, args.ffn, args.topk, args.experts
    E = P * L
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    # Contiguous ids, as a router's top-k gives them (a strided view would add a copy of them to
    # every timed call, ~0.1 ms of host time).
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K].contiguous() if E >= K else \
        torch.randint(0, E, (T, K), device="cuda", generator=g)
    w = torch.rand(T, K, device="cuda", generator=g)
    if args.routing != "uniform":  # the layer benchmark's skewed routings (megatron_mok.bench.routing)
        ids, w = make_routing(RoutingSpec(args.routing, zipf_s=args.zipf_s, hot_fraction=args.hot_fraction),
                              T, E, K, seed=4321 + rank, device=torch.device("cuda"))
    fc1 = (torch.randn(L, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(L, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    if args.training:  # the outputs' graphs (and saved activations) are dropped call by call
        x.requires_grad_(True)
    group = dist.group.WORLD if distributed else None
    flop = 6 * T * K * H * I
    base = MoKConfig(max_tokens_per_rank=T)

    def megakernel_call(cand: Candidate):
        cfg = cand.config(base)
        return lambda: mok_moe(x, ids, w, fc1, fc2, ep_group=group, config=cfg, backend="megakernel")

    if ab_settings:
        with torch.set_grad_enabled(args.training):
            ab_timing([(text, megakernel_call(cand)) for text, cand in ab_settings], args.rounds, distributed,
                      rank, f"L={L} settings", args.block_warmup if args.blocks else 0)
        if distributed:
            dist.destroy_process_group()
        return
    if ab:
        with torch.set_grad_enabled(args.training):
            for (text, _), variants in zip(settings, ab):
                ab_timing([(label, megakernel_call(cand)) for label, cand in variants], args.rounds, distributed,
                          rank, f"L={L} {text}", args.block_warmup if args.blocks else 0)
        if distributed:
            dist.destroy_process_group()
        return
    all_ids = [torch.empty(ids.shape, dtype=ids.dtype, device=ids.device) for _ in range(P)] if distributed else [ids]
    if distributed:
        dist.all_gather(all_ids, ids.contiguous())
    routed = torch.cat([i.reshape(-1) for i in all_ids])
    local = routed[(routed >= rank * L) & (routed < (rank + 1) * L)] - rank * L
    counts = torch.bincount(local, minlength=L).cpu().numpy()
    by_source = []  # rows each source rank routes to each local expert
    for src_ids in all_ids:
        flat = src_ids.reshape(-1)
        mine = flat[(flat >= rank * L) & (flat < (rank + 1) * L)] - rank * L
        by_source.append(torch.bincount(mine, minlength=L).cpu().numpy())
    counts_by_source = np.stack(by_source)
    if args.bound:
        text, cand = settings[0]
        call = megakernel_call(cand)
        with torch.set_grad_enabled(args.training):
            bound_timing(call, gemms_alone_call(int(counts.sum()), counts, fc1, fc2), args.rounds, args.block_warmup,
                         distributed, rank, f"L={L} {text}{' training' if args.training else ''}"
                         f"{'' if args.routing == 'uniform' else ' routing ' + args.routing}",
                         host_lead_ms=args.host_lead, back_to_back=args.back_to_back)
            if args.clocks > 0:
                clock_probe([("megakernel", call),
                             ("torch._grouped_mm", gemms_alone_call(int(counts.sum()), counts, fc1, fc2))],
                            args.clocks, distributed, rank, f"L={L}")
        if distributed:
            dist.destroy_process_group()
        return
    if args.gemms_alone:
        gemms_alone(int(counts.sum()), counts, fc1, fc2, rank, P, args.iters)
    block_rows = consts.block_rows
    for text, cand in settings:
        call = megakernel_call(cand)
        with torch.set_grad_enabled(args.training):
            for _ in range(2):
                call()
            times = []
            for _ in range(args.iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                call()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            # Back to back, no host sync: the device time per call once the host runs ahead
            # (as in training), and the host's own time per call.
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if distributed:
                dist.barrier()
            torch.cuda.synchronize()
            h0 = time.perf_counter()
            a.record()
            for _ in range(args.iters):
                call()
            b.record()
            host_ms = (time.perf_counter() - h0) * 1e3 / args.iters
            torch.cuda.synchronize()
            stream_ms = a.elapsed_time(b) / args.iters
            with trace_launches() as launches:
                call()
            torch.cuda.synchronize()
            check_errors()
        tr = launches[-1]
        records = tr["records"].cpu().numpy()
        items, ctas = decode(records, consts.trace_cta_kind)
        ms = statistics.median(times)
        grid, pairs = mk_ops.launch_shape(tr["comm_ctas"], tr["num_ctas"], tr["pairs"])
        label = (f"rank {rank}/{P} L={L} T={T} H={H} I={I} K={K} ctas={grid}{' in pairs' if pairs else ''} "
                 f"comm={tr['comm_ctas']} mb={tr['minibatch_rows']} ring={tr['ring_rows']} "
                 f"group={tr['group_blocks']}{' training' if args.training else ''}: {ms:.3f} ms untraced "
                 f"({flop / ms / 1e9:.0f} TFLOP/s); back to back {stream_ms:.3f} ms/call, host {host_ms:.3f} ms/call")
        n_blocks = int(((counts + block_rows - 1) // block_rows).sum())
        # The trace names blocks by their queue order; the rows they hold are the layout's.
        order = np.array(mk_ops.layout_blocks(counts.tolist()), dtype=np.int64)
        lines = summarize(items, ctas, H=H, I=I, mb_rows=tr["minibatch_rows"], label=label, consts=consts,
                          real_rows=block_real_rows(counts, n_blocks, block_rows)[order], pairs=pairs,
                          remote_rows=(block_remote_rows(counts_by_source, rank, n_blocks, block_rows)[order]
                                       if P > 1 else None),
                          experts=block_experts(counts, block_rows))
        if not args.milestones:
            lines = [line for line in lines if not line.startswith("  mb ") and "minibatches of" not in line]
        if distributed:
            gathered = [None] * P
            dist.all_gather_object(gathered, lines)
            if rank == 0:
                print("\n".join(line for rank_lines in gathered for line in rank_lines), flush=True)
        else:
            print("\n".join(lines), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            name = (f"mk-L{L}-c{tr['comm_ctas']}-mb{tr['minibatch_rows']}-r{tr['ring_rows']}-g{tr['group_blocks']}"
                    f"-p{P}-r{rank}")
            if args.npz:
                np.savez_compressed(os.path.join(args.out, name + ".npz"), records=records)
            if rank == 0:
                chart(items, ctas, os.path.join(args.out, name + ".png"), label)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
