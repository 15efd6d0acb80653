"""``python -m megatron_mok.bench layer``: one MoE layer, every available backend, side by side.

Start it with torchrun, one process per GPU (the EP group is all of them):

    torchrun --nproc-per-node 2 -m megatron_mok.bench layer --shape kimi-k2 deepseek-v3 \\
        --tokens 4096 --experts-per-gpu full 6 --out bench-results

Method, per shape and expert count: random tokens, weights and routing; each backend's output
and gradients are first checked against the reference backend on the first ``--check-tokens``
tokens of every rank with the case's weights (or, where the reference's float32 copies of those
would not fit in GPU memory, on up to 16 experts per GPU with the same H, I and K:
``--check-mode``); then ``--warmup`` untimed and ``--iters`` timed iterations, each forward and
backward timed separately with CUDA events after the ranks meet; the figure is the median over
iterations of the slowest rank. TFLOP/s = 6*T*K*H*I / latency (backward: twice the FLOP).
On a GPU, one more untimed forward + backward per backend, after the timed ones, measures its
activation memory (:func:`measure_memory`), shown next to the routed-rows need: the bytes the
training ring would keep for the rows each rank really computes (:func:`routed_rows_need`).
With ``--main-grad`` the expert weight gradients go into fp32 ``main_grad`` buffers laid out as
Megatron's DDP lays them out, as under gradient-accumulation fusion: MoK accumulates inside its
weight-gradient kernel; the other backends' timed backward includes DDP's ``main_grad += grad``.
Megatron's own layer runs with the expert module Megatron users run (``--megatron-experts``:
TEGroupedMLP where Transformer Engine is installed, else SequentialMLP); the table names it.

Rank 0 prints a progress line for each case, backend and phase (build, check, warm-up and
timed iterations) and a heartbeat every ``--heartbeat-s`` seconds of silence.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import traceback
from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..config import training_ring_bytes
from . import report
from .backends import (BACKENDS, Experts, Runner, Skip, TokenBatch, main_grad_buffers, make_runner,
                       parse_backends)
from .check import DEFAULT_TOL, CheckResult, Outcome, compare, run_once
from .floors import H200, layer_floors, model_flops, rates_with, tflops
from .machine import Dist, command_line, device_type, init_distributed, machine_info, set_safe_env, utc_now
from .megatron_layer import EXPERT_MODULES
from .progress import Progress
from .routing import ROUTINGS, RoutingSpec, count_routes, make_routing
from .shapes import SHAPES, BenchCase, ShapeError, make_case, resolve_shape
from .timing import Stopwatch, align_ranks, gather_floats, slowest_rank_medians

SCHEMA = "megatron-mok/bench-layer/1"
DTYPE = torch.bfloat16
PHASES = ("dispatch", "experts", "combine")
MIB = 2 ** 20


class WrongResult(RuntimeError):
    """A backend's result differs from the reference's beyond the tolerance."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mok.bench layer",
        description="Time one MoE layer (dispatch, expert FFN, combine; forward and backward) "
                    "with every available backend. Start with torchrun, one process per GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["kimi-k2", "deepseek-v3"],
                   help=f"model shapes: {', '.join(SHAPES)}, or custom (with --hidden, "
                        "--ffn-hidden, --num-experts, --topk)")
    p.add_argument("--hidden", type=int, help="H (custom shape, or override)")
    p.add_argument("--ffn-hidden", type=int, help="I, the expert FFN size (custom shape, or override)")
    p.add_argument("--num-experts", type=int, help="E, the model's routed experts (custom shape, or override)")
    p.add_argument("--topk", type=int, help="K, experts per token (custom shape, or override)")
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens per GPU")
    p.add_argument("--experts-per-gpu", nargs="+", default=["full"],
                   help="experts held by each GPU, one run each: 'full' (the model's E / P), a "
                        "number (6 per GPU is Kimi-K2's load at EP=64), or 'ep=N' (E / N: the "
                        "per-GPU load of the model on N GPUs, e.g. ep=2 on one GPU)")
    p.add_argument("--training-ring-rows", type=int, default=None,
                   help="MoK's MoKConfig.training_ring_rows (rows whose activations a forward keeps; the "
                        "backward replays the rest); default: its rule")
    p.add_argument("--tile-rows", type=int, choices=(128, 64), default=128,
                   help="MoK's MoKConfig.tile_rows (the expert segments' padding); the megakernel takes only "
                        "128 and is skipped with its reason at 64")
    p.add_argument("--main-grad", action="store_true",
                   help="the expert weight gradients go into fp32 main_grad buffers, as under Megatron's DDP "
                        "with gradient-accumulation fusion: MoK's backends accumulate in their weight-gradient "
                        "kernel; the others return bf16 and the timed backward includes DDP's main_grad += grad "
                        "per expert weight; the backward floor counts main_grad read and written in fp32")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform", help="how tokens pick experts")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent for --routing zipf")
    p.add_argument("--hot-fraction", type=float, default=1.0,
                   help="fraction of tokens that pick the hot expert 0, for --routing hot")
    p.add_argument("--backends", default="all",
                   help="'all' or a comma-separated list of: " + ", ".join(BACKENDS))
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed iterations per backend (enough for the card to reach the power state it "
                        "holds under that backend's load: an H200 at its 700 W cap runs the first calls "
                        "after idle at a higher clock)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per backend")
    p.add_argument("--check-tokens", type=int, default=256,
                   help="tokens per GPU of the correctness check against the reference (0: no check)")
    p.add_argument("--check-mode", choices=("auto", "token-slice", "reduced-experts"), default="auto",
                   help="token-slice: the case's weights and its first --check-tokens tokens; "
                        "reduced-experts: up to 16 experts per GPU, same H, I, K; auto: token-slice "
                        "when the reference's float32 copies of the weights fit in device memory")
    p.add_argument("--tol", type=float, default=None,
                   help=f"accepted relative error of the check (default {DEFAULT_TOL[DTYPE]:g} for bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--gemm-tflops", type=float, help=f"dense GEMM rate for the floors (default {H200.gemm_tflops:g})")
    p.add_argument("--hbm-gbps", type=float, help=f"HBM bandwidth for the floors (default {H200.hbm_gbps:g})")
    p.add_argument("--peer-gbps", type=float, help=f"NVLink per-direction bandwidth for the floors (default {H200.peer_gbps:g})")
    p.add_argument("--out", default="bench-results", help="folder for NAME.json, NAME.png, NAME.md")
    p.add_argument("--name", default="layer", help="file name stem of the outputs")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="seconds a collective waits for a peer before failing")
    p.add_argument("--megatron-experts", choices=EXPERT_MODULES, default="auto",
                   help="expert module of the megatron-* backends: auto (TEGroupedMLP where Transformer Engine "
                        "is installed, else SequentialMLP), te-grouped or sequential")
    p.add_argument("--heartbeat-s", type=float, default=30.0,
                   help="print a 'still ...' line after this many seconds without progress (0: never)")
    return p


ExpertsPerGpu = Union[None, int, Tuple[str, int]]
"""None: the model's E / P; an int: that many experts per GPU; ("ep", N): E / N, the per-GPU
load of the model on N GPUs."""


def parse_experts_per_gpu(values: Sequence[str]) -> List[ExpertsPerGpu]:
    """``--experts-per-gpu`` values ('full', 'N', 'ep=N') in order, without repeats."""
    out: List[ExpertsPerGpu] = []
    for v in values:
        item: ExpertsPerGpu
        try:
            if v == "full":
                item = None
            elif v.startswith("ep="):
                item = ("ep", int(v[3:]))
                if item[1] < 1:
                    raise ValueError
            else:
                item = int(v)
                if item < 1:
                    raise ValueError
        except ValueError:
            raise ShapeError(f"--experts-per-gpu {v!r} must be 'full', a positive integer, or "
                             "'ep=N' (the model's experts divided by N)") from None
        if item not in out:
            out.append(item)
    return out


def experts_per_gpu_for(shape, item: ExpertsPerGpu) -> Optional[int]:
    """Resolve one ``--experts-per-gpu`` item for ``shape`` (None stays "full")."""
    if isinstance(item, tuple):
        n = item[1]
        if shape.num_experts % n:
            raise ShapeError(f"--experts-per-gpu ep={n}: {shape.name}'s {shape.num_experts} "
                             f"experts do not split into {n} equal parts")
        return shape.num_experts // n
    return item


def check_args(args: argparse.Namespace) -> None:
    """Reject bad values with a message that names them, before any work."""
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup} must be >= 0")
    if args.iters < 1:
        raise ValueError(f"--iters {args.iters} must be >= 1")
    if args.check_tokens < 0:
        raise ValueError(f"--check-tokens {args.check_tokens} must be >= 0")
    if args.tol is not None and not args.tol > 0:
        raise ValueError(f"--tol {args.tol} must be positive")


def random_weights(experts: int, hidden: int, ffn: int, *, seed: int, device: torch.device):
    """fc1 [L, 2I, H] and fc2 [L, H, I] bf16, N(0, 1/H) and N(0, 1/I) so activations stay O(1);
    leaves that require grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    fc1 = torch.randn(experts, 2 * ffn, hidden, generator=gen, device=device, dtype=DTYPE)
    fc1.mul_(hidden ** -0.5)
    fc2 = torch.randn(experts, hidden, ffn, generator=gen, device=device, dtype=DTYPE)
    fc2.mul_(ffn ** -0.5)
    return fc1.requires_grad_(), fc2.requires_grad_()


def make_batch(case: BenchCase, routing: RoutingSpec, *, seed: int, device: torch.device) -> TokenBatch:
    """This rank's tokens, routing and upstream gradient (seeded per rank)."""
    shape = case.shape
    ids, weights = make_routing(routing, case.tokens_per_gpu, case.num_experts, shape.topk,
                                seed=seed, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(case.tokens_per_gpu, shape.hidden, generator=gen, device=device, dtype=DTYPE)
    dy = torch.randn(case.tokens_per_gpu, shape.hidden, generator=gen, device=device, dtype=DTYPE)
    return TokenBatch(x=x.requires_grad_(), topk_ids=ids, topk_weights=weights.requires_grad_(), dy=dy)


def time_backend(runner, batch: TokenBatch, *, warmup: int, iters: int, env: Dist,
                 progress: Optional[Progress] = None) -> Dict[str, Dict[str, object]]:
    """Warm-up, then ``iters`` timed iterations of forward and backward (each reported to
    ``progress``).

    Returns:
        {quantity: {"ms", "per_rank_ms"}} for "forward", "backward" and, for backends that
        mark them, the forward phases "phase:dispatch", "phase:experts", "phase:combine".
    """
    watches = []
    for it in range(warmup + iters):
        runner.zero_grad(batch)
        align_ranks(env.group, env.device)
        sw = Stopwatch(env.device)
        with runner.context():
            sw.mark("start")
            y = runner.forward(batch, mark=lambda name, sw=sw: sw.mark("phase:" + name))
            sw.mark("forward")
            y.backward(batch.dy)
            runner.after_backward(batch)
            sw.mark("backward")
            del y
        if it >= warmup:
            watches.append(sw)
        if progress is not None:
            if it < warmup:
                progress.iteration(it + 1, warmup, "warm-up iteration")
            else:
                progress.iteration(it + 1 - warmup, iters, "timed iteration")
    runner.zero_grad(batch)
    samples: Dict[str, List[float]] = {"forward": [], "backward": []}
    for sw in watches:
        samples["forward"].append(sw.ms("start", "forward"))
        samples["backward"].append(sw.ms("forward", "backward"))
        if "phase:end" in sw.points:
            bounds = [f"phase:{p}" for p in PHASES] + ["phase:end"]
            for p, a, b in zip(PHASES, bounds, bounds[1:]):
                samples.setdefault(f"phase:{p}", []).append(sw.ms(a, b))
    return slowest_rank_medians(samples, env.group, env.device)


class MemoryProbe:
    """The allocator figures :func:`measure_memory` reads: PyTorch's CUDA caching allocator on
    ``device`` (bytes held by live tensors; blocks cached but free are not counted)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        """Start a new peak at what is allocated now."""
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        """Bytes allocated now."""
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        """Most bytes allocated at once since :meth:`reset_peak`."""
        return int(torch.cuda.max_memory_allocated(self.device))

    def synchronize(self) -> None:
        """Wait for the device's queued work (frees are recorded when the host issues them,
        so this only makes the figures follow a finished backward)."""
        torch.cuda.synchronize(self.device)

    def start_events(self) -> None:
        """Record every allocation and free from now on (the allocator's history, no stacks)."""
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", device=self.device,
                                                 clear_history=True)

    def stop_events(self) -> List[Tuple[str, int, int]]:
        """Stop recording; the ("alloc" or "free", address, bytes) of every allocation and free
        since :meth:`start_events`, in order."""
        snapshot = torch.cuda.memory._snapshot(self.device)
        torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        kinds = {"alloc": "alloc", "free_completed": "free"}
        return [(kinds[e["action"]], int(e["addr"]), int(e["size"]))
                for e in snapshot["device_traces"][index] if e["action"] in kinds]


def _storages(tensors: Sequence[torch.Tensor]) -> Dict[int, int]:
    """{storage address: storage bytes} of ``tensors``, each storage once (a gradient that is
    a view of a larger buffer keeps all of it allocated)."""
    out: Dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def working_peak(events: Sequence[Tuple[str, int, int]], returned: AbstractSet[int]) -> int:
    """Most bytes allocated at once over ``events`` (("alloc" or "free", address, bytes), in
    order, from a point where the count starts at 0), not counting, from its allocation on, the
    last allocation at each address in ``returned`` (the gradients the call hands back, alive at
    its end). So a gradient allocated after the call's working buffers were freed (a placeholder
    at the end of a backward) does not hide them, and one allocated before them is not counted
    in their peak."""
    last = {}
    for i, (kind, addr, _) in enumerate(events):
        if kind == "alloc" and addr in returned:
            last[addr] = i
    live = kept = best = 0
    for i, (kind, addr, size) in enumerate(events):
        if kind == "alloc":
            live += size
            if last.get(addr) == i:
                kept += size
        else:
            live -= size
        best = max(best, live - kept)
    return best


def measure_memory(runner: Runner, batch: TokenBatch, probe: MemoryProbe) -> Dict[str, int]:
    """Activation memory of one forward + backward of ``runner`` on ``batch``, on this rank.

    From zeroed gradients: the allocator's peak is reset, ``before`` = bytes allocated, every
    allocation and free recorded, then one forward and its backward (``y.backward(dy)``), then

    * ``peak_bytes`` = peak allocated during them - ``before``: everything the call allocated
      at its high point, the output y and the gradients the backward returns included;
    * ``grad_bytes`` = bytes of the gradient tensors the backward left on the inputs and the
      expert weights (:meth:`Runner.grad_tensors`: dx, d router weights, d fc1, d fc2, each
      storage once) that did not exist before the forward;
    * ``activation_bytes`` = the most bytes the call held at once besides those gradients
      (:func:`working_peak` of the recorded events): what the layer itself needs at its high
      point (saved activations, workspaces it allocates per call, the backward's operands, the
      output), which is what training keeps or recomputes, layer after layer. Where the
      gradients live through the high point this is ``peak_bytes`` - ``grad_bytes``; where they
      are allocated after it (``main_grad`` placeholders), the difference would hide it.

    Persistent state allocated by earlier calls (communication workspaces, caches) is in
    ``before``, so it is not counted. Untimed; not a collective (call it on every rank, after
    the ranks have met). Leaves the gradients zeroed.

    Returns:
        {"peak_bytes", "grad_bytes", "activation_bytes"}: bytes (int).
    """
    runner.zero_grad(batch)
    existing = _storages(runner.grad_tensors(batch))
    probe.synchronize()
    probe.reset_peak()
    before = probe.allocated()
    probe.start_events()
    try:
        with runner.context():
            y = runner.forward(batch)
            y.backward(batch.dy)
            del y
        probe.synchronize()
    finally:
        events = probe.stop_events()
    peak = probe.peak() - before
    returned = {ptr: n for ptr, n in _storages(runner.grad_tensors(batch)).items() if ptr not in existing}
    runner.zero_grad(batch)
    return {"peak_bytes": peak, "grad_bytes": sum(returned.values()),
            "activation_bytes": working_peak(events, set(returned))}


def memory_result(mine: Dict[str, int], need_bytes: Sequence[int], env: Dist) -> Dict[str, object]:
    """The JSON fields of a backend's memory figures: this rank's :func:`measure_memory`
    gathered from every rank, in MiB.

    Args:
        mine: this rank's {"peak_bytes", "grad_bytes", "activation_bytes"}.
        need_bytes: the routed-rows need of every rank, bytes (:func:`routed_rows_need`).

    Returns:
        {"peak_mib", "grads_mib", "activation_mib": the largest rank's, MiB;
        "activation_per_rank_mib": each rank's; "activation_vs_need": the largest ratio over
        the ranks with a nonzero need of their activation memory to their routed-rows need
        (None if no rank has one)}.
    """
    keys = ("peak_bytes", "grad_bytes", "activation_bytes")
    per_rank = gather_floats([float(mine[k]) for k in keys], env.group, env.device)
    column = {k: [r[i] / MIB for r in per_rank] for i, k in enumerate(keys)}
    ratios = [a * MIB / n for a, n in zip(column["activation_bytes"], need_bytes) if n > 0]
    return {
        "peak_mib": max(column["peak_bytes"]),
        "grads_mib": max(column["grad_bytes"]),
        "activation_mib": max(column["activation_bytes"]),
        "activation_per_rank_mib": column["activation_bytes"],
        "activation_vs_need": max(ratios) if ratios else None,
    }


def routed_rows_need(received: Sequence[int], hidden: int, ffn_hidden: int) -> Dict[str, object]:
    """The routed-rows need of a case: for each rank, the rows its experts really compute
    (``received``, from the generated routing) times the bytes the training ring keeps per row
    (``training_ring_bytes(1, H, I)``: x bf16, router weight fp32, gate|up bf16).

    Returns:
        {"bytes_per_row", "rows_per_rank", "bytes_per_rank", "mib": the largest rank's, MiB}.
    """
    per_row = training_ring_bytes(1, hidden, ffn_hidden)
    per_rank = [int(r) * per_row for r in received]
    return {"bytes_per_row": per_row, "rows_per_rank": [int(r) for r in received],
            "bytes_per_rank": per_rank, "mib": max(per_rank) / MIB if per_rank else 0.0}


def _agree(result: Dict[str, object], env: Dist) -> Dict[str, object]:
    """Make every rank report the same status: the worst of all ranks, with its reason."""
    if env.group is None:
        return result
    order = {"ok": 0, "skipped": 1, "wrong": 2, "failed": 3}
    mine = (order[result["status"]], result.get("reason", ""))
    everyone: List = [None] * env.world
    dist.all_gather_object(everyone, mine, group=env.group)
    worst = max(everyone, key=lambda s: s[0])
    if worst[0] != mine[0]:
        status = {v: k for k, v in order.items()}[worst[0]]
        return {"backend": result["backend"], "description": result["description"],
                "status": status, "reason": f"{worst[1]} (on another rank)"}
    return result


@dataclass
class CheckPlan:
    """How backends are checked against the reference on one case.

    Attributes:
        mode: "token-slice" (the case's own weights, the first tokens of every rank) or
            "reduced-experts" (fewer experts per GPU, same H, I, K; used when the reference's
            float32 copies of the full weights would not fit in device memory).
        batch: the tokens checked; experts: the weights checked.
        oracle: the reference backend's outcome on them.
    """

    mode: str
    batch: TokenBatch
    experts: Experts
    oracle: Outcome

    def to_json(self) -> Dict[str, object]:
        return {"mode": self.mode, "tokens_per_gpu": int(self.batch.x.shape[0]),
                "experts_per_gpu": int(self.experts.fc1_weight.shape[0])}


REFERENCE_MEMORY_FACTOR = 5.5
"""The reference backend's extra device memory for a check, in multiples of the bf16 expert
weights: float32 copies of the weights (2x) and of their gradients (2x), bf16 gradients (1x),
and slack."""


def plan_check(case: BenchCase, routing: RoutingSpec, experts: Experts, batch: TokenBatch,
               args, env: Dist, seed: int, progress: Optional[Progress] = None) -> CheckPlan:
    """Choose the check (token slice if the reference fits in memory on every rank, else a
    reduced expert count) and run the reference on it."""
    shape = case.shape
    tokens = min(args.check_tokens, case.tokens_per_gpu)
    weight_bytes = (experts.fc1_weight.numel() + experts.fc2_weight.numel()) * experts.fc1_weight.element_size()
    fits = args.check_mode != "reduced-experts"
    if args.check_mode == "auto" and env.device.type == "cuda":
        free = torch.cuda.mem_get_info(env.device)[0]
        fits = min(r[0] for r in gather_floats([free - REFERENCE_MEMORY_FACTOR * weight_bytes - 4e9],
                                                env.group, env.device)) > 0
    if fits:
        check_batch, check_experts, mode = batch.head(tokens), experts, "token-slice"
    else:
        few = max(-(-shape.topk // case.ep_size), min(case.experts_per_gpu, 16))
        small = BenchCase(shape=shape, ep_size=case.ep_size, experts_per_gpu=few, tokens_per_gpu=tokens)
        check_batch = make_batch(small, routing, seed=seed + 101, device=env.device)
        fc1, fc2 = random_weights(few, shape.hidden, shape.ffn_hidden, seed=seed + 103, device=env.device)
        check_experts = Experts(fc1_weight=fc1, fc2_weight=fc2, num_experts=small.num_experts, group=env.group)
        mode = "reduced-experts"
    if progress is not None:
        progress.phase(f"reference (the oracle) on {check_batch.x.shape[0]} tokens/GPU, "
                       f"{check_experts.fc1_weight.shape[0]} experts/GPU ({mode})")
    with _bf16_grads(check_experts):
        oracle = run_once(make_runner("reference", check_experts, shape.topk, case.tokens_per_gpu), check_batch)
    return CheckPlan(mode=mode, batch=check_batch, experts=check_experts, oracle=oracle)


def check_backend(name: str, runner, plan: CheckPlan, args, env: Dist, case: BenchCase) -> CheckResult:
    """Run backend ``name`` on the plan's batch and compare with the reference's outcome."""
    own = plan.experts is runner.experts
    check_runner = runner if own else make_runner(name, plan.experts, case.shape.topk, case.tokens_per_gpu,
                                                  args.megatron_experts, args.training_ring_rows, args.tile_rows)
    try:
        with _bf16_grads(plan.experts):
            got = run_once(check_runner, plan.batch)
        return compare(got, plan.oracle, tokens=int(plan.batch.x.shape[0]),
                       tol=args.tol or DEFAULT_TOL[DTYPE], group=env.group, device=env.device)
    finally:
        if not own:
            check_runner.close()


@contextlib.contextmanager
def _bf16_grads(experts: Experts):
    """The checks compare the gradients the backends return: ``--main-grad`` off meanwhile."""
    mains, experts.main_grads = experts.main_grads, None
    try:
        yield
    finally:
        experts.main_grads = mains


def run_backend(name: str, case: BenchCase, batch: TokenBatch, experts: Experts,
                plan: Optional[CheckPlan], floors, args, env: Dist,
                progress: Optional[Progress] = None,
                need: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """Check, then time, then (on a GPU) measure the activation memory of one backend on one
    case (``need``: the case's :func:`routed_rows_need`). Never raises for a backend's own
    failure: the result says "skipped", "wrong" or "failed" with the reason."""
    shape = case.shape
    result: Dict[str, object] = {"backend": name, "description": BACKENDS[name]}
    runner = None
    progress = progress or Progress("layer", enabled=False)
    try:
        progress.phase("preparing (building the layer, copying the weights)")
        runner = make_runner(name, experts, shape.topk, case.tokens_per_gpu, args.megatron_experts,
                             args.training_ring_rows, args.tile_rows)
        if getattr(runner, "expert_module", None):
            result["expert_module"] = runner.expert_module
            progress.line(f"experts: {runner.expert_module}")
        if name == "reference":
            result["check"] = {"oracle": True, "passed": True}
        elif plan is not None:
            progress.phase(f"checking against the reference on {plan.batch.x.shape[0]} tokens/GPU")
            check = check_backend(name, runner, plan, args, env, case)
            result["check"] = {**plan.to_json(), **check.to_json()}
            if not check.passed:
                raise WrongResult(f"differs from the reference ({check.describe()}; tol {check.tol:g})")
        progress.phase(f"{args.warmup} warm-up and {args.iters} timed iterations")
        stats = time_backend(runner, batch, warmup=args.warmup, iters=args.iters, env=env, progress=progress)
        flop = model_flops(case.tokens_per_gpu, shape.topk, shape.hidden, shape.ffn_hidden)
        fwd, bwd = stats["forward"]["ms"], stats["backward"]["ms"]
        result.update({
            "status": "ok",
            "forward_ms": fwd, "backward_ms": bwd,
            "forward_per_rank_ms": stats["forward"]["per_rank_ms"],
            "backward_per_rank_ms": stats["backward"]["per_rank_ms"],
            "forward_tflops": tflops(flop, fwd), "backward_tflops": tflops(2 * flop, bwd),
            "forward_vs_floor": fwd / floors["forward"].floor_ms,
            "backward_vs_floor": bwd / floors["backward"].floor_ms,
        })
        comm = {p: (floors[p].nvlink_bytes / (ms * 1e-3) / 1e9 if floors[p].nvlink_bytes else None)
                for p, ms in (("forward", fwd), ("backward", bwd))}
        result["comm_GBps"] = comm
        if env.device.type == "cuda":
            progress.phase("one untimed iteration for the activation memory")
            align_ranks(env.group, env.device)
            mine = measure_memory(runner, batch, MemoryProbe(env.device))
            result.update(memory_result(mine, need["bytes_per_rank"] if need else [], env))
        phases = {p: stats[f"phase:{p}"]["ms"] for p in PHASES if f"phase:{p}" in stats}
        if phases:
            result["forward_phases_ms"] = phases
            one_way = floors["forward"].dispatch_bytes
            if one_way:
                result["dispatch_GBps"] = one_way / (phases["dispatch"] * 1e-3) / 1e9
                result["combine_GBps"] = one_way / (phases["combine"] * 1e-3) / 1e9
    except Skip as err:
        result.update(status="skipped", reason=str(err))
    except WrongResult as err:
        result.update(status="wrong", reason=str(err))
    except Exception as err:  # a backend's failure is a result, not the end of the benchmark
        result.update(status="failed", reason=f"{type(err).__name__}: {err}")
        print(f"[rank {env.rank}] backend {name} failed:\n{traceback.format_exc()}", file=sys.stderr)
    finally:
        if runner is not None:
            runner.close()
        runner = None
        gc.collect()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    result = _agree(result, env)
    if result["status"] == "ok":
        memory = (f", activation memory {result['activation_mib']:.0f} MiB"
                  if result.get("activation_mib") is not None else "")
        progress.line(f"done: forward {result['forward_ms']:.2f} ms, backward {result['backward_ms']:.2f} ms"
                      + memory)
    else:
        progress.line(f"{result['status']}: {str(result.get('reason', '')).splitlines()[0] if result.get('reason') else ''}")
    return result


def run_case(case: BenchCase, routing: RoutingSpec, backends: Sequence[str], rates, args,
             env: Dist, progress: Optional[Progress] = None, case_index: str = "") -> Dict[str, object]:
    """Every backend on one case; returns the run's JSON record."""
    progress = progress or Progress("layer", enabled=False)
    shape = case.shape
    case_text = f"{case.label}, {case.tokens_per_gpu} tokens/GPU{f' (case {case_index})' if case_index else ''}"
    progress.set_context(case_text)
    progress.phase("making tokens, weights and routing")
    seed = args.seed * 1_000_003 + env.rank * 7919
    batch = make_batch(case, routing, seed=seed, device=env.device)
    fc1, fc2 = random_weights(case.experts_per_gpu, shape.hidden, shape.ffn_hidden,
                              seed=seed + 17, device=env.device)
    experts = Experts(fc1_weight=fc1, fc2_weight=fc2, num_experts=case.num_experts, group=env.group,
                      main_grads=main_grad_buffers(fc1, fc2) if args.main_grad else None)
    counts = count_routes(batch.topk_ids, case.experts_per_gpu, case.ep_size, env.group)
    floors = layer_floors(hidden=shape.hidden, ffn_hidden=shape.ffn_hidden,
                          experts_per_gpu=case.experts_per_gpu, tokens=[case.tokens_per_gpu] * case.ep_size,
                          sent=counts.sent, received=counts.received,
                          received_remote=counts.received_remote, sent_remote=counts.sent_remote,
                          rates=rates, main_grad=args.main_grad)
    need = routed_rows_need(counts.received, shape.hidden, shape.ffn_hidden)
    plan = None
    if args.check_tokens and any(b != "reference" for b in backends):
        plan = plan_check(case, routing, experts, batch, args, env, seed, progress)
    results = []
    for i, name in enumerate(backends):
        progress.set_context(f"{case_text} | {name} ({i + 1}/{len(backends)})")
        results.append(run_backend(name, case, batch, experts, plan, floors, args, env, progress, need))
    progress.set_context("")
    del batch, experts, fc1, fc2, plan
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "label": case.label,
        "case": case.to_json(),
        "routing": routing.to_json(),
        "routing_label": routing.label,
        "routes": counts.to_json(),
        "model_flops_forward": model_flops(case.tokens_per_gpu, shape.topk, shape.hidden, shape.ffn_hidden),
        "floors": {k: v.to_json() for k, v in floors.items()},
        "routed_rows_need": need,
        "main_grad": bool(args.main_grad),
        "results": results,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m megatron_mok.bench layer``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_args(args)
        shapes = [resolve_shape(s, hidden=args.hidden, ffn_hidden=args.ffn_hidden,
                                num_experts=args.num_experts, topk=args.topk) for s in args.shape]
        per_gpu = parse_experts_per_gpu(args.experts_per_gpu)
        cases = [make_case(s, world, args.tokens, experts_per_gpu_for(s, n)) for s in shapes for n in per_gpu]
        routing = RoutingSpec(args.routing, zipf_s=args.zipf_s, hot_fraction=args.hot_fraction)
        rates = rates_with(H200, gemm_tflops=args.gemm_tflops, hbm_gbps=args.hbm_gbps, peer_gbps=args.peer_gbps)
        backends = parse_backends(args.backends, device_type(args.device))
    except ValueError as err:
        parser.error(str(err))
    set_safe_env()
    env = init_distributed(args.device, args.timeout_s)
    progress = Progress("layer", enabled=env.rank == 0, heartbeat_s=args.heartbeat_s)
    progress.line(f"{len(cases)} case(s) x {len(backends)} backend(s) ({', '.join(backends)}) on {env.world} "
                  f"{'GPU' if env.device.type == 'cuda' else 'CPU process'}(es); {args.warmup} warm-up + "
                  f"{args.iters} timed iterations each")
    try:
        doc = {
            "schema": SCHEMA,
            "date_utc": utc_now(),
            "machine": machine_info(env.world, env.device),
            "command": command_line("layer", argv),
            "settings": {
                "tokens_per_gpu": args.tokens, "routing": routing.to_json(), "routing_label": routing.label,
                "backends": list(backends), "warmup": args.warmup, "iters": args.iters,
                "check_tokens_per_gpu": args.check_tokens, "dtype": "bf16", "seed": args.seed,
                "megatron_experts": args.megatron_experts, "tile_rows": args.tile_rows,
            },
            "rates": rates.to_json(),
            "runs": [],
        }
        for index, case in enumerate(cases):
            run = run_case(case, routing, backends, rates, args, env, progress, f"{index + 1}/{len(cases)}")
            doc["runs"].append(run)
            if env.rank == 0:
                print(report.layer_table(run), flush=True)
                print(flush=True)
        if env.rank == 0:
            stem = os.path.join(args.out, args.name)
            report.write_json(doc, stem + ".json")
            report.layer_chart(doc, stem + ".png")
            with open(stem + ".md", "w") as f:
                f.write(report.layer_markdown(doc))
            print(f"wrote {stem}.json, {stem}.png, {stem}.md", flush=True)
        return 0
    finally:
        progress.close()
        if dist.is_initialized():
            dist.destroy_process_group()
