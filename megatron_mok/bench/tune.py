"""``python -m megatron_mok.bench tune``: pick the megakernel's tunables for one shape.

Run under torchrun with the EP size of the deployment (or its per-GPU load via
``--experts-per-gpu``). For each candidate (comm SMs, minibatch rows, ring rows, pair mode,
group size) it checks the megakernel's output against the ``cuda`` backend's, then times the
forward (with grad, as in training, unless ``--no-grad``; warm-up, CUDA events, the median over
iterations of the slowest rank) and writes the fastest as Megatron flags to ``--out`` (an args
file the launcher reads with ``@FILE``), with every candidate's time in its comments::

    torchrun --nproc-per-node 2 -m megatron_mok.bench tune --shape kimi-k2 --tokens 4096 \\
        --experts-per-gpu 6 --out tuned.args
    python -m megatron_mok.pretrain_gpt @my-model.args @tuned.args ...

Candidates: ``--candidates COMM:MINIBATCH:RING[:PAIRS[:GROUP]] ...``. An empty field takes the
default (:meth:`megatron_mok.MoKConfig.resolve` for COMM, MINIBATCH and RING, the library's for
PAIRS and GROUP); PAIRS is on, off or auto (``MegakernelTunables.pairs``), GROUP the row blocks
of a group (``MegakernelTunables.group_blocks``, even, 2 to 64). E.g. ``8:::off`` (8 comm SMs,
single CTAs) or ``::::16`` (groups of 16 blocks). Without ``--candidates``:
:func:`default_candidates`. The args file always pins every tunable (comm SMs, minibatch, ring,
``--mok-megakernel-pairs on|off``, ``--mok-megakernel-group-blocks N``) to what the winner ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..config import MegakernelTunables, MoKConfig, MoKConfigError
from .machine import init_distributed
from .routing import RoutingSpec, make_routing
from .shapes import SHAPES, make_case, resolve_shape
from .timing import Stopwatch, align_ranks, slowest_rank_medians

MAX_REL_DIFF = 2e-2
"""Largest relative difference to the cuda backend's output a candidate may show (bf16)."""


PAIRS_VALUES = {"": None, "auto": None, "on": True, "off": False}
"""Spellings of a candidate's PAIRS field (None: the library's default)."""


@dataclass(frozen=True)
class Candidate:
    """One setting of the megakernel's tunables (None: the default)."""

    comm_sms: Optional[int]
    minibatch_rows: Optional[int]
    ring_rows: Optional[int]
    pairs: Optional[bool] = None          # MegakernelTunables.pairs
    group_blocks: Optional[int] = None    # MegakernelTunables.group_blocks

    @staticmethod
    def parse(text: str) -> "Candidate":
        """'16:2048:8192', '16:2048:8192:off' or '16:2048:8192:on:16' (empty fields: default)
        -> Candidate. Raises ValueError naming the field and the rule."""
        parts = text.split(":")
        if not 3 <= len(parts) <= 5:
            raise ValueError(f"candidate {text!r} must be COMM:MINIBATCH:RING[:PAIRS[:GROUP]] "
                             "(empty fields take the default)")
        parts += [""] * (5 - len(parts))
        try:
            comm, minibatch, ring, group = (int(p) if p else None for p in parts[:3] + parts[4:])
        except ValueError:
            raise ValueError(f"candidate {text!r}: COMM, MINIBATCH, RING and GROUP must be integers or empty") from None
        if parts[3] not in PAIRS_VALUES:
            raise ValueError(f"candidate {text!r}: PAIRS must be on, off, auto or empty")
        return Candidate(comm, minibatch, ring, pairs=PAIRS_VALUES[parts[3]], group_blocks=group)

    def config(self, base: MoKConfig) -> MoKConfig:
        """``base`` with this candidate's tunables (its None fields left to the defaults).
        Raises MoKConfigError for a value the config rejects."""
        return dataclasses.replace(
            base, comm_sms_forward=self.comm_sms, minibatch_rows=self.minibatch_rows, ring_rows=self.ring_rows,
            megakernel=MegakernelTunables(pairs=self.pairs, group_blocks=self.group_blocks))

    def __str__(self) -> str:
        pairs = {None: "", True: "on", False: "off"}[self.pairs]
        fields = [self.comm_sms, self.minibatch_rows, self.ring_rows]
        return ":".join("" if v is None else str(v) for v in fields) + f":{pairs}:" + (
            "" if self.group_blocks is None else str(self.group_blocks))


def default_candidates(default_minibatch: int, default_pairs: bool, default_comm: int = 8,
                       default_group_blocks: int = 8) -> List[Candidate]:
    """The candidates tried without ``--candidates``: 4, 6, 8 and 10 comm SMs at the default
    minibatch (the comm SMs only pull; the default is 8, or 6 where reading the expert weights
    bounds the forward, 2 fewer without grad); then, at the default comm SMs (what the call
    would get): twice the minibatch (rings of four); pair mode the other way than
    ``default_pairs``; groups of 16 blocks (8 when the default is 16). Pair mode's gain and the
    best group size moved with the expert load and the machine (docs/perf-notes.md)."""
    out = [Candidate(c, default_minibatch, 4 * default_minibatch) for c in (4, 6, 8, 10)]
    out.append(Candidate(default_comm, 2 * default_minibatch, 8 * default_minibatch))
    out.append(Candidate(default_comm, default_minibatch, 4 * default_minibatch, pairs=not default_pairs))
    out.append(Candidate(default_comm, default_minibatch, 4 * default_minibatch,
                         group_blocks=8 if default_group_blocks == 16 else 16))
    return out


def describe(resolved: MoKConfig) -> str:
    """The tunables of a resolved config as the results and the args file's comments name them."""
    mk = resolved.megakernel
    return (f"comm {resolved.comm_sms_forward}, minibatch {resolved.minibatch_rows}, ring {resolved.ring_rows}, "
            f"pairs asked {'on' if mk.pairs else 'off'}, group blocks {mk.group_blocks}")


def args_file_text(best: MoKConfig, lines: Sequence[str]) -> str:
    """The args file: the winning tunables as Megatron flags, the measurements as comments.
    ``best`` is resolved (``megakernel_backend.resolve_tunables``); a megakernel field left None
    writes no flag for it."""
    head = [f"# Written by `python -m megatron_mok.bench tune` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC."]
    head += [f"# {line}" for line in lines]
    flags = [f"--mok-comm-sms-forward {best.comm_sms_forward}", f"--mok-minibatch-rows {best.minibatch_rows}",
             f"--mok-ring-rows {best.ring_rows}"]
    if best.megakernel.pairs is not None:
        flags.append(f"--mok-megakernel-pairs {'on' if best.megakernel.pairs else 'off'}")
    if best.megakernel.group_blocks is not None:
        flags.append(f"--mok-megakernel-group-blocks {best.megakernel.group_blocks}")
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
    ap.add_argument("--candidates", nargs="+", default=None,
                    help="COMM:MINIBATCH:RING[:PAIRS[:GROUP]] settings to try (PAIRS: on, off, auto; GROUP: row "
                         "blocks of a group; empty fields: the default)")
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
        candidates = default_candidates(default.minibatch_rows, default.megakernel.pairs,
                                        base.forward_comm_sms(default, saves_activations=not args.no_grad),
                                        default.megakernel.group_blocks)
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
            try:
                cfg = cand.config(base)
                resolved = megakernel_backend.resolve_tunables(cfg, call_shape, env.world, sms)
                # The comm SMs this launch runs (a forward without grad takes fewer by default),
                # so the args file pins what was timed.
                resolved = dataclasses.replace(resolved, comm_sms_forward=cfg.forward_comm_sms(
                    resolved, saves_activations=not args.no_grad))
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
        setting = describe(resolved) if resolved is not None else f"{cand}"
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
        print(f"best: {describe(best)} -> {args.out}", flush=True)
    return 0
