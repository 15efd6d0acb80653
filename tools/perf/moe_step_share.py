"""The MoE layers' share of a training step: runs a GPT pretrain (the launcher of
examples/gpu_pretrain_compare.sh, in this process) with every Megatron ``MoELayer`` timed.

    python tools/perf/moe_step_share.py --share-json OUT.json --share-warmup 5 -- <pretrain flags>
    torchrun --nproc-per-node 2 tools/perf/moe_step_share.py --share-json OUT.json -- <pretrain flags>

Our options (``--share-*``) come first, then ``--`` (optional), then everything for the
launcher (``--share-launcher``: a module, default ``megatron_mok.pretrain_gpt``, or a ``.py``
script taking Megatron-LM's ``pretrain_gpt.py`` flags), run with ``runpy`` as the program.

Before the launcher runs, the tool wraps ``BaseMoELayer.__init__`` (``MoKMoELayer`` assembles
itself from ``BaseMoELayer.__init__``, not ``MoELayer.__init__``) so that every ``MoELayer``
instance, Megatron's and MoK's, gets four hooks when it is built, and wraps Megatron's
``train_step`` (``megatron.training.training.train_step``, which ``train()`` looks up at each
iteration) to time the step. Each hook records a mark on the current stream: a CUDA event
(``--share-clock cuda``, the default with a GPU) or ``time.perf_counter()`` (``cpu``).

* forward interval: ``register_forward_pre_hook`` to ``register_forward_hook``;
* backward interval: ``register_full_backward_pre_hook`` (the gradient of the layer's output is
  ready: its backward begins) to ``register_full_backward_hook`` (the gradient of its input is
  done). Both fire for Megatron's ``MoELayer``, whose forward returns ``(output, None)``: the
  tensor is wrapped, the ``None`` passed through. The input's gradient node is the first node
  the layer created in the forward, so the autograd engine (which runs ready nodes latest-created
  first, and a parameter's gradient accumulation at once) reaches it only after every other
  node of the layer: router, experts, shared expert and their weight gradients fall inside.
  Work a configuration moves to a side stream and does not join back before the layer's input
  gradient (``--delay-wgrad-compute``'s delayed expert weight gradients) falls outside;
* step: Megatron's ``train_step`` (every microbatch's forward and backward, the gradient
  reduction and the optimizer step).

Recompute (activation checkpointing). A forward that runs while the autograd engine runs a
backward (``torch._C._current_graph_task_id() != -1``) is a recompute. Megatron's
``--recompute-modules moe`` recomputes inside the layer (``tensor_parallel.checkpoint`` around
its ``custom_forward``, not the module call): no forward hook fires again and the recompute lies
inside the layer's backward interval, counted there once. With ``--recompute-granularity full``
the whole transformer layer is re-run before its backward, so the MoE layer's forward hooks
fire a second time, outside the MoE layer's backward interval: that interval is recorded as
``recompute`` (not a second forward) and counted once, in ``moe_recompute_ms``. A forward hook
firing inside the same layer's open backward interval would be time already counted: it is
ignored. Forwards outside ``train_step`` (evaluation) are not recorded.

Per iteration (one row per ``train_step``, numbered as Megatron prints them): ``step_ms``, the
sums over the MoE layers ``moe_fwd_ms``, ``moe_bwd_ms``, ``moe_recompute_ms``, ``moe_ms`` (their
sum), ``moe_share = moe_ms / step_ms``, ``layers`` (MoE layers that ran) and each layer's
intervals. With several microbatches per step every microbatch's intervals are summed. The
summary holds, over the iterations after ``--share-warmup``, the median of each column on its
own. Rank 0 writes the JSON (with every rank's summary) and prints one line:

    moe_step_share: MoE layers: L, forward F ms, backward B ms[, recompute R ms], S% of a T ms step (median of iterations W+1-N)

CUDA events on one stream measure the stream's time between two points, idle time included:
a layer waiting for its launches counts as the layer's time, as it does in the step's. Layers
replayed from CUDA graphs (``--cuda-graph-impl``) run no hooks. The exit status is the launcher's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import runpy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

KINDS = ("forward", "backward", "recompute")
PREFIX = "moe_step_share: "


# ---- clocks ---------------------------------------------------------------------------------------

class CpuClock:
    """Marks are ``time.perf_counter()`` seconds; for CPU runs and tests."""

    name = "cpu"

    def mark(self) -> float:
        return time.perf_counter()

    def wait(self, mark) -> None:
        pass

    def ms(self, start, end) -> float:
        return (end - start) * 1e3


class CudaClock:
    """Marks are CUDA events (``enable_timing``) recorded on the current stream of the calling
    thread (in the backward, the autograd engine's thread, on the stream of the forward)."""

    name = "cuda"

    def __init__(self) -> None:
        self._event = torch.cuda.Event  # the class of now, not a stand-in patched in later

    def mark(self):
        event = self._event(enable_timing=True)
        event.record(torch.cuda.current_stream())
        return event

    def wait(self, mark) -> None:
        mark.synchronize()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end)


def make_clock(name: str):
    """``auto``: CUDA events where a CUDA GPU is visible, else the CPU clock."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return CudaClock() if name == "cuda" else CpuClock()


# ---- arithmetic -----------------------------------------------------------------------------------

def iteration_row(iteration: int, step_ms: float, intervals: Iterable[Tuple[int, str, float]]) -> dict:
    """One iteration's row from its step time and its MoE intervals ``(layer, kind, ms)``
    (``kind`` one of forward, backward, recompute)."""
    per_layer: Dict[int, dict] = {}
    for layer, kind, ms in intervals:
        if kind not in KINDS:
            raise ValueError(f"interval kind {kind!r} is not one of {KINDS}")
        entry = per_layer.setdefault(layer, {f"{k}_ms": 0.0 for k in KINDS} | {f"{k}s": 0 for k in KINDS})
        entry[f"{kind}_ms"] += ms
        entry[f"{kind}s"] += 1
    totals = {k: sum(e[f"{k}_ms"] for e in per_layer.values()) for k in KINDS}
    moe_ms = sum(totals.values())
    return {
        "iteration": iteration,
        "step_ms": step_ms,
        "moe_fwd_ms": totals["forward"],
        "moe_bwd_ms": totals["backward"],
        "moe_recompute_ms": totals["recompute"],
        "moe_ms": moe_ms,
        "moe_share": moe_ms / step_ms if step_ms > 0 else float("nan"),
        "layers": len(per_layer),
        "per_layer": {str(layer): per_layer[layer] for layer in sorted(per_layer)},
    }


SUMMARY_COLUMNS = ("step_ms", "moe_fwd_ms", "moe_bwd_ms", "moe_recompute_ms", "moe_ms", "moe_share", "layers")


def summarize(rows: Sequence[dict], warmup: int) -> Optional[dict]:
    """The median of each column over the rows after the first ``warmup``; None when none is left."""
    kept = list(rows)[warmup:]
    if not kept:
        return None
    summary = {"first_iteration": kept[0]["iteration"], "last_iteration": kept[-1]["iteration"],
               "iterations": len(kept), "warmup": warmup}
    for column in SUMMARY_COLUMNS:
        summary[column] = statistics.median(row[column] for row in kept)
    return summary


def summary_line(summary: Optional[dict], recorded: int = 0, warmup: int = 0) -> str:
    """The printed line of a summary (or why there is none)."""
    if summary is None:
        if recorded == 0:
            return "MoE layers: no training iteration recorded (Megatron's train_step never ran)"
        return f"MoE layers: {recorded} iterations recorded, all within the {warmup} warm-up iterations: no summary"
    recompute = (f", recompute {summary['moe_recompute_ms']:.1f} ms" if summary["moe_recompute_ms"] > 0 else "")
    layers = summary["layers"]
    layers = int(layers) if float(layers).is_integer() else layers
    span = (f"iteration {summary['first_iteration']}" if summary["iterations"] == 1
            else f"iterations {summary['first_iteration']}-{summary['last_iteration']}")
    return (f"MoE layers: {layers}, forward {summary['moe_fwd_ms']:.1f} ms, backward {summary['moe_bwd_ms']:.1f} ms"
            f"{recompute}, {100 * summary['moe_share']:.1f}% of a {summary['step_ms']:.1f} ms step (median of {span})")


# ---- the recorder ---------------------------------------------------------------------------------

def _in_backward() -> bool:
    """Whether this thread is running the autograd engine's backward (a forward now is a recompute)."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class Interval:
    """One interval of one MoE layer in one step, its marks as the clock gave them."""
    layer: int
    kind: str
    start: object
    end: object


@dataclass
class _Step:
    iteration: int
    start: object
    end: object = None
    intervals: List[Interval] = field(default_factory=list)


class StepShareRecorder:
    """Records, per training step, the step's marks and every hooked MoE layer's forward,
    backward and recompute intervals (see the module docstring), and resolves them into rows."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.layers: List[dict] = []  # per hooked layer, in construction order: what it is
        self._modules: List[object] = []
        self._step: Optional[_Step] = None
        self._pending: List[_Step] = []
        self._forward_frames: Dict[int, list] = {}
        self._backward_frames: Dict[int, list] = {}
        self.steps: List[_Step] = []  # resolved steps, their intervals kept (marks as given)
        self.rows: List[dict] = []
        self.outside_steps = 0  # hook pairs that fired outside a training step (not recorded)
        self.unmatched = 0  # start marks without an end at the end of their step

    # -- hooks
    def hook(self, module: torch.nn.Module) -> int:
        """Register the four hooks on ``module``; returns its layer index (once per module)."""
        index = getattr(module, "_moe_step_share_index", None)
        if index is not None:
            return index
        index = len(self.layers)
        module._moe_step_share_index = index
        self.layers.append({"class": type(module).__name__})
        self._modules.append(module)
        self._forward_frames[index] = []
        self._backward_frames[index] = []
        module.register_forward_pre_hook(functools.partial(self._forward_pre, index))
        module.register_forward_hook(functools.partial(self._forward_post, index))
        module.register_full_backward_pre_hook(functools.partial(self._backward_pre, index))
        module.register_full_backward_hook(functools.partial(self._backward_post, index))
        return index

    def _forward_pre(self, index, module, args):
        if self._step is None:
            frame = None
        elif _in_backward():
            # A recompute: inside this layer's own backward interval it is counted there already.
            frame = None if self._backward_frames[index] else ("recompute", self.clock.mark())
        else:
            frame = ("forward", self.clock.mark())
        self._forward_frames[index].append(frame)

    def _forward_post(self, index, module, args, output):
        self._close(self._forward_frames[index], index)

    def _backward_pre(self, index, module, grad_output):
        self._backward_frames[index].append(None if self._step is None else ("backward", self.clock.mark()))

    def _backward_post(self, index, module, grad_input, grad_output):
        self._close(self._backward_frames[index], index)

    def _close(self, frames: list, index: int) -> None:
        if not frames:  # a start before this step began (frames are reset per step)
            return
        frame = frames.pop()
        if frame is None:
            if self._step is None:
                self.outside_steps += 1
            return
        if self._step is not None:
            kind, start = frame
            self._step.intervals.append(Interval(index, kind, start, self.clock.mark()))

    # -- steps
    @contextlib.contextmanager
    def step(self, iteration: Optional[int] = None) -> Iterator[None]:
        """Time one training step (``iteration``: its number; default the count so far + 1)."""
        if iteration is None:
            iteration = len(self.steps) + len(self._pending) + 1
        for frames in (*self._forward_frames.values(), *self._backward_frames.values()):
            frames.clear()
        self._step = _Step(iteration, self.clock.mark())
        try:
            yield
        finally:
            step, self._step = self._step, None
            step.end = self.clock.mark()
            self.unmatched += sum(f is not None for frames in (*self._forward_frames.values(),
                                                              *self._backward_frames.values()) for f in frames)
            self._pending.append(step)
            self.resolve(keep=1)

    def resolve(self, keep: int = 0) -> None:
        """Turn the pending steps, all but the last ``keep``, into rows (waits for their marks:
        with a one-step lag, the GPU has finished them by the time the next step is queued)."""
        while len(self._pending) > keep:
            step = self._pending.pop(0)
            self.clock.wait(step.end)
            for interval in step.intervals:
                self.clock.wait(interval.end)
            intervals = [(i.layer, i.kind, self.clock.ms(i.start, i.end)) for i in step.intervals]
            self.rows.append(iteration_row(step.iteration, self.clock.ms(step.start, step.end), intervals))
            self.steps.append(step)

    def describe_layers(self) -> List[dict]:
        """Per hooked layer: index, class, Megatron's layer number and whether it is an MTP layer."""
        return [{"index": i, **info, "layer_number": getattr(m, "layer_number", None),
                 "mtp": bool(getattr(m, "is_mtp_layer", False))}
                for i, (info, m) in enumerate(zip(self.layers, self._modules))]


# ---- installing into Megatron ---------------------------------------------------------------------

@contextlib.contextmanager
def installed(recorder: StepShareRecorder) -> Iterator[None]:
    """Inside the block every ``MoELayer`` built gets the recorder's hooks, and each call of
    ``megatron.training.training.train_step`` is one recorded step. Undone on exit."""
    from megatron.core.transformer.moe import moe_layer
    from megatron.training import training

    base_init = moe_layer.BaseMoELayer.__init__
    train_step = training.train_step

    @functools.wraps(base_init)
    def __init__(self, *args, **kwargs):
        base_init(self, *args, **kwargs)
        if isinstance(self, moe_layer.MoELayer):
            recorder.hook(self)

    @functools.wraps(train_step)
    def timed_train_step(*args, **kwargs):
        iteration = kwargs.get("iteration")  # Megatron's count before the step; it prints + 1
        with recorder.step(None if iteration is None else iteration + 1):
            return train_step(*args, **kwargs)

    moe_layer.BaseMoELayer.__init__ = __init__
    training.train_step = timed_train_step
    try:
        yield
    finally:
        moe_layer.BaseMoELayer.__init__ = base_init
        training.train_step = train_step


def run_launcher(launcher: str, args: Sequence[str]) -> int:
    """Run ``launcher`` (a module name, or a path ending in .py) as the program with ``args``;
    returns its exit status."""
    saved = list(sys.argv)
    try:
        if launcher.endswith(".py"):
            sys.argv = [launcher, *args]
            runpy.run_path(launcher, run_name="__main__")
        else:
            sys.argv = [launcher, *args]
            runpy.run_module(launcher, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def _rank_and_world() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def report(recorder: StepShareRecorder, *, warmup: int, path: Optional[str], status: int,
           argv: Sequence[str] = (), gather: bool = True) -> dict:
    """Resolve what is left, summarize, gather every rank's summary (when the process group is
    up, the launcher succeeded and ``gather``), write the JSON (rank 0) and print the line
    (rank 0). Returns this rank's report."""
    import torch.distributed as dist

    recorder.resolve()
    summary = summarize(recorder.rows, warmup)
    rank, world = _rank_and_world()
    result = {
        "tool": "tools/perf/moe_step_share.py", "argv": list(argv), "rank": rank, "world_size": world,
        "clock": recorder.clock.name, "warmup": warmup, "launcher_status": status,
        "moe_layers": recorder.describe_layers(), "outside_steps": recorder.outside_steps,
        "unmatched": recorder.unmatched, "summary": summary, "iterations": recorder.rows,
    }
    ranks = [{"rank": rank, "summary": summary}]
    if gather and status == 0 and world > 1 and dist.is_available() and dist.is_initialized():
        ranks = [None] * world
        dist.all_gather_object(ranks, {"rank": rank, "summary": summary})
    result["ranks"] = ranks
    if rank == 0:
        line = summary_line(summary, len(recorder.rows), warmup)
        if status != 0:
            line += f" (the launcher exited with status {status})"
        shares = [r["summary"]["moe_share"] for r in ranks if r and r.get("summary")]
        if len(shares) > 1:
            line += f"; over {len(shares)} ranks the share runs {100 * min(shares):.1f}-{100 * max(shares):.1f}%"
        print(PREFIX + f"{len(recorder.layers)} MoE layers hooked on rank 0, clock {recorder.clock.name}", flush=True)
        print(PREFIX + line, flush=True)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            print(PREFIX + f"per-iteration rows in {path}", flush=True)
    return result


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(our options, the launcher's arguments). Ours are the leading ``--share-*`` options (each
    ``--share-x VALUE`` or ``--share-x=VALUE``) and ``-h``; the launcher's start after a ``--``
    or at the first other argument (so that a launcher such as torchrun that drops ``--`` from
    a script's arguments changes nothing)."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg in ("-h", "--help") or (arg.startswith("--share-") and "=" in arg):
            i += 1
        elif arg.startswith("--share-"):
            i += 2
        else:
            break
    return argv[:i], argv[i:]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/perf/moe_step_share.py",
        description="Run a GPT pretrain with every MoE layer timed: the MoE layers' share of each "
                    "training step (forward, backward, recompute), per iteration and as a median.",
        usage="%(prog)s [--share-json PATH] [--share-warmup N] [--share-launcher L] "
              "[--share-clock auto|cuda|cpu] -- PRETRAIN_ARGS...")
    p.add_argument("--share-json", default="moe_step_share.json",
                   help="where rank 0 writes the rows and the summary (default: ./moe_step_share.json)")
    p.add_argument("--share-warmup", type=int, default=5,
                   help="iterations left out of the summary's medians (default 5)")
    p.add_argument("--share-launcher", default="megatron_mok.pretrain_gpt",
                   help="module, or .py script, taking Megatron-LM's pretrain_gpt.py flags "
                        "(default megatron_mok.pretrain_gpt)")
    p.add_argument("--share-clock", default="auto", choices=("auto", "cuda", "cpu"),
                   help="CUDA events (default with a GPU) or time.perf_counter()")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    ours, launch_args = split_argv(sys.argv[1:] if argv is None else argv)
    p = parser()
    opts = p.parse_args(ours)
    if opts.share_warmup < 0:
        p.error("--share-warmup must be 0 or more")
    if not launch_args:
        p.error("give the pretrain's arguments after --")
    sys.path.insert(0, os.getcwd())  # as `python -m LAUNCHER` from here would have it
    recorder = StepShareRecorder(make_clock(opts.share_clock))
    with installed(recorder):
        status = run_launcher(opts.share_launcher, launch_args)
    report(recorder, warmup=opts.share_warmup, path=opts.share_json, status=status, argv=launch_args)
    return status


if __name__ == "__main__":
    sys.exit(main())
