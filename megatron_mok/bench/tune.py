"""``python -m megatron_mok.bench tune``: pick the megakernel's tunables for one shape.

Run under torchrun with the EP size of the deployment (or its per-GPU load via
``--experts-per-gpu``). For each candidate (comm SMs, minibatch rows, ring rows) it checks the
megakernel's output against the ``cuda`` backend's, then times the forward (with grad, as in
training, unless ``--no-grad``; warm-up, CUDA events, the median over iterations of the slowest
rank) and writes the fastest as Megatron
flags to ``--out`` (an args file the launcher reads with ``@FILE``), with every candidate's
time in its comments::

    torchrun --nproc-per-node 2 -m megatron_mok.bench tune --shape kimi-k2 --tokens 4096 \\
        --experts-per-gpu 6 --out tuned.args
    python -m megatron_mok.pretrain_gpt @my-model.args @tuned.args ...

Candidates: ``--candidates C:M:R[:PAIRS] ...`` (empty fields take the defaults of
:meth:`megatron_mok.MoKConfig.resolve`; PAIRS is on, off or auto, pair mode of
``MoKConfig.megakernel_pairs``), else :func:`default_candidates`: 8, 10, 12 and 16 comm SMs with
the default minibatch, 10 with twice the default minibatch (rings of four minibatches), and 10
at the default minibatch with pair mode the other way than the shape's default. The args file
always pins pair mode (on or off) to what the winner ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..config import MoKConfig, MoKConfigError
from .machine import init_distributed
from .routing import RoutingSpec, make_routing
from .shapes import SHAPES, make_case, resolve_shape
from .timing import Stopwatch, align_ranks, slowest_rank_medians

MAX_REL_DIFF = 2e-2
"""Largest relative difference to the cuda backend's output a candidate may show (bf16)."""


@dataclass(frozen=True)
class Candidate:
    """One setting of the megakernel's tunables (None: the default)."""

    comm_sms: Optional[int]
    minibatch_rows: Optional[int]
    ring_rows: Optional[int]
    pairs: Optional[bool] = None  # MoKConfig.megakernel_pairs (None: from the shape)

    @staticmethod
    def parse(text: str) -> "Candidate":
        """'16:2048:8192' or '16:2048:8192:off' (empty fields: default) -> Candidate."""
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"candidate {text!r} must be COMM:MINIBATCH:RING or COMM:MINIBATCH:RING:PAIRS "
                             "(empty fields take the default)")
        try:
            values = [int(p) if p else None for p in parts[:3]]
        except ValueError:
            raise ValueError(f"candidate {text!r}: COMM, MINIBATCH and RING must be integers or empty") from None
        pairs = {"": None, "auto": None, "on": True, "off": False}.get(parts[3] if len(parts) == 4 else "", "bad")
        if pairs == "bad":
            raise ValueError(f"candidate {text!r}: PAIRS must be on, off, auto or empty")
        return Candidate(*values, pairs=pairs)

    def config(self, base: MoKConfig) -> MoKConfig:
        return MoKConfig(comm_sms_forward=self.comm_sms, minibatch_rows=self.minibatch_rows,
                         ring_rows=self.ring_rows, megakernel_pairs=self.pairs, tile_rows=base.tile_rows,
                         timeout_s=base.timeout_s, max_tokens_per_rank=base.max_tokens_per_rank)


def default_candidates(default_minibatch: int, default_pairs: bool, default_comm: int = 8) -> List[Candidate]:
    """4, 6, 8 and 10 comm SMs at the default minibatch (the defaults run 4-8: the comm SMs only
    pull since the twelfth session); the default comm SMs at twice it (rings of four), and at
    the default minibatch with pair mode the other way than ``default_pairs`` (what the call
    would get): pair mode's gain moved between machines and timing methods (docs/perf-notes.md,
    ninth and twelfth sessions)."""
    out = [Candidate(c, default_minibatch, 4 * default_minibatch) for c in (4, 6, 8, 10)]
    out.append(Candidate(default_comm, 2 * default_minibatch, 8 * default_minibatch))
    out.append(Candidate(default_comm, default_minibatch, 4 * default_minibatch, pairs=not default_pairs))
    return out


def args_file_text(best: MoKConfig, lines: Sequence[str]) -> str:
    """The args file: the winning tunables as Megatron flags, the measurements as comments."""
    head = [f"# Written by `python -m megatron_mok.bench tune` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC."]
    head += [f"# {line}" for line in lines]
    flags = [f"--mok-comm-sms-forward {best.comm_sms_forward}", f"--mok-minibatch-rows {best.minibatch_rows}",
             f"--mok-ring-rows {best.ring_rows}"]
    if best.megakernel_pairs is not None:
        flags.append(f"--mok-megakernel-pairs {'on' if best.megakernel_pairs else 'off'}")
    return "\n".join(head + flags) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_mok.bench tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="kimi-k2", help=f"one of {', '.join(SHAPES)} or custom")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--ffn-hidden", type=int)
    ap.add_argument("--num-experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    ap.add_argument("--experts-per-gpu", type=int, default=None, help="default: the model's experts / GPUs")
    ap.add_argument("--routing", choices=("uniform", "zipf", "hot"), default="uniform")
    ap.add_argument("--candidates", nargs="+", default=None, help="COMM:MINIBATCH:RING[:PAIRS] settings to try (PAIRS: on, off, auto)")
    ap.add_argument("--no-grad", action="store_true",
                    help="time the forward without grad (inference); default: with grad, as in training")
    ap.add_argument("--warmup", type=int, default=60,
                    help="untimed calls per candidate, enough for the card to reach the power state it holds "
                         "under that candidate's load (~0.4 s; under the 700 W cap of an H200 the first "
                         "calls after another candidate or after idle run at another clock)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="mok-tuned.args", help="args file to write (rank 0)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        candidates = [Candidate.parse(c) for c in args.candidates] if args.candidates else None
        shape = resolve_shape(args.shape, hidden=args.hidden, ffn_hidden=args.ffn_hidden,
                              num_experts=args.num_experts, topk=args.topk)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    if not torch.cuda.is_available():
        print("error: the tune command times the megakernel, which needs an sm_90 GPU; torch sees no CUDA device")
        return 2
    env = init_distributed("cuda", timeout_s=300.0)
    case = make_case(shape, env.world, args.tokens, args.experts_per_gpu)
    from ..functional import megakernel_backend, mok_moe
    from ..functional.validate import MoEShape

    L, H, I, K, T = case.experts_per_gpu, shape.hidden, shape.ffn_hidden, shape.topk, case.tokens_per_gpu
    call_shape = MoEShape(tokens=T, hidden=H, topk=K, experts_per_rank=L, ffn_hidden=I)
    sms = torch.cuda.get_device_properties(env.device).multi_processor_count
    base = MoKConfig(max_tokens_per_rank=T)
    if candidates is None:
        default = megakernel_backend.resolve_tunables(base, call_shape, env.world, sms)
        candidates = default_candidates(default.minibatch_rows, megakernel_backend.use_pairs(),
                                        base.forward_comm_sms(default, saves_activations=not args.no_grad))
    ids, weights = make_routing(RoutingSpec(kind=args.routing), T, case.num_experts, K,
                                seed=args.seed + env.rank, device=env.device)
    gen = torch.Generator(device=env.device).manual_seed(args.seed + 100 + env.rank)
    x = torch.randn(T, H, generator=gen, device=env.device).bfloat16()
    fc1 = (torch.randn(L, 2 * I, H, generator=gen, device=env.device) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(L, H, I, generator=gen, device=env.device) / I ** 0.5).bfloat16()
    with torch.no_grad():
        ref = mok_moe(x, ids, weights, fc1, fc2, ep_group=env.group, config=base, backend="cuda").float()
    # As in training by default: x needs grad, so the launch also writes the activations the
    # backward reads (the pulls store every row twice), which moves the best comm-SM count.
    if not args.no_grad:
        x.requires_grad_(True)
    with torch.set_grad_enabled(not args.no_grad):
        results = []
        for cand in candidates:
            cfg = cand.config(base)
            try:
                resolved = megakernel_backend.resolve_tunables(cfg, call_shape, env.world, sms)
                # Pin pair mode to what this candidate runs, so the args file says it.
                resolved = dataclasses.replace(resolved, megakernel_pairs=megakernel_backend.use_pairs(cfg))
            except MoKConfigError as err:
                results.append((cand, None, None, f"rejected: {err}"))
                continue
            y = mok_moe(x, ids, weights, fc1, fc2, ep_group=env.group, config=cfg, backend="megakernel").detach().float()
            err = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
            if not err <= MAX_REL_DIFF:  # also catches NaN
                results.append((cand, resolved, None, f"wrong: relative difference {err:.2e} to the cuda backend"))
                continue
            times = []
            for it in range(args.warmup + args.iters):
                align_ranks(env.group, env.device)
                sw = Stopwatch(env.device)
                sw.mark("start")
                mok_moe(x, ids, weights, fc1, fc2, ep_group=env.group, config=cfg, backend="megakernel")
                sw.mark("end")
                if it >= args.warmup:
                    times.append(sw)
            ms = slowest_rank_medians({"forward": [sw.ms("start", "end") for sw in times]}, env.group,
                                      env.device)["forward"]["ms"]
            results.append((cand, resolved, float(ms), f"rel. diff {err:.1e}"))
    timed = [r for r in results if r[2] is not None]
    flop = 6 * T * K * H * I
    lines = [f"{shape.name}, {L} experts/GPU, {T} tokens/GPU, {env.world} GPU(s), routing {args.routing}: "
             f"megakernel forward {'without grad' if args.no_grad else 'with grad (training)'}, median of the slowest rank"]
    for cand, resolved, ms, note in results:
        setting = (f"comm {resolved.comm_sms_forward}, minibatch {resolved.minibatch_rows}, ring {resolved.ring_rows}, "
                   f"pairs asked {'on' if resolved.megakernel_pairs else 'off'}" if resolved is not None else f"{cand}")
        lines.append(f"  {setting}: " + (f"{ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s), {note}" if ms else note))
    if env.rank == 0:
        print("\n".join(lines), flush=True)
    if not timed:
        if env.rank == 0:
            print("error: no candidate ran correctly; nothing written")
        return 1
    best = min(timed, key=lambda r: r[2])[1]
    if env.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(args_file_text(best, lines))
        print(f"best: comm {best.comm_sms_forward}, minibatch {best.minibatch_rows}, ring {best.ring_rows}, "
              f"pairs asked {'on' if best.megakernel_pairs else 'off'} -> {args.out}", flush=True)
    return 0
