"""``python -m megatron_mok.bench e2e``: the same Megatron training run with each token
dispatcher, compared by step time and tokens/s per GPU.

For every dispatcher it starts ``torchrun --nproc-per-node N`` on the launcher (default
``python -m megatron_mok.pretrain_gpt``, which takes Megatron-LM's pretrain_gpt.py flags)
with the model and data flags of ``--args-file`` files and those given after ``--``, plus

    <dispatcher flags> --train-iters ITERS --log-interval 1 --eval-iters 0
    --eval-interval ITERS+1 --log-memory-interval ITERS [--log-throughput]

and reads Megatron's training log (:mod:`megatron_mok.megatron.training_log`). The first
``--skip-iters`` iterations are warm-up; the step time is the median of the rest. The report
(NAME.json, NAME.md, NAME.png) holds per dispatcher the step time, tokens/s per GPU, the peak
device memory Megatron's memory report shows (max allocated and max reserved over the
reporting ranks) and the LM-loss curve; the chart overlays the loss curves.

Progress: a line when each dispatcher's run starts, its iterations as they are logged (iteration
k/ITERS, step time, loss) and a heartbeat every ``--heartbeat-s`` seconds of silence.

    python -m megatron_mok.bench e2e --nproc-per-node 2 --dispatchers alltoall,mok \\
        --iters 30 --out bench-results -- $(cat my-model.args)
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

import torch

from . import report
from ..megatron.training_log import LogError, losses, parse_iterations, parse_log, parse_memory, summarize
from .machine import machine_info, set_safe_env, utc_now
from .progress import Progress

SCHEMA = "megatron-mok/bench-e2e/1"

MOK_BACKENDS = ("auto", "megakernel", "cuda", "reference")

DISPATCHERS: Dict[str, List[str]] = {
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "allgather": ["--moe-token-dispatcher-type", "allgather"],
    "flex-deepep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
    "flex-hybridep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"],
    "mok": ["--moe-token-dispatcher-type", "mok"],
}
"""Dispatcher name -> launcher flags. ``mok:BACKEND`` adds ``--mok-backend BACKEND``."""


class E2EArgumentError(ValueError):
    """A bad ``e2e`` argument; the message names it."""


def dispatcher_flags(spec: str) -> List[str]:
    """Launcher flags of dispatcher ``spec`` ("alltoall", "mok", "mok:cuda", ...)."""
    base, _, backend = spec.partition(":")
    if base not in DISPATCHERS:
        raise E2EArgumentError(f"dispatcher {spec!r} is not one of {', '.join(DISPATCHERS)} "
                               f"(or mok:BACKEND with BACKEND in {', '.join(MOK_BACKENDS)})")
    flags = list(DISPATCHERS[base])
    if backend:
        if base != "mok" or backend not in MOK_BACKENDS:
            raise E2EArgumentError(f"dispatcher {spec!r}: only mok takes a backend, one of {', '.join(MOK_BACKENDS)}")
        flags += ["--mok-backend", backend]
    return flags


def dispatcher_label(spec: str) -> str:
    base, _, backend = spec.partition(":")
    return f"{base} ({backend})" if backend else base


def unavailable_reason(spec: str) -> Optional[str]:
    """Why dispatcher ``spec`` cannot run here (a package missing), or None."""
    if spec.startswith("flex-"):
        try:
            module = importlib.import_module("deep_ep")
        except ImportError as err:
            return f"DeepEP is not installed (import deep_ep: {err})"
        if spec == "flex-hybridep" and not hasattr(module, "HybridEPBuffer"):
            return "the installed deep_ep has no HybridEPBuffer"
    return None


def read_args_file(path: str) -> List[str]:
    """Launcher flags from a file: shell words, '#' starts a comment, lines are joined."""
    try:
        with open(path) as f:
            return shlex.split(f.read(), comments=True)
    except OSError as err:
        raise E2EArgumentError(f"--args-file {path!r} cannot be read: {err}") from err


def launcher_command(launcher: str) -> List[str]:
    """torchrun's target: a module name (``-m`` form) or a path to a Python script."""
    if launcher.endswith(".py"):
        if not os.path.isfile(launcher):
            raise E2EArgumentError(f"--launcher script {launcher!r} does not exist")
        return [launcher]
    return ["-m", launcher]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(*, nproc: int, launcher: str, launcher_args: Sequence[str], dispatcher: str,
                  iters: int, throughput: bool, port: int) -> List[str]:
    """The full command of one run (our flags come last, so they win over the config's)."""
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-addr", "127.0.0.1", "--master-port", str(port)]
            + launcher_command(launcher) + list(launcher_args) + dispatcher_flags(dispatcher)
            # Megatron 0.19 divides by --eval-interval even with --eval-iters 0 ("int // NoneType"
            # in get_train_valid_test_num_samples).
            + ["--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0",
               "--eval-interval", str(iters + 1), "--log-memory-interval", str(iters)]
            + (["--log-throughput"] if throughput else []))


def run_logged(cmd: Sequence[str], log_path: str, *, timeout_s: float, echo_all: bool,
               progress: Optional[Progress] = None, iters: Optional[int] = None) -> int:
    """Run ``cmd`` with stdout and stderr into ``log_path``, reporting its iterations (and error
    lines) to ``progress``, or echoing every line with ``echo_all``; returns its exit status
    (-9 after a timeout, when its process group is killed)."""
    progress = progress or Progress("e2e", enabled=False)
    env = set_safe_env(dict(os.environ))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, bufsize=1, process_group=0)
        timer = _Deadline(proc, timeout_s)
        progress.phase(f"starting (torchrun, Megatron start-up, model build; limit {timeout_s:.0f} s)")
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                if echo_all:
                    sys.stdout.write("    " + line.rstrip("\n") + "\n")
                    sys.stdout.flush()
                _report(line, progress, iters)
            return proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _report(line: str, progress: Progress, iters: Optional[int]) -> None:
    """Tell ``progress`` about a log line worth reporting: an iteration (k/ITERS, step time,
    loss), an error line."""
    parsed = parse_iterations([line])
    if parsed:
        it = parsed[0]
        detail = f", {it.elapsed_ms:.1f} ms" + (f", lm loss {it.lm_loss:.4f}" if it.lm_loss is not None else "")
        progress.iteration(it.iteration, iters or it.iteration, "training iteration", detail=detail)
    elif "Error" in line or "Traceback" in line or "error:" in line:
        progress.line(line.rstrip("\n"))


class _Deadline:
    """Kills the process group of ``proc`` (started in its own process group) after ``seconds``."""

    def __init__(self, proc: subprocess.Popen, seconds: float):
        import threading

        self.proc = proc
        self.timer = threading.Timer(seconds, self._kill)
        self.timer.daemon = True
        self.timer.start()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def cancel(self) -> None:
        self.timer.cancel()


def _error_lines(path: str, limit: int = 8) -> str:
    """The first distinct lines of the log that name an error (else its last lines)."""
    with open(path) as f:
        lines = f.readlines()
    found: List[str] = []
    for line in lines:
        text = line.strip()
        if ("Error" in text or "error:" in text) and text not in found:
            found.append(text)
            if len(found) == limit:
                break
    return "\n".join(found) if found else "".join(lines[-limit:])


def run_one(spec: str, args, launcher_args: Sequence[str], progress: Optional[Progress] = None) -> Dict[str, object]:
    """Run the launcher with dispatcher ``spec``; returns the run's JSON record."""
    progress = progress or Progress("e2e", heartbeat_s=0)
    record: Dict[str, object] = {"dispatcher": spec, "label": dispatcher_label(spec)}
    reason = unavailable_reason(spec)
    if reason is not None:
        record.update(status="skipped", reason=reason)
        progress.line(f"skipped: {reason}")
        return record
    cmd = build_command(nproc=args.nproc_per_node, launcher=args.launcher, launcher_args=launcher_args,
                        dispatcher=spec, iters=args.iters, throughput=not args.no_throughput,
                        port=free_port())
    log_path = os.path.join(args.out, f"{args.name}-{spec.replace(':', '-')}.log")
    record.update(command=shlex.join(cmd), log=log_path)
    progress.line(f"{args.nproc_per_node} process(es), {args.iters} iterations; log {log_path}")
    code = run_logged(cmd, log_path, timeout_s=args.timeout_s, echo_all=args.verbose, progress=progress,
                      iters=args.iters)
    record["returncode"] = code
    if code != 0:
        why = f"timed out after {args.timeout_s:.0f} s" if code == -signal.SIGKILL else f"exit status {code}"
        record.update(status="failed", reason=f"{why}: {_error_lines(log_path)}\n(log: {log_path})")
        progress.line(f"failed ({why}); see {log_path}")
        return record
    with open(log_path) as f:
        text = f.read()
    margs, iterations = parse_log(text)
    record["loss_curve"] = [[it.iteration, it.lm_loss] for it in losses(iterations)]
    record["memory"] = parse_memory(text.splitlines())
    seen = margs.get("moe_token_dispatcher_type")
    wanted = dispatcher_flags(spec)[1]
    if seen is not None and seen != wanted:
        record.update(status="failed", reason=f"the launcher ran with moe_token_dispatcher_type={seen}, not {wanted}")
        return record
    try:
        record.update(summarize(margs, iterations, skip=args.skip_iters))
    except LogError as err:
        record.update(status="failed", reason=str(err))
        progress.line(f"failed: {err}")
        return record
    record["status"] = "ok"
    memory = record["memory"]
    progress.line(f"done: step {record['step_ms']:.1f} ms, {record['tokens_per_s_per_gpu']:.0f} tokens/s/GPU"
                  + (f", peak memory {memory['max_allocated_mb'] / 1024:.1f} GB allocated" if memory else ""))
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mok.bench e2e",
        description="Run the same Megatron training with each token dispatcher and compare step "
                    "time and tokens/s per GPU. Model and data flags go after '--' or in --args-file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dispatchers", default="alltoall,mok",
                   help="comma-separated: " + ", ".join(DISPATCHERS) + ", or mok:BACKEND (" +
                        ", ".join(MOK_BACKENDS) + ")")
    p.add_argument("--nproc-per-node", type=int, default=max(1, torch.cuda.device_count()),
                   help="processes (GPUs) per run")
    p.add_argument("--iters", type=int, default=30, help="training iterations per run (--train-iters)")
    p.add_argument("--skip-iters", type=int, default=5, help="first iterations left out as warm-up")
    p.add_argument("--launcher", default="megatron_mok.pretrain_gpt",
                   help="module (run with -m) or .py script that takes Megatron's pretrain_gpt flags")
    p.add_argument("--args-file", action="append", default=[],
                   help="file of launcher flags (shell words, # comments); repeatable, read in order, "
                        "before the flags after '--'")
    p.add_argument("--label", help="name of the configuration in the table and chart (default: the "
                                   "last args file's name)")
    p.add_argument("--no-throughput", action="store_true", help="do not pass --log-throughput")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run, seconds")
    p.add_argument("--verbose", action="store_true", help="echo the whole training log")
    p.add_argument("--heartbeat-s", type=float, default=60.0,
                   help="print a 'still ...' line after this many seconds without a new iteration (0: never)")
    p.add_argument("--out", default="bench-results", help="folder for NAME.json, NAME.png, NAME.md and the logs")
    p.add_argument("--name", default="e2e", help="file name stem of the outputs")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m megatron_mok.bench e2e``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, passthrough = argv[:cut], argv[cut + 1:]
    else:
        own, passthrough = argv, []
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        specs = [s.strip() for s in args.dispatchers.split(",") if s.strip()]
        if not specs:
            raise E2EArgumentError("--dispatchers is empty")
        for spec in specs:
            dispatcher_flags(spec)
        if len(set(specs)) != len(specs):
            raise E2EArgumentError(f"--dispatchers {args.dispatchers!r} names a dispatcher twice")
        if args.nproc_per_node < 1:
            raise E2EArgumentError(f"--nproc-per-node {args.nproc_per_node} must be at least 1")
        if args.iters < 1 or args.skip_iters < 0 or args.skip_iters >= args.iters:
            raise E2EArgumentError(f"--iters {args.iters} and --skip-iters {args.skip_iters}: need "
                                   "iters >= 1 and 0 <= skip-iters < iters")
        if args.timeout_s <= 0:
            raise E2EArgumentError(f"--timeout-s {args.timeout_s} must be positive")
        launcher_command(args.launcher)
        launcher_args = [flag for path in args.args_file for flag in read_args_file(path)] + passthrough
    except E2EArgumentError as err:
        parser.error(str(err))
    label = args.label or (os.path.basename(args.args_file[-1]) if args.args_file else "launcher flags")
    progress = Progress("e2e", heartbeat_s=args.heartbeat_s, min_interval_s=0.0)
    runs = []
    try:
        for i, spec in enumerate(specs):
            progress.set_context(f"{dispatcher_label(spec)} ({i + 1}/{len(specs)})")
            runs.append(run_one(spec, args, launcher_args, progress))
    finally:
        progress.close()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    doc = {
        "schema": SCHEMA,
        "date_utc": utc_now(),
        "machine": machine_info(args.nproc_per_node, device),
        "command": shlex.join(["python", "-m", "megatron_mok.bench", "e2e", *argv]),
        "settings": {
            "dispatchers": specs, "nproc_per_node": args.nproc_per_node, "iters": args.iters,
            "skip_iters": args.skip_iters, "launcher": args.launcher, "launcher_args": launcher_args,
            "config_label": label,
        },
        "runs": runs,
    }
    stem = os.path.join(args.out, args.name)
    report.write_json(doc, stem + ".json")
    report.e2e_chart(doc, stem + ".png")
    with open(stem + ".md", "w") as f:
        f.write(report.e2e_markdown(doc))
    print(report.e2e_table(doc))
    print(f"wrote {stem}.json, {stem}.png, {stem}.md", flush=True)
    return 0 if all(r["status"] != "failed" for r in runs) else 1
