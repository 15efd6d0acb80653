"""The MoK demo on a machine without a GPU.

Trains the tiny GPT-MoE of ``configs/tiny.args`` (built through Megatron's own argument parser
and GPT model builder) on 2 CPU processes joined by gloo, expert-parallel size 2, twice from
the same initial weights: once with Megatron's ``alltoall`` MoE layer and once with
``--moe-token-dispatcher-type mok`` (the MoK layer with its pure-PyTorch reference backend).
Both use Megatron's DistributedDataParallel (expert gradients in the expert-data-parallel
buffer) and the same AdamW steps on the same toy-language batches. Prints both loss curves side
by side and how far the weights drifted apart.

    python examples/cpu_demo.py [--steps 30] [--ranks 2]
"""

import argparse
import contextlib
import io
import logging
import os
import socket
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MICRO_BATCH = 2


def megatron_configs(dispatcher: str, ranks: int):
    """(GPTModelConfig, parsed args) of configs/tiny.args for ``dispatcher`` at EP = ranks."""
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    from megatron_mok.megatron import settings_from_args
    from megatron_mok.megatron.arg_files import expand_arg_files

    sys.argv = ["cpu_demo"] + expand_arg_files([
        f"@{ROOT}/configs/tiny.args", f"@{ROOT}/configs/local_no_te.args",
        "--moe-token-dispatcher-type", dispatcher, "--mok-backend", "reference",
        "--expert-model-parallel-size", str(ranks), "--micro-batch-size", str(MICRO_BATCH),
        "--train-iters", "1", "--lr", "3e-3",
    ])
    args = parse_args()
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron prints every argument
        validate_args(args, {})
    model_cfg = gpt_config_from_args(args)
    model_cfg.transformer.use_cpu_initialization = True
    if dispatcher == "mok":
        model_cfg.transformer.mok_settings = settings_from_args(args)
    return model_cfg, args


def toy_batch(rank: int, step: int, seq: int, vocab: int):
    """A toy language: every sequence is an arithmetic progression modulo the vocabulary, so
    the next token is predictable and the loss falls as the model learns."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (MICRO_BATCH, 1), generator=gen)
    stride = torch.randint(1, 8, (MICRO_BATCH, 1), generator=gen)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    tokens, labels = seqs[:, :-1], seqs[:, 1:]
    position_ids = torch.arange(seq).expand(MICRO_BATCH, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    return tokens, position_ids, mask, labels


def train(rank: int, world: int, steps: int):
    """Train both models on this rank; returns the per-step mean losses (rank 0 only)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_mok.megatron import MoKMoELayer

    models, optimizers, ddps = {}, {}, {}
    for dispatcher in ("alltoall", "mok"):
        model_cfg, args = megatron_configs(dispatcher, world)
        torch.manual_seed(1234)
        model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
        if dispatcher == "mok":
            model.load_state_dict(models["alltoall"].state_dict(), strict=True)
            layers = [m for m in model.modules() if isinstance(m, MoKMoELayer)]
            if rank == 0:
                print(f"MoK model: {len(layers)} MoE layers are MoKMoELayer (decoder and MTP), "
                      f"backend '{layers[0].mok_settings.backend}', {layers[0].num_local_experts} experts "
                      f"on each of {world} ranks", flush=True)
        ddps[dispatcher] = DistributedDataParallel(model_cfg.transformer, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, average_in_collective=True), model)
        models[dispatcher] = model
        optimizers[dispatcher] = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    seq, vocab = args.seq_length, args.vocab_size

    history = []
    for step in range(steps):
        tokens, position_ids, mask, labels = toy_batch(rank, step, seq, vocab)
        losses = {}
        for dispatcher, ddp in ddps.items():
            ddp.zero_grad_buffer()
            optimizers[dispatcher].zero_grad(set_to_none=True)
            loss = ddp(tokens, position_ids, mask, labels=labels).mean()
            loss.backward()
            ddp.finish_grad_sync()
            for p in models[dispatcher].parameters():
                p.grad = p.main_grad
            optimizers[dispatcher].step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[dispatcher] = mean.item() / world
        history.append(losses)
        if rank == 0:
            diff = abs(losses["alltoall"] - losses["mok"]) / losses["alltoall"]
            print(f"step {step + 1:3d}  loss alltoall {losses['alltoall']:.6f}  mok {losses['mok']:.6f}  "
                  f"relative difference {diff:.1e}", flush=True)
    drift = max((a - b).abs().max().item() for a, b in
                zip(models["alltoall"].parameters(), models["mok"].parameters()))
    drift_t = torch.tensor([drift])
    dist.all_reduce(drift_t, op=dist.ReduceOp.MAX)
    return history, drift_t.item()


def report(history, drift: float, seconds: float) -> None:
    """Print the verdict; exit non-zero on a mismatch.

    Step 1 starts from identical weights and batches, so the two losses may differ only by
    fp32 round-off (the two layers sum in different orders). Later steps may drift further:
    once round-off flips a near-tied top-k choice for some token, training amplifies it, as it
    would between any two numerically different MoE implementations. A real error shows at
    step 1 already (the tests check every gradient of a step to 2e-5).
    """
    first, last = history[0], history[-1]
    relative = [abs(h["alltoall"] - h["mok"]) / h["alltoall"] for h in history]
    print(f"\n{len(history)} steps in {seconds:.0f} s. Loss alltoall {first['alltoall']:.4f} -> {last['alltoall']:.4f}, "
          f"mok {first['mok']:.4f} -> {last['mok']:.4f}. Relative loss difference at step 1: {relative[0]:.1e}, "
          f"largest over the run: {max(relative):.1e}; largest weight difference after training {drift:.1e}.")
    ok = relative[0] < 1e-5 and max(relative) < 1e-2 and last["mok"] < first["mok"]
    print("RESULT: " + ("the MoK layer trains like Megatron's alltoall layer (same losses up to fp32 round-off)"
                        if ok else "MISMATCH between the MoK layer and Megatron's alltoall layer"))
    if not ok:
        raise SystemExit(1)


def worker(rank: int, world: int, port: int, steps: int) -> None:
    """One gloo rank: Megatron's parallel state on the CPU, both models, the training steps."""
    # Keep the output to the comparison: Megatron warns about every optional package
    # (Transformer Engine, Apex, ...) it does not find and logs every gradient bucket.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    from megatron.core import parallel_state

    import megatron_mok
    from megatron_mok.megatron.cpu_compat import cpu_device_patches, initialize_cpu_model_parallel

    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=timedelta(seconds=300))
    megatron_mok.register()
    try:
        with cpu_device_patches():
            initialize_cpu_model_parallel(expert_parallel=world)
            started = time.time()
            history, drift = train(rank, world, steps)
            parallel_state.destroy_model_parallel()
        if rank == 0:
            report(history, drift, time.time() - started)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """Spawn the ranks; returns 0 when the two layers train alike."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes = expert-parallel size")
    opts = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"Tiny GPT-MoE (configs/tiny.args) on {opts.ranks} CPU ranks (gloo, EP={opts.ranks}): "
          f"Megatron's alltoall MoE layer vs the MoK layer, same weights, same batches.", flush=True)
    try:
        mp.spawn(worker, args=(opts.ranks, port, opts.steps), nprocs=opts.ranks, join=True)
    except mp.ProcessRaisedException as err:
        print(err, file=sys.stderr)
        return 1
    except mp.ProcessExitedException:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
