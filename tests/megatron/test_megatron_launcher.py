"""The launcher (``python -m megatron_mok.pretrain_gpt``) and the configs, on a CPU-only machine:
arguments parse and validate, the model is built (on the meta device) with the MoK layer, and
the launcher says plainly that training needs a GPU. The same code paths run first on the GPU
machine."""

import contextlib
import glob
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_mok.config import default_training_ring_rows
from megatron_mok.megatron.arg_files import expand_arg_files, read_config_metadata
from megatron_mok.megatron.startup import format_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")
TRAIN = ["--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-4", "--mock-data"]


def test_expand_arg_files(tmp_path):
    inner = tmp_path / "inner.args"
    inner.write_text("--b 2  # a comment\n# a whole-line comment\n--c 'x y'\n")
    outer = tmp_path / "outer.args"
    outer.write_text("--a 1\n@inner.args\n")
    assert expand_arg_files(["--z", f"@{outer}", "--d"]) == ["--z", "--a", "1", "--b", "2", "--c", "x y", "--d"]
    assert read_config_metadata(os.path.join(CONFIGS, "deepseek_v3_nvl72.args")) == \
        {"nodes": 64, "gpus_per_node": 4, "racks": 4}


def _config_files():
    return sorted(p for p in glob.glob(os.path.join(CONFIGS, "*.args"))
                  if os.path.basename(p) not in ("local_no_te.args",) and
                  (p.endswith("_nvl72.args") or p.endswith("_8gpu.args") or "proxy" in p or p.endswith("tiny.args")))


@pytest.mark.parametrize("path", _config_files(), ids=os.path.basename)
def test_config_parses_and_validates_with_mok(path, monkeypatch):
    """Every runnable config passes Megatron's validation and MoK's start-up checks at its
    GPU count (full-size configs at their NVL72 rack size)."""
    import megatron_mok
    from megatron.training.arguments import parse_args, validate_args

    megatron_mok.register()
    meta = read_config_metadata(path)
    world = meta.get("nodes", 0) * meta.get("gpus_per_node", 0) or meta.get("min_gpus", 1)
    extra = []
    if "proxy" in os.path.basename(path):
        extra = ["--num-experts", str(meta["experts_per_gpu"] * world), "--expert-model-parallel-size", str(world)]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setattr(sys, "argv", ["x"] + expand_arg_files([f"@{path}", f"@{CONFIGS}/local_no_te.args"])
                        + TRAIN + extra + ["--moe-token-dispatcher-type", "mok", "--bf16"])
    args = parse_args()
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    assert args.moe_token_dispatcher_type == "mok"
    assert args.num_experts % args.expert_model_parallel_size == 0
    assert args.expert_tensor_parallel_size == 1
    if "experts_per_gpu" in meta:
        assert args.num_experts // args.expert_model_parallel_size == meta["experts_per_gpu"]


def _launch(*flags, nproc=1):
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_mok.pretrain_gpt"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", "29531", "-m", "megatron_mok.pretrain_gpt"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd + ["@configs/local_no_te.args"] + list(flags), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour of the launcher")
@pytest.mark.parametrize("dispatcher,layer", [("mok", "MoKMoELayer"), ("alltoall", "MoELayer")])
def test_launcher_on_cpu_builds_tiny_model_and_says_training_needs_a_gpu(dispatcher, layer):
    # --logging-level 40 (errors only, as Megatron-LM's DeepSeek-V3 script sets it) does not hide
    # which backend each MoE layer runs.
    proc = _launch("@configs/tiny.args", *TRAIN, "--moe-token-dispatcher-type", dispatcher, "--bf16",
                   "--logging-level", "40")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "no CUDA GPU on this machine. Arguments parsed and validated" in proc.stdout
    assert f"2 MoE layers ({layer})" in proc.stdout
    assert "needs CUDA GPUs, so nothing was trained" in proc.stdout
    if dispatcher == "mok":
        for where in ("decoder layer 2", "MTP layer 1"):
            assert (f"> megatron-mok: the MoE of {where} runs the reference backend [--mok-backend auto on cpu: "
                    "the pure-PyTorch reference backend") in proc.stdout
        assert "(bfloat16, cpu, hidden 128, expert FFN 128, 8 experts per rank, top-2)" in proc.stdout
        rows = default_training_ring_rows(tokens=128, topk=2, experts_per_rank=8, tile_rows=128)
        assert proc.stdout.count(f"> megatron-mok: MoK training ring: {rows} rows per MoE layer and micro-batch") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour of the launcher")
def test_launcher_on_cpu_builds_the_deepseek_proxy_on_the_meta_device():
    proc = _launch("@configs/proxy_deepseek_v3.args", *TRAIN, "--num-experts", "8",
                   "--moe-token-dispatcher-type", "mok", "--bf16")
    assert proc.returncode == 1, proc.stderr[-3000:]
    # 3 decoder layers (1 dense, 2 MoE) + the MTP layer: 3 MoK layers; 2.6 billion parameters,
    # none of them allocated.
    assert "3 MoE layers (MoKMoELayer)" in proc.stdout
    # 4096 tokens, top-8, 8 experts; rows of 2 x 7168 + 4 + 4 x 2048 bytes.
    rows = default_training_ring_rows(tokens=4096, topk=8, experts_per_rank=8, tile_rows=128)
    assert (f"MoK training ring: {rows} rows per MoE layer and micro-batch ({format_bytes(rows * 22532)}; "
            f"3 MoE layers: {format_bytes(3 * rows * 22532)} held until their backward)") in proc.stdout
    millions = float(re.search(r"meta device: rank 0 \(pipeline stage 0; TP 1, ETP 1, EP 1, PP 1\): "
                               r"([0-9.]+)M parameters", proc.stdout).group(1))
    assert millions > 2000


def test_training_log_parser_and_comparison():
    from megatron_mok.megatron.training_log import compare_losses, losses, parse_log, summarize_run

    def line(i, loss, ms):
        return (f" [2026-11-29 20:00:00.000000] iteration {i:8d}/{4:8d} | consumed samples: {i:12d} | "
                f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-04 | global batch size:"
                f"     1 | lm loss: {loss:.6E} | mtp_1 loss: 9.000000E+00 | loss scale: 1.0 |")

    no_loss = line(5, 1.0, 50.0).replace("lm loss", "other loss")
    a = losses(parse_log("\n".join([line(1, 10.0, 900.0), "noise", line(2, 9.0, 100.0), line(3, 8.0, 110.0),
                                     line(4, 7.0, 120.0), no_loss]))[1])
    b = losses(parse_log("\n".join([line(1, 10.1, 50.0), line(2, 9.0, 50.0), line(4, 7.0, 50.0)]))[1])
    assert [e.iteration for e in a] == [1, 2, 3, 4] and a[0].lm_loss == 10.0 and a[0].elapsed_ms == 900.0
    assert a[0].global_batch_size == 1
    s = summarize_run(a, tokens_per_iteration=4096, warmup=1)
    assert (s.first_loss, s.last_loss, s.median_ms) == (10.0, 7.0, 110.0)
    assert abs(s.tokens_per_s - 4096 / 0.110) < 1e-6
    count, worst, mean = compare_losses(a, b)
    assert count == 3 and abs(worst - 0.01) < 1e-12 and abs(mean - 0.01 / 3) < 1e-12


def test_loss_curve_verdict_early_points_and_window_means():
    from megatron_mok.megatron.training_log import Iteration, compare_curves

    def run(losses):
        return [Iteration(i + 1, 100.0, lm_loss=loss) for i, loss in enumerate(losses)]

    base = [10.0 / (i + 1) for i in range(10)] + [0.05, 0.8, 0.1, 0.05, 0.4, 0.06, 0.07, 0.5, 0.05, 0.09]
    # Late, small losses that decorrelate (each point off by up to 100%) but keep their mean.
    chaotic = base[:10] + [0.8, 0.05, 0.05, 0.1, 0.06, 0.4, 0.5, 0.07, 0.09, 0.05]
    c = compare_curves(run(base), run(chaotic))
    assert c.early_iterations == 10 and c.early_max_relative == 0.0 and c.windows == 2
    assert abs(c.window_max_shift) < 1e-12 and c.agree()
    # A wrong layer shows in the first iterations.
    wrong_early = [x * (1.05 if i == 2 else 1.0) for i, x in enumerate(base)]
    c = compare_curves(run(base), run(wrong_early))
    assert abs(c.early_max_relative - 0.05) < 1e-12 and not c.agree()
    # A run that stops learning shows in the window means.
    stalled = base[:10] + [1.0] * 10
    c = compare_curves(run(base), run(stalled))
    assert c.window_max_shift > 0.05 and not c.agree()


FAKE_PRETRAIN = '''
"""Prints Megatron's training log for a fake run, and the flags it was given."""
import argparse, os, sys
from megatron_mok.megatron.arg_files import expand_arg_files
p = argparse.ArgumentParser()
for flag in ("--moe-token-dispatcher-type", "--num-layers", "--moe-layer-freq", "--seq-length"):
    p.add_argument(flag)
p.add_argument("--train-iters", type=int)
a, _ = p.parse_known_args(expand_arg_files(sys.argv[1:]))
print("fake argv:", " ".join(sys.argv[1:]))
print("------------------------ arguments ------------------------")
print("  num_layers ...................................... " + a.num_layers)
print("-------------------- end of arguments ---------------------")
step = {"alltoall": 200.0, "mok": 100.0}[a.moe_token_dispatcher_type] * int(a.num_layers)
for i in range(1, a.train_iters + 1):
    print(f" [2026-11-29 12:00:00.000000] iteration {i:8d}/{a.train_iters:8d} | elapsed time per iteration "
          f"(ms): {step:.1f} | global batch size:     1 | lm loss: {10.0 - 0.1 * i:.6E} |")
peak = 1024.0 * int(a.num_layers) + (512.0 if a.moe_token_dispatcher_type == "alltoall" else 0.0)
print(f"[Rank 0] (after {a.train_iters} iterations) memory (MB) | allocated: 100.0 | max allocated: {peak:.2f} "
      f"| reserved: 3000.0 | max reserved: {peak + 1024:.2f}")
'''


def _compare_script(tmp_path, **env):
    launcher = tmp_path / "fake_pretrain.py"
    launcher.write_text(FAKE_PRETRAIN)
    environ = dict(os.environ, PYTHON=sys.executable, NGPUS="1", ITERS="12", LAUNCHER=str(launcher),
                   MOK_LIBRARY=str(tmp_path / "no-library.so"), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    environ.update(env)
    return subprocess.run(["bash", "examples/gpu_pretrain_compare.sh", str(tmp_path / "out")], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=600)


def test_pretrain_comparison_runs_both_proxies_and_summarises_them(tmp_path):
    """examples/gpu_pretrain_compare.sh's plumbing, with a fake launcher: each proxy's flags, its
    logs, the weight estimate that picks the all-moe layer count, the summary and the verdicts."""
    proc = _compare_script(tmp_path, PROXY="all")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # 18 bytes a parameter: the config's 3 layers take 47.3 GB; 1 dense + 3 MoE layers 56.6 GB and
    # a fourth MoE layer would pass 60 GB.
    assert ("=== proxy deepseek-v3: 3 layers (--moe-layer-freq [0]*1+[1]*2) + 1 MTP; weights and optimizer "
            "state ~47.3 GB per GPU (2627903488 parameters x 18 bytes)") in out
    assert ("=== proxy all-moe: 4 layers (1 dense + 3 MoE, the most MoE layers within WEIGHTS_GB=60) + 1 MTP; "
            "weights and optimizer state ~56.6 GB per GPU (3141763072 parameters x 18 bytes)") in out
    for proxy, layers in (("deepseek-v3", None), ("all-moe", "--num-layers 4 --moe-layer-freq [0]*1+[1]*3")):
        for dispatcher in ("alltoall", "mok"):
            log = (tmp_path / "out" / proxy / f"{dispatcher}.log").read_text()
            argv = log.split("fake argv: ", 1)[1].splitlines()[0]
            assert f"--moe-token-dispatcher-type {dispatcher}" in argv and "--log-memory-interval 12" in argv
            assert (layers in argv) if layers else ("--num-layers" not in argv.split("local_no_te.args", 1)[1])
    summary = out.split("=== summary", 1)[1]
    rows = [line.split() for line in summary.splitlines()[1:6]]
    assert rows[0] == ["proxy", "dispatcher", "iterations", "median", "ms", "tokens/s", "peak", "GB",
                       "(alloc/reserved)"]
    # 4096 tokens an iteration; the fake's step is 200 (alltoall) or 100 (mok) ms per layer.
    assert rows[1:] == [["deepseek-v3", "alltoall", "12", "600.0", "6,827", "3.5", "/", "4.5"],
                        ["deepseek-v3", "mok", "12", "300.0", "13,653", "3.0", "/", "4.0"],
                        ["all-moe", "alltoall", "12", "800.0", "5,120", "4.5", "/", "5.5"],
                        ["all-moe", "mok", "12", "400.0", "10,240", "4.0", "/", "5.0"]]
    assert out.count("-> AGREE") == 2 and "=== all-moe: loss curves, alltoall against mok" in out


def test_pretrain_comparison_arguments(tmp_path):
    bad = _compare_script(tmp_path, PROXY="deepseek-v4")
    assert bad.returncode == 2 and "PROXY 'deepseek-v4' is not one of deepseek-v3, all-moe, all" in bad.stderr
    bad = _compare_script(tmp_path, SHARE="yes")
    assert bad.returncode == 2 and "SHARE must be 0 or 1, not 'yes'" in bad.stderr
    # SHARE=1: the run goes through tools/perf/moe_step_share.py (the fake launcher trains nothing),
    # with the same flags; its JSON lands next to the log and its line in the output.
    given = _compare_script(tmp_path, PROXY="all-moe", MOE_LAYERS="6", DISPATCHERS="mok", SHARE="1", SHARE_WARMUP="3")
    assert given.returncode == 0, given.stdout[-3000:] + given.stderr[-3000:]
    assert "=== proxy all-moe: 7 layers (1 dense + 6 MoE) + 1 MTP" in given.stdout
    log = (tmp_path / "out" / "all-moe" / "mok.log").read_text()
    argv = log.split("fake argv: ", 1)[1].splitlines()[0]
    assert "--num-layers 7 --moe-layer-freq [0]*1+[1]*6" in argv and "--share" not in argv
    share = json.loads((tmp_path / "out" / "all-moe" / "mok.share.json").read_text())
    assert share["warmup"] == 3 and share["argv"] == argv.split() and share["launcher_status"] == 0
    assert "all-moe, mok: moe_step_share: MoE layers: no training iteration recorded" in given.stdout
    assert "no alltoall.log and mok.log pair in" in given.stdout
    assert not (tmp_path / "out" / "deepseek-v3").exists()
