"""The benchmarks on the CPU: argument handling, floors arithmetic, routing, the all_to_all +
grouped-GEMM baseline, Megatron log parsing, and whole small runs (gloo ranks under torchrun)
that write the JSON, PNG and Markdown outputs."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_mok.bench import __main__ as bench_main
from megatron_mok.bench import e2e, layer, report
from megatron_mok.bench.a2a_baseline import _source_to_expert_order
from megatron_mok.bench.floors import H200, DeviceRates, hbm_bytes, layer_floors, model_flops, rates_with
from megatron_mok.bench.routing import RouteCounts, RoutingError, RoutingSpec, count_routes, make_routing
from megatron_mok.bench.shapes import SHAPES, ShapeError, make_case, resolve_shape
from megatron_mok.bench.timing import slowest_rank_medians
from megatron_mok.config import MegakernelTunables, MoKConfig, MoKConfigError
from megatron_mok.megatron.training_log import LogError, parse_log, summarize

from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400


# ----------------------------------------------------------------------------------------------
# Floors.


def test_floors_by_hand_deepseek_v3_two_gpus():
    """DeepSeek-V3 on 2 GPUs, 4096 tokens each, perfectly balanced routing: every rank computes
    T*K = 32768 rows, half of them from the other rank."""
    H, I, L, T, K = 7168, 2048, 128, 4096, 8
    S = R = T * K
    remote = R // 2
    f = layer_floors(hidden=H, ffn_hidden=I, experts_per_gpu=L, tokens=[T, T], sent=[S, S],
                     received=[R, R], received_remote=[remote, remote], sent_remote=[remote, remote],
                     rates=H200)
    fwd, bwd = f["forward"], f["backward"]
    assert fwd.flops == 6 * 32768 * 7168 * 2048
    assert fwd.compute_ms == pytest.approx(2.8862e12 / 792e12 * 1e3, rel=1e-4)  # 3.644 ms
    weights = 3 * 7168 * 2048 * 2 * 128  # 11.27 GB of bf16 expert weights
    assert fwd.hbm_bytes["weights_read"] == weights
    acts = 2 * (T * H + 2 * R * H + R * 2 * I + 2 * R * I + 2 * S * H + T * H)
    assert sum(fwd.hbm_bytes.values()) == weights + acts
    assert fwd.hbm_ms == pytest.approx((weights + acts) / 4153e9 * 1e3)
    assert fwd.nvlink_bytes == 32768 * 7168 * 2  # 16384 rows in + 16384 out, per direction
    assert fwd.nvlink_ms == pytest.approx(469.76e6 / 370e9 * 1e3, rel=1e-4)  # 1.270 ms
    assert fwd.dispatch_bytes == 16384 * 7168 * 2
    assert fwd.floor_ms == max(fwd.compute_ms, fwd.hbm_ms, fwd.nvlink_ms)
    assert fwd.bound == "compute" and fwd.floor_ms == pytest.approx(3.644, abs=1e-3)
    assert bwd.flops == 2 * fwd.flops
    assert bwd.hbm_bytes["weights_read"] == bwd.hbm_bytes["weight_grads_write"] == weights
    assert bwd.nvlink_bytes == fwd.nvlink_bytes


def test_floors_weight_bound_with_many_experts_and_slowest_rank_counts():
    """Kimi-K2's 384 experts on 2 GPUs are HBM-bound; a rank that receives more rows sets the
    compute floor."""
    H, I, L, T = 7168, 2048, 192, 4096
    f = layer_floors(hidden=H, ffn_hidden=I, experts_per_gpu=L, tokens=[T, T], sent=[32768, 32768],
                     received=[30000, 35536], received_remote=[14000, 19536],
                     sent_remote=[19536, 14000], rates=H200)["forward"]
    assert f.bound == "hbm"
    assert f.flops == 6 * 35536 * H * I
    assert f.hbm_bytes["weights_read"] == 3 * H * I * 2 * 192
    assert f.nvlink_bytes == (14000 + 19536) * H * 2
    assert f.dispatch_bytes == 19536 * H * 2


def test_floors_single_gpu_has_no_nvlink_term_and_rates_override():
    f = layer_floors(hidden=64, ffn_hidden=32, experts_per_gpu=4, tokens=[10], sent=[20],
                     received=[20], received_remote=[0], sent_remote=[0], rates=H200)
    assert f["forward"].nvlink_bytes == 0 and f["forward"].nvlink_ms == 0
    slow = rates_with(H200, gemm_tflops=1.0)
    assert slow.gemm_tflops == 1.0 and slow.hbm_gbps == H200.hbm_gbps and "command line" in slow.source
    with pytest.raises(ValueError, match="gemm_tflops"):
        DeviceRates(gemm_tflops=0, hbm_gbps=1, peer_gbps=1, source="x")
    with pytest.raises(ValueError, match="same non-zero length"):
        layer_floors(hidden=1, ffn_hidden=1, experts_per_gpu=1, tokens=[1, 1], sent=[1], received=[1],
                     received_remote=[0], sent_remote=[0], rates=H200)
    assert model_flops(4096, 8, 7168, 2048) == 6 * 4096 * 8 * 7168 * 2048
    assert hbm_bytes(hidden=2, ffn_hidden=1, experts=1, tokens=1, sent=1, received=1, backward=True)[
        "weight_grads_write"] == 3 * 2 * 1 * 2


# ----------------------------------------------------------------------------------------------
# Shapes, routing, arguments.


def test_named_shapes_and_custom():
    kimi = resolve_shape("Kimi-K2")
    assert (kimi.hidden, kimi.ffn_hidden, kimi.num_experts, kimi.topk) == (7168, 2048, 384, 8)
    assert resolve_shape("deepseek-v3").num_experts == 256
    assert set(SHAPES) == {"kimi-k2", "deepseek-v3", "qwen3-235b", "qwen3-30b-a3b", "glm-4.5"}
    qwen = resolve_shape("qwen3-30b-a3b")
    assert (qwen.name, qwen.hidden, qwen.ffn_hidden, qwen.num_experts, qwen.topk) == ("Qwen3-30B-A3B", 2048, 768, 128, 8)
    custom = resolve_shape("custom", hidden=64, ffn_hidden=32, num_experts=8, topk=2)
    assert custom.name == "custom" and custom.topk == 2
    changed = resolve_shape("kimi-k2", topk=4)
    assert changed.name == "Kimi-K2*" and changed.topk == 4 and changed.hidden == 7168
    with pytest.raises(ShapeError, match="unknown shape 'gpt-5'.*kimi-k2"):
        resolve_shape("gpt-5")
    with pytest.raises(ShapeError, match="--ffn-hidden"):
        resolve_shape("custom", hidden=64, num_experts=8, topk=2)


def test_cases_full_and_per_gpu_counts():
    kimi = resolve_shape("kimi-k2")
    full = make_case(kimi, 2, 4096)
    assert full.experts_per_gpu == 192 and full.full and full.label == "Kimi-K2, 192 exp/GPU"
    six = make_case(kimi, 2, 4096, 6)
    assert six.num_experts == 12 and not six.full
    with pytest.raises(ShapeError, match="fewer than top-k=8"):
        make_case(kimi, 1, 4096, 6)
    with pytest.raises(ShapeError, match="not divisible by 5 GPUs"):
        make_case(kimi, 5, 4096)
    assert layer.parse_experts_per_gpu(["full", "6", "ep=2", "6"]) == [None, 6, ("ep", 2)]
    assert layer.experts_per_gpu_for(kimi, ("ep", 64)) == 6
    with pytest.raises(ShapeError, match="do not split into 5"):
        layer.experts_per_gpu_for(kimi, ("ep", 5))
    with pytest.raises(ShapeError, match="'zero'"):
        layer.parse_experts_per_gpu(["zero"])


@pytest.mark.parametrize("kind", ["uniform", "zipf", "hot"])
def test_routing_distinct_experts_and_normalised_weights(kind):
    spec = RoutingSpec(kind, zipf_s=1.5, hot_fraction=0.5)
    ids, w = make_routing(spec, 2000, 16, 4, seed=3, device=torch.device("cpu"))
    assert ids.dtype == torch.int64 and ids.shape == (2000, 4) and w.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < 16
    assert all(len(set(row)) == 4 for row in ids.tolist())
    assert torch.allclose(w.sum(1), torch.ones(2000)) and bool((w > 0).all())
    load = torch.bincount(ids.reshape(-1), minlength=16).double()
    if kind == "uniform":
        assert load.max() / load.mean() < 1.3
    elif kind == "zipf":
        assert load.max() / load.mean() > 1.8
    else:
        hot_tokens = int((ids == 0).any(1).sum())
        assert 900 < hot_tokens < 1100  # half the tokens pick the hot expert


def test_routing_rejects_bad_parameters():
    with pytest.raises(RoutingError, match="'skewed'"):
        RoutingSpec("skewed")
    with pytest.raises(RoutingError, match="--hot-fraction 1.5"):
        RoutingSpec("hot", hot_fraction=1.5)
    with pytest.raises(RoutingError, match="--zipf-s"):
        RoutingSpec("zipf", zipf_s=0)


def test_route_counts_single_rank():
    ids = torch.tensor([[0, 1], [1, 3], [2, -1]])
    counts = count_routes(ids, experts_per_rank=4, ep_size=1)
    assert counts.matrix.tolist() == [[5]]
    assert counts.expert_load.tolist() == [1, 2, 1, 1]
    assert counts.received_remote == [0] and counts.sent == [5]
    two = RouteCounts(matrix=torch.tensor([[3, 5], [7, 2]]), expert_load=torch.tensor([1]))
    assert two.received == [10, 7] and two.received_remote == [7, 5] and two.sent_remote == [5, 7]


def _layer_error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        layer.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_layer_argument_errors_are_clear(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "unknown shape 'nope'" in _layer_error(capsys, ["--shape", "nope"])
    assert "fewer than top-k=8" in _layer_error(capsys, ["--shape", "kimi-k2", "--experts-per-gpu", "6"])
    assert "unknown ['fast']" in _layer_error(capsys, ["--backends", "a2a-grouped-mm,fast", "--device", "cpu"])
    assert "--iters 0 must be >= 1" in _layer_error(capsys, ["--iters", "0"])
    assert "invalid choice: 'skewed'" in _layer_error(capsys, ["--routing", "skewed"])
    assert "--ffn-hidden" in _layer_error(capsys, ["--shape", "custom", "--hidden", "64"])


def test_bench_entry_point(capsys, monkeypatch):
    assert bench_main.main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err
    monkeypatch.setitem(bench_main.SUBCOMMANDS, "gemm", ("megatron_mok.bench.no_such_module", "x"))
    assert bench_main.main(["gemm"]) == 2
    assert "needs megatron_mok.bench.no_such_module, which is not part of this installation" in capsys.readouterr().err
    assert bench_main.main([]) == 2


# ----------------------------------------------------------------------------------------------
# The baseline's regrouping and the slowest-rank statistics.


def test_source_to_expert_order():
    # Rows arrive grouped by (source rank, local expert): s0e0 x2, s0e1 x1, s1e0 x1, s1e1 x3.
    recv = torch.tensor([[2, 1], [1, 3]])
    order = _source_to_expert_order(recv).tolist()
    # Expert-major: e0 <- s0 rows 0,1 then s1 row 3; e1 <- s0 row 2 then s1 rows 4,5,6.
    assert order == [0, 1, 3, 2, 4, 5, 6]
    assert _source_to_expert_order(torch.zeros(2, 3, dtype=torch.int64)).numel() == 0


def _slowest_rank(rank, world):
    samples = {"forward": [1.0 + rank, 5.0 + rank, 2.0 + rank], "backward": [10.0 * (world - rank)]}
    out = slowest_rank_medians(samples, dist.group.WORLD, torch.device("cpu"))
    assert out["forward"]["per_rank_ms"] == [2.0, 3.0]
    assert out["forward"]["ms"] == 3.0
    assert out["backward"]["ms"] == 20.0


def test_slowest_rank_median_over_gloo():
    run_ranks(_slowest_rank, 2)


# ----------------------------------------------------------------------------------------------
# A whole layer run on two gloo ranks.


def test_layer_run_on_gloo_writes_checked_results(tmp_path):
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "megatron_mok.bench", "layer", "--shape", "custom", "--hidden", "64",
           "--ffn-hidden", "32", "--num-experts", "8", "--topk", "2", "--tokens", "48",
           "--experts-per-gpu", "full", "2", "--warmup", "1", "--iters", "2", "--check-tokens", "16",
           "--backends", "mok-cuda,a2a-grouped-mm,megatron-alltoall,reference", "--device", "cpu",
           "--out", str(out), "--name", "small"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== custom, 4 exp/GPU | 48 tokens/GPU | 2 GPU(s)" in proc.stdout
    # Megatron's own layer runs on the CPU too (gloo, Megatron's CPU stand-ins), with the experts
    # users run where there is no Transformer Engine.
    assert re.search(r"megatron-alltoall \[SequentialMLP\] +[0-9.]+ ", proc.stdout), proc.stdout
    # Progress on rank 0: case, backend, phase, iteration counts.
    assert ("[layer] custom, 4 exp/GPU, 48 tokens/GPU (case 1/2) | megatron-alltoall (3/4): checking against the "
            "reference on 16 tokens/GPU") in proc.stdout
    assert "| megatron-alltoall (3/4): timed iteration 2/2 done" in proc.stdout
    assert "mok-cuda" in proc.stdout and "skipped: backend='cuda' cannot run" in proc.stdout

    doc = json.loads((out / "small.json").read_text())
    assert doc["schema"] == "megatron-mok/bench-layer/1"
    assert doc["rates"]["gemm_tflops"] == 792.0 and "measured on an H200" in doc["rates"]["source"]
    assert doc["command"].startswith("torchrun --nproc-per-node 2 -m megatron_mok.bench layer")
    assert doc["settings"]["tile_rows"] == 128
    assert [r["label"] for r in doc["runs"]] == ["custom, 4 exp/GPU", "custom, 2 exp/GPU"]
    for run in doc["runs"]:
        case, routes = run["case"], run["routes"]
        L = case["experts_per_gpu"]
        assert case["num_experts"] == 2 * L and case["tokens_per_gpu"] == 48
        assert routes["sent"] == [96, 96] and sum(routes["received"]) == 192
        # The floors in the file are those of the route counts in the file.
        want = layer_floors(hidden=64, ffn_hidden=32, experts_per_gpu=L, tokens=[48, 48],
                            sent=routes["sent"], received=routes["received"],
                            received_remote=routes["received_remote"],
                            sent_remote=routes["sent_remote"], rates=H200)
        for name in ("forward", "backward"):
            got = run["floors"][name]
            assert got["floor_ms"] == pytest.approx(want[name].floor_ms)
            assert got["bound"] == want[name].bound
        assert run["floors"]["forward"]["flops"] == 6 * max(routes["received"]) * 64 * 32
        assert run["floors"]["forward"]["nvlink_bytes"] == max(
            (a + b) * 64 * 2 for a, b in zip(routes["received_remote"], routes["sent_remote"]))
        assert run["model_flops_forward"] == 6 * 48 * 2 * 64 * 32
        need = run["routed_rows_need"]
        assert need["rows_per_rank"] == routes["received"] and need["bytes_per_row"] == 2 * 64 + 4 + 4 * 32
        assert need["mib"] == pytest.approx(max(routes["received"]) * need["bytes_per_row"] / 2 ** 20)

        results = {r["backend"]: r for r in run["results"]}
        assert list(results) == ["mok-cuda", "a2a-grouped-mm", "megatron-alltoall", "reference"]
        assert results["mok-cuda"]["status"] == "skipped"
        megatron = results["megatron-alltoall"]
        assert megatron["status"] == "ok" and megatron["expert_module"] == "SequentialMLP", megatron
        assert megatron["check"]["passed"]
        base = results["a2a-grouped-mm"]
        assert base["status"] == "ok", base
        check = base["check"]
        assert check["passed"] and check["mode"] == "token-slice" and check["tokens_per_gpu"] == 16
        assert set(check["rel_errors"]) == {"y", "x", "topk_weights", "fc1_weight", "fc2_weight"}
        assert all(0 < e < 2e-2 for e in check["rel_errors"].values())
        assert base["forward_ms"] == max(base["forward_per_rank_ms"]) > 0
        assert base["forward_tflops"] == pytest.approx(run["model_flops_forward"] / (base["forward_ms"] * 1e-3) / 1e12)
        assert base["backward_tflops"] == pytest.approx(2 * run["model_flops_forward"] / (base["backward_ms"] * 1e-3) / 1e12)
        assert base["forward_vs_floor"] == pytest.approx(base["forward_ms"] / run["floors"]["forward"]["floor_ms"])
        assert set(base["forward_phases_ms"]) == {"dispatch", "experts", "combine"}
        assert "activation_mib" not in base  # measured on GPUs only
        assert results["reference"]["status"] == "ok" and results["reference"]["check"]["oracle"]

    _assert_png(out / "small.png")
    md = (out / "small.md").read_text()
    assert "| backend | fwd ms |" in md and "| a2a-grouped-mm |" in md and "forward floor" in md
    assert "| act MiB |" in md and "routed-rows need" in md


def test_layer_chart_with_skipped_backend_and_floor(tmp_path):
    doc = {
        "machine": {"gpu": "NVIDIA H200"}, "settings": {"routing_label": "uniform"},
        "runs": [{
            "label": "Kimi-K2, 192 exp/GPU", "case": {"tokens_per_gpu": 4096, "ep_size": 2},
            "floors": {"forward": {"floor_ms": 4.9}, "backward": {"floor_ms": 9.8}},
            "results": [
                {"backend": "a2a-grouped-mm", "status": "ok", "forward_ms": 14.3, "backward_ms": 30.0},
                {"backend": "megatron-flex-deepep", "status": "skipped", "reason": "no deep_ep"},
                {"backend": "mok-megakernel", "status": "ok", "forward_ms": 6.0, "backward_ms": 12.0},
            ]}],
    }
    path = tmp_path / "chart.png"
    report.layer_chart(doc, str(path))
    _assert_png(path)


# ----------------------------------------------------------------------------------------------
# Activation memory (measured on GPUs; its arithmetic and reporting checked here).


class _ScriptedProbe:
    """Allocator figures for the CPU: ``before`` bytes allocated, a peak ``rise`` above it, and
    ``events`` as the recorded allocations and frees."""

    def __init__(self, before: int, rise: int, events=()):
        self.before, self.rise, self.events, self.calls = before, rise, list(events), []

    def start_events(self):
        self.calls.append("start")

    def stop_events(self):
        self.calls.append("stop")
        return self.events

    def reset_peak(self):
        self.calls.append("reset")

    def allocated(self):
        self.calls.append("allocated")
        return self.before

    def peak(self):
        self.calls.append("peak")
        return self.before + self.rise

    def synchronize(self):
        pass


def test_working_peak_leaves_out_the_returned_gradients_from_their_allocation_on():
    wp = layer.working_peak
    # kept rows (a), an operand (b) freed, then a gradient placeholder (g): the operand's peak
    # stands; peak - gradients (180 - 80) would say 100.
    assert wp([("alloc", 1, 100), ("alloc", 2, 60), ("free", 2, 60), ("alloc", 3, 80)], {3}) == 160
    # a gradient allocated before the operand and alive to the end: peak - gradients (140 - 80).
    assert wp([("alloc", 3, 80), ("alloc", 2, 60), ("free", 2, 60)], {3}) == 60
    # an earlier allocation at a gradient's address is the call's own (only the last is returned).
    assert wp([("alloc", 7, 10), ("free", 7, 10), ("alloc", 7, 20)], {7}) == 10
    # frees of memory allocated before the count started lower it, as in the allocator's figures.
    assert wp([("free", 9, 50), ("alloc", 1, 70)], set()) == 20
    assert wp([], set()) == 0


def test_layer_tile_rows_reach_the_mok_config_and_the_record():
    """--tile-rows (128 by default, or 64) is the MoK runners' MoKConfig.tile_rows; other values
    are refused by the parser (the JSON record: test_layer_run_on_gloo_writes_checked_results)."""
    parser = layer.build_parser()
    assert parser.parse_args([]).tile_rows == 128
    assert parser.parse_args(["--tile-rows", "64"]).tile_rows == 64
    with pytest.raises(SystemExit):
        parser.parse_args(["--tile-rows", "96"])
    fc1, fc2 = layer.random_weights(4, 32, 16, seed=3, device=torch.device("cpu"))
    experts = layer.Experts(fc1_weight=fc1, fc2_weight=fc2, num_experts=4, group=None)
    assert layer.make_runner("reference", experts, 2, 24).config.tile_rows == 128
    assert layer.make_runner("reference", experts, 2, 24, tile_rows=64).config.tile_rows == 64


def test_activation_memory_is_the_working_peak_without_the_returned_gradients():
    T, H, I, L, K = 24, 32, 16, 4, 2
    fc1, fc2 = layer.random_weights(L, H, I, seed=3, device=torch.device("cpu"))
    experts = layer.Experts(fc1_weight=fc1, fc2_weight=fc2, num_experts=L, group=None)
    case = layer.BenchCase(shape=resolve_shape("custom", hidden=H, ffn_hidden=I, num_experts=L, topk=K),
                           ep_size=1, experts_per_gpu=L, tokens_per_gpu=T)
    batch = layer.make_batch(case, RoutingSpec("uniform"), seed=5, device=torch.device("cpu"))
    runner = layer.make_runner("reference", experts, K, T)
    probe = _ScriptedProbe(before=10 ** 6, rise=10 ** 5, events=[("alloc", 1, 700), ("alloc", 2, 300), ("free", 2, 300)])
    got = layer.measure_memory(runner, batch, probe)
    # dx bf16 [T, H], d router weights fp32 [T, K], d fc1 bf16 [L, 2I, H], d fc2 bf16 [L, H, I].
    grads = T * H * 2 + T * K * 4 + L * 2 * I * H * 2 + L * H * I * 2
    assert got == {"peak_bytes": 10 ** 5, "grad_bytes": grads, "activation_bytes": 1000}
    # the peak restarts and the recording starts before the forward
    assert probe.calls == ["reset", "allocated", "start", "stop", "peak"]
    assert all(t.grad is None for t in (batch.x, batch.topk_weights, fc1, fc2))  # left zeroed
    # A gradient storage that existed before the forward is not the backward's; views count once.
    buffer, other = torch.zeros(100), torch.zeros(3, dtype=torch.bfloat16)
    assert layer._storages([buffer[:10], buffer[10:], other]) == {
        buffer.untyped_storage().data_ptr(): 400, other.untyped_storage().data_ptr(): 6}


    class KeepsDx(type(runner)):
        """Zeroes dx in place instead of dropping it, as a gradient buffer that outlives the step."""

        def zero_grad(self, batch):
            dx = batch.x.grad
            super().zero_grad(batch)
            batch.x.grad = torch.zeros_like(batch.x) if dx is None else dx.zero_()

    keeps = KeepsDx("reference", experts, T)
    keeps.zero_grad(batch)
    kept = layer.measure_memory(keeps, batch, _ScriptedProbe(before=0, rise=10 ** 5))
    assert kept["grad_bytes"] == grads - T * H * 2


def test_routed_rows_need_and_memory_fields():
    need = layer.routed_rows_need([32768, 30000], hidden=7168, ffn_hidden=2048)
    per_row = 2 * 7168 + 4 + 4 * 2048
    assert need["bytes_per_row"] == per_row
    assert need["rows_per_rank"] == [32768, 30000] and need["bytes_per_rank"] == [32768 * per_row, 30000 * per_row]
    assert need["mib"] == pytest.approx(32768 * per_row / 2 ** 20)
    env = layer.Dist(group=None, rank=0, world=1, device=torch.device("cpu"))
    mine = {"peak_bytes": 900 * 2 ** 20, "grad_bytes": 100 * 2 ** 20, "activation_bytes": 800 * 2 ** 20}
    fields = layer.memory_result(mine, [400 * 2 ** 20], env)
    assert fields == {"peak_mib": 900.0, "grads_mib": 100.0, "activation_mib": 800.0,
                      "activation_per_rank_mib": [800.0], "activation_vs_need": 2.0}
    assert layer.memory_result(mine, [0], env)["activation_vs_need"] is None


def _memory_run():
    return {
        "label": "Kimi-K2, 48 exp/GPU",
        "case": {"tokens_per_gpu": 4096, "ep_size": 1, "num_experts": 48,
                 "shape": {"topk": 8, "hidden": 7168, "ffn_hidden": 2048}},
        "routing_label": "uniform",
        "floors": {name: {"floor_ms": f, "bound": "compute", "compute_ms": f, "hbm_ms": 1.0, "nvlink_ms": 0.0}
                   for name, f in (("forward", 3.6), ("backward", 7.3))},
        "routed_rows_need": {"bytes_per_row": 22532, "rows_per_rank": [32768], "bytes_per_rank": [32768 * 22532],
                             "mib": 32768 * 22532 / 2 ** 20},
        "results": [
            {"backend": "mok-megakernel", "status": "ok", "forward_ms": 5.7, "backward_ms": 10.5,
             "forward_tflops": 500.0, "backward_tflops": 540.0, "forward_vs_floor": 1.6, "backward_vs_floor": 1.4,
             "comm_GBps": {"forward": None}, "peak_mib": 2100.0, "grads_mib": 700.0, "activation_mib": 1400.0,
             "activation_per_rank_mib": [1400.0], "activation_vs_need": 1400.0 / (32768 * 22532 / 2 ** 20),
             "check": {"passed": True, "rel_errors": {"y": 4e-3}}},
            {"backend": "a2a-grouped-mm", "status": "ok", "forward_ms": 10.0, "backward_ms": 14.0,
             "forward_tflops": 280.0, "backward_tflops": 400.0, "forward_vs_floor": 2.8, "backward_vs_floor": 1.9,
             "comm_GBps": {"forward": None}, "check": {"passed": True, "rel_errors": {"y": 5e-3}}},
        ]}


def test_layer_table_markdown_and_chart_show_the_activation_memory(tmp_path):
    run = _memory_run()
    table = report.layer_table(run)
    header, megakernel, a2a = table.splitlines()[1:4]
    assert "peak MiB" in header and "act MiB" in header and "act/need" in header
    assert re.search(r"mok-megakernel .* 2100 +1400 +1\.99 +4\.0e-03$", megakernel), megakernel
    assert re.search(r"a2a-grouped-mm .* - +- +- +5\.0e-03$", a2a), a2a  # not measured: no GPU memory figures
    assert table.splitlines()[-1] == ("routed-rows need 704 MiB (32768 routed rows on the largest rank x 22532 "
                                      "bytes: x, router weight, gate|up)")
    doc = {"date_utc": "now", "machine": {"description": "one H200", "gpu": "NVIDIA H200"}, "command": "x",
           "settings": {"routing_label": "uniform"}, "runs": [run]}
    md = report.layer_markdown(doc)
    assert "| peak MiB | act MiB | act/need |" in md and "routed-rows need 704 MiB" in md
    path = tmp_path / "memory.png"
    report.layer_chart(doc, str(path))
    _assert_png(path)
    import matplotlib.image as mpimg

    wide, narrow = mpimg.imread(str(path)), None
    del run["results"][0]["activation_mib"]
    report.layer_chart(doc, str(tmp_path / "timing.png"))
    narrow = mpimg.imread(str(tmp_path / "timing.png"))
    assert wide.shape[1] > narrow.shape[1]  # the memory panel is there only when memory was measured


# ----------------------------------------------------------------------------------------------
# The end-to-end comparison.

MEGATRON_LINE = (" [2026-11-29 12:00:00.000000] iteration {it:8d}/{n:8d} | consumed samples: {cs:12d} | "
                 "elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | "
                 "learning rate: 1.000000E-04 | global batch size: {gbs:5d} | lm loss: {loss:.6E} | "
                 "loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | "
                 "number of nan iterations:   0 |")


def _args_block(**values):
    lines = ["------------------------ arguments ------------------------"]
    for k, v in sorted(values.items()):
        lines.append("  {} {} {}".format(k, "." * (48 - len(k)), v))
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def test_parse_megatron_log_and_tokens_per_second():
    text = "\n".join([
        "noise before",
        _args_block(seq_length=4096, world_size=2, moe_token_dispatcher_type="alltoall",
                    global_batch_size=8),
        *[MEGATRON_LINE.format(it=i, n=5, cs=8 * i, ms=ms, tf=100.0 + i, gbs=8, loss=10.0 - i)
          for i, ms in enumerate([3000.0, 1000.0, 1100.0, 900.0, 1000.0], start=1)],
    ])
    args, its = parse_log(text)
    assert args["seq_length"] == "4096" and args["moe_token_dispatcher_type"] == "alltoall"
    assert [it.iteration for it in its] == [1, 2, 3, 4, 5]
    assert its[0].elapsed_ms == 3000.0 and its[2].tflops_per_gpu == 103.0 and its[4].lm_loss == 5.0
    s = summarize(args, its, skip=1)
    assert s["step_ms"] == 1000.0 and s["iterations_measured"] == 4
    assert s["tokens_per_s_per_gpu"] == pytest.approx(8 * 4096 / 1.0 / 2)
    assert s["tflops_per_gpu"] == pytest.approx(103.5) and s["lm_loss_last"] == 5.0
    with pytest.raises(LogError, match="no logged iteration after the first 5"):
        summarize(args, its, skip=5)
    with pytest.raises(LogError, match="seq_length"):
        summarize({"world_size": "2"}, its, skip=1)


FAKE_LAUNCHER = textwrap.dedent('''
    """Prints Megatron's training log for a fake run (test fixture of the e2e comparison)."""
    import argparse, os, sys
    p = argparse.ArgumentParser()
    p.add_argument("--moe-token-dispatcher-type"); p.add_argument("--mok-backend")
    p.add_argument("--train-iters", type=int); p.add_argument("--log-interval", type=int)
    p.add_argument("--eval-iters", type=int); p.add_argument("--log-throughput", action="store_true")
    p.add_argument("--seq-length", type=int); p.add_argument("--global-batch-size", type=int)
    a, _ = p.parse_known_args()
    if a.moe_token_dispatcher_type == "allgather":
        sys.exit("RuntimeError: allgather is broken in this fake")
    if int(os.environ["RANK"]) == 0:
        print("------------------------ arguments ------------------------")
        for k, v in (("moe_token_dispatcher_type", a.moe_token_dispatcher_type),
                     ("seq_length", a.seq_length), ("world_size", os.environ["WORLD_SIZE"])):
            print("  {} {} {}".format(k, "." * (48 - len(k)), v))
        print("-------------------- end of arguments ---------------------")
        step = {"alltoall": 200.0, "mok": 100.0}[a.moe_token_dispatcher_type]
        for i in range(1, a.train_iters + 1):
            ms = step * (5 if i == 1 else 1) + i % 2
            print(f" [2026-11-29 12:00:00.000000] iteration {i:8d}/{a.train_iters:8d} | elapsed time "
                  f"per iteration (ms): {ms:.1f} | global batch size: {a.global_batch_size:5d} | "
                  f"lm loss: {9.0 - i * 0.5:.6E} |")
            if i in (1, a.train_iters):
                peak = {"alltoall": 2048.0, "mok": 1024.0}[a.moe_token_dispatcher_type] * (2 if i > 1 else 1)
                print(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: 100.0 | max allocated: "
                      f"{peak:.2f} | reserved: 3000.0 | max reserved: {peak + 512:.2f}")
''')


def test_e2e_with_a_fake_launcher(tmp_path, capsys):
    launcher = tmp_path / "fake_pretrain.py"
    launcher.write_text(FAKE_LAUNCHER)
    defaults = tmp_path / "defaults.args"
    defaults.write_text("--seq-length 128 --global-batch-size 16  # sequences\n")
    args_file = tmp_path / "proxy.args"
    args_file.write_text("# proxy model: a later file wins\n#@ experts_per_gpu=8\n--seq-length 256\n")
    out = tmp_path / "e2e"
    old = dict(os.environ)
    os.environ.update({k: v for k, v in _env().items() if k in ("PYTHONPATH", "OMP_NUM_THREADS")})
    try:
        code = e2e.main(["--launcher", str(launcher), "--nproc-per-node", "2", "--iters", "5",
                         "--skip-iters", "1", "--dispatchers", "alltoall,mok:cuda,flex-deepep,allgather",
                         "--args-file", str(defaults), "--args-file", str(args_file), "--out", str(out),
                         "--no-throughput"])
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert code == 1  # the allgather run failed
    printed = capsys.readouterr().out
    assert "[e2e] flex-deepep (3/4): skipped: DeepEP is not installed" in printed
    assert "[e2e] mok (cuda) (2/4): training iteration 5/5 done, 101.0 ms, lm loss 6.5000" in printed
    assert "[e2e] mok (cuda) (2/4): done: step 100.5 ms" in printed and "peak memory 2.0 GB allocated" in printed
    doc = json.loads((out / "e2e.json").read_text())
    assert doc["schema"] == "megatron-mok/bench-e2e/1"
    assert doc["settings"]["launcher_args"] == ["--seq-length", "128", "--global-batch-size", "16",
                                                "--seq-length", "256"]
    assert doc["settings"]["config_label"] == "proxy.args"
    runs = {r["dispatcher"]: r for r in doc["runs"]}
    a2a, mok = runs["alltoall"], runs["mok:cuda"]
    assert a2a["status"] == mok["status"] == "ok"
    assert "--moe-token-dispatcher-type mok --mok-backend cuda" in mok["command"]
    assert "--train-iters 5 --log-interval 1 --eval-iters 0 --eval-interval 6" in mok["command"]
    assert "--log-memory-interval 5" in mok["command"]
    assert a2a["memory"] == {"max_allocated_mb": 4096.0, "max_reserved_mb": 4608.0, "ranks": [0]}
    assert mok["loss_curve"] == [[i, 9.0 - i * 0.5] for i in range(1, 6)]
    assert a2a["step_ms_per_iteration"] == [200.0, 201.0, 200.0, 201.0]
    assert a2a["step_ms"] == 200.5 and mok["step_ms"] == 100.5
    assert a2a["tokens_per_s_per_gpu"] == pytest.approx(16 * 256 / 0.2005 / 2)
    assert mok["lm_loss_last"] == 6.5 and a2a["world_size"] == 2
    assert runs["flex-deepep"]["status"] == "skipped"
    assert runs["allgather"]["status"] == "failed" and "allgather is broken" in runs["allgather"]["reason"]
    assert Path(a2a["log"]).exists()
    _assert_png(out / "e2e.png")
    md = (out / "e2e.md").read_text()
    # Both fake ranks print the error; their stderr may interleave within a line, so only the
    # start of the reason is fixed.
    assert "| mok (cuda) | 100.5 |" in md and "| 2.0 / 2.5 |" in md and "peak GB (alloc/reserved)" in md
    assert "| allgather | failed: exit status 1: RuntimeError: allgather is broken in this fake" in md


def test_e2e_argument_errors(capsys):
    for argv, message in ((["--dispatchers", "mok:fast"], "only mok takes a backend"),
                          (["--dispatchers", "alltoall,alltoall"], "names a dispatcher twice"),
                          (["--iters", "3", "--skip-iters", "3"], "0 <= skip-iters < iters"),
                          (["--launcher", "/no/such/pretrain.py"], "does not exist"),
                          (["--args-file", "/no/such/file"], "cannot be read")):
        with pytest.raises(SystemExit) as exc:
            e2e.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the tune command (its GPU run is in docs/megakernel.md) ---------------------------------

def test_tune_candidates_parse_and_name_bad_input():
    from megatron_mok.bench.tune import Candidate

    assert Candidate.parse("16:2048:8192") == Candidate(16, 2048, 8192)
    assert Candidate.parse("::") == Candidate(None, None, None)
    assert Candidate.parse("12::") == Candidate(12, None, None)
    assert Candidate.parse("10:2048:8192:off") == Candidate(10, 2048, 8192, pairs=False)
    assert Candidate.parse("10:::on").pairs is True and Candidate.parse("10:::auto").pairs is None
    assert Candidate.parse("::::16") == Candidate(None, None, None, group_blocks=16)
    assert Candidate.parse("8:1024:4096:off:4") == Candidate(8, 1024, 4096, pairs=False, group_blocks=4)
    assert Candidate.parse(str(Candidate(8, None, 4096, pairs=True, group_blocks=16))) == \
        Candidate(8, None, 4096, pairs=True, group_blocks=16)
    cfg = Candidate.parse("10:::on:16").config(MoKConfig(max_tokens_per_rank=64, timeout_s=5.0))
    assert cfg.megakernel == MegakernelTunables(pairs=True, group_blocks=16)
    assert (cfg.comm_sms_forward, cfg.max_tokens_per_rank, cfg.timeout_s) == (10, 64, 5.0)
    assert Candidate.parse("::").config(MoKConfig()).megakernel == MegakernelTunables()
    with pytest.raises(ValueError, match="must be COMM:MINIBATCH:RING"):
        Candidate.parse("16:2048")
    with pytest.raises(ValueError, match="must be COMM:MINIBATCH:RING"):
        Candidate.parse("1:2:3:on:8:9")
    with pytest.raises(ValueError, match="must be integers or empty"):
        Candidate.parse("a:b:c")
    with pytest.raises(ValueError, match="must be integers or empty"):
        Candidate.parse("::::big")
    with pytest.raises(ValueError, match="PAIRS must be on, off, auto or empty"):
        Candidate.parse("10:::yes")
    with pytest.raises(MoKConfigError, match="group_blocks=3"):  # the config's rule, when it is built
        Candidate.parse("::::3").config(MoKConfig())


def test_tune_default_candidates_try_each_tunable_the_other_way():
    from megatron_mok.bench.tune import default_candidates

    for default_pairs in (True, False):
        cands = default_candidates(2048, default_pairs)
        assert [c.comm_sms for c in cands] == [4, 6, 8, 10, 8, 8, 8]
        assert all(c.ring_rows == 4 * c.minibatch_rows for c in cands)
        assert [c.minibatch_rows for c in cands] == [2048] * 4 + [4096, 2048, 2048]
        # The defaults for all but two: pair mode the other way, then groups of 16.
        assert [c.pairs for c in cands] == [None] * 5 + [not default_pairs, None]
        assert [c.group_blocks for c in cands] == [None] * 6 + [16]
    assert default_candidates(2048, True, default_group_blocks=16)[-1].group_blocks == 8
    # In the weight-bound regime the default is 6 comm SMs (4 without grad); the last three
    # candidates follow it.
    assert [c.comm_sms for c in default_candidates(2048, True, 6)] == [4, 6, 8, 10, 6, 6, 6]
    assert [c.comm_sms for c in default_candidates(2048, True, 4)] == [4, 6, 8, 10, 4, 4, 4]


def test_tune_args_file_holds_the_winner_as_megatron_flags(tmp_path):
    from megatron_mok.bench.tune import args_file_text, describe

    best = MoKConfig(comm_sms_forward=16, minibatch_rows=2048, ring_rows=8192,
                     megakernel=MegakernelTunables(pairs=False, group_blocks=16))
    assert describe(best) == "comm 16, minibatch 2048, ring 8192, pairs asked off, group blocks 16"
    text = args_file_text(best, ["Kimi-K2: 5.4 ms", "  comm 16: 5.4 ms"])
    flags = [line for line in text.splitlines() if not line.startswith("#")]
    assert flags == ["--mok-comm-sms-forward 16", "--mok-minibatch-rows 2048", "--mok-ring-rows 8192",
                     "--mok-megakernel-pairs off", "--mok-megakernel-group-blocks 16"]
    assert "# Kimi-K2: 5.4 ms" in text
    on = args_file_text(dataclasses.replace(best, megakernel=MegakernelTunables(pairs=True)), [])
    assert on.splitlines()[-1] == "--mok-megakernel-pairs on"  # a field left None writes no flag
    # The launcher's argument parser takes the flags (megatron_mok.megatron.arguments).
    import argparse

    from megatron_mok.megatron.arguments import add_mok_arguments, settings_from_args
    parser = add_mok_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(" ".join(flags).split())
    assert (ns.mok_comm_sms_forward, ns.mok_minibatch_rows, ns.mok_ring_rows) == (16, 2048, 8192)
    assert settings_from_args(ns).config.megakernel == MegakernelTunables(pairs=False, group_blocks=16)


def test_tune_without_a_gpu_says_so(capsys, monkeypatch):
    from megatron_mok.bench import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--shape", "kimi-k2", "--experts-per-gpu", "6"]) == 2
    assert "needs an sm_90 GPU" in capsys.readouterr().out
    assert tune.main(["--candidates", "1:2"]) == 2
    assert "must be COMM:MINIBATCH:RING" in capsys.readouterr().out
    assert tune.main(["--candidates", "::::x"]) == 2
    assert "must be integers or empty" in capsys.readouterr().out


def test_performance_experiments_are_not_part_of_the_package():
    """The A/B statistics and the one-off instruments live in tools/perf, outside the package:
    the benchmarks' timing module keeps the stopwatch, the ranks' alignment and the slowest
    rank's median."""
    from megatron_mok.bench import timing

    assert {"Stopwatch", "align_ranks", "slowest_rank_medians", "gather_floats", "median"} <= set(vars(timing))
    for name in ("interleaved_rounds", "block_rounds", "back_to_back_rounds", "BLOCK_ORDER",
                 "position_corrected", "blocks_by_position", "b_minus_a", "hold_stream"):
        assert not hasattr(timing, name), name
    assert not (ROOT / "tools" / "perf" / "__init__.py").exists()
    assert not (ROOT / "tools" / "__init__.py").exists()


# ----------------------------------------------------------------------------------------------
# Progress, the Megatron baseline at one process, its expert module.


def test_progress_lines_iteration_counts_and_heartbeat():
    from megatron_mok.bench.progress import Progress

    now = [0.0]
    out = io.StringIO()
    p = Progress("layer", heartbeat_s=30.0, min_interval_s=2.0, stream=out, clock=lambda: now[0])
    try:
        p.set_context("Kimi-K2, 48 exp/GPU (case 1/1) | megatron-alltoall (1/1)")
        p.phase("preparing (building the layer, copying the weights)")
        assert p.heartbeat_text() is None
        now[0] = 31.0
        assert p.heartbeat_text() == "still preparing (building the layer, copying the weights) (31 s)"
        p.iteration(1, 5, "timed iteration")  # 31 s after the last line: printed
        now[0] = 32.0
        p.iteration(2, 5, "timed iteration")  # 1 s later: skipped
        now[0] = 33.0
        p.iteration(5, 5, "timed iteration")  # the last one: printed
    finally:
        p.close()
    lines = out.getvalue().splitlines()
    prefix = "[layer] Kimi-K2, 48 exp/GPU (case 1/1) | megatron-alltoall (1/1): "
    assert lines == [prefix + "preparing (building the layer, copying the weights)",
                     prefix + "timed iteration 1/5 done", prefix + "timed iteration 5/5 done"]
    quiet = Progress("layer", enabled=False, stream=out)
    quiet.line("nothing")
    quiet.close()
    assert "nothing" not in out.getvalue()


def test_megatron_baseline_at_one_process_under_torchrun_finishes(tmp_path):
    """At P = 1 under torchrun the Megatron baseline used to build a one-rank process group on a
    fresh tcp:// port, which torchrun turns into a client of its own store: a silent wait for the
    process-group timeout. Now it finishes (48 experts on the GPU of one process, as in the
    report, scaled down to the CPU), and says what it does as it goes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "megatron_mok.bench", "layer", "--shape", "custom",
           "--hidden", "64", "--ffn-hidden", "32", "--num-experts", "48", "--topk", "8", "--tokens", "64",
           "--experts-per-gpu", "48", "--backends", "megatron-alltoall", "--warmup", "1", "--iters", "2",
           "--check-tokens", "16", "--device", "cpu", "--out", str(tmp_path), "--timeout-s", "60"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[layer] 1 case(s) x 1 backend(s) (megatron-alltoall) on 1 CPU process(es)" in proc.stdout
    assert "megatron-alltoall (1/1): experts: SequentialMLP" in proc.stdout
    assert "megatron-alltoall (1/1): done: forward" in proc.stdout
    result = json.loads((tmp_path / "layer.json").read_text())["runs"][0]["results"][0]
    assert result["status"] == "ok" and result["check"]["passed"], result


def test_megatron_expert_module_follows_transformer_engine(monkeypatch):
    from megatron_mok.bench import megatron_layer

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert megatron_layer.expert_module_kind("auto", cpu) == "SequentialMLP"
    assert megatron_layer.expert_module_kind("sequential", gpu) == "SequentialMLP"
    monkeypatch.setattr(megatron_layer, "transformer_engine_reason", lambda: None)
    assert megatron_layer.expert_module_kind("auto", gpu) == "TEGroupedMLP"
    monkeypatch.setattr(megatron_layer, "transformer_engine_reason", lambda: "Transformer Engine is not installed")
    assert megatron_layer.expert_module_kind("auto", gpu) == "SequentialMLP"
    with pytest.raises(ValueError, match="--megatron-experts te-grouped: Transformer Engine is not installed"):
        megatron_layer.expert_module_kind("te-grouped", gpu)
    assert report._layer_row({"backend": "megatron-alltoall", "expert_module": "TEGroupedMLP", "status": "skipped",
                              "reason": "x"})[0] == "megatron-alltoall [TEGroupedMLP]"


def test_main_grad_mode_accumulates_into_ddp_laid_out_buffers():
    """--main-grad: the buffers lie as Megatron's DDP lays out SequentialMLP's (one allocation,
    expert L-1 first, each expert's fc1 then fc2); a MoK runner accumulates into them inside its
    backward, and a runner that returns bf16 gradients adds them in after_backward (DDP's add):
    both give main_grad = the gradient the plain run leaves on the weights, and no weight
    gradient is left behind. The backward floor counts main_grad read and written in fp32."""
    from megatron_mok.bench.backends import Experts, Runner, TokenBatch, main_grad_buffers, make_runner

    gen = torch.Generator().manual_seed(3)
    L, H, I, T, K = 3, 16, 8, 20, 2
    fc1 = torch.randn(L, 2 * I, H, generator=gen).requires_grad_()
    fc2 = torch.randn(L, H, I, generator=gen).requires_grad_()
    mains = main_grad_buffers(fc1, fc2)
    base = mains[0][L - 1].data_ptr()
    for e in range(L):
        assert mains[0][e].data_ptr() == base + 4 * (L - 1 - e) * (2 * I * H + H * I)
        assert mains[1][e].data_ptr() == mains[0][e].data_ptr() + 4 * 2 * I * H
        assert mains[0][e].dtype == torch.float32 and not mains[0][e].any()
    ids = torch.randint(0, L, (T, K), generator=gen)
    batch = TokenBatch(x=torch.randn(T, H, generator=gen).requires_grad_(), topk_ids=ids,
                       topk_weights=torch.rand(T, K, generator=gen).requires_grad_(), dy=torch.randn(T, H, generator=gen))

    plain = make_runner("reference", Experts(fc1, fc2, L, None), K, T)
    plain.forward(batch).backward(batch.dy)
    want1, want2 = fc1.grad.clone(), fc2.grad.clone()
    plain.zero_grad(batch)

    fused = make_runner("reference", Experts(fc1, fc2, L, None, main_grads=mains), K, T)
    fused.forward(batch).backward(batch.dy)
    fused.after_backward(batch)
    assert fc1.grad is None and fc2.grad is None
    assert torch.equal(torch.stack(mains[0]), want1) and torch.equal(torch.stack(mains[1]), want2)

    class BF16Grads(Runner):  # what a baseline leaves: gradients on the leaves
        def __init__(self, experts):
            self.experts = experts
        forward = grads = zero_grad = grad_tensors = None

    for b in mains[0] + mains[1]:
        b.zero_()
    fc1.grad, fc2.grad = want1.clone(), want2.clone()
    BF16Grads(Experts(fc1, fc2, L, None, main_grads=mains)).after_backward(batch)
    assert fc1.grad is None and fc2.grad is None
    assert torch.equal(torch.stack(mains[0]), want1) and torch.equal(torch.stack(mains[1]), want2)

    from megatron_mok.bench.floors import hbm_bytes
    kw = dict(hidden=H, ffn_hidden=I, experts=L, tokens=T, sent=T * K, received=T * K, backward=True)
    plain_b, fused_b = hbm_bytes(**kw), hbm_bytes(**kw, main_grad=True)
    assert fused_b["main_grad_read"] == fused_b["main_grad_write"] == 2 * plain_b["weight_grads_write"]
    assert "weight_grads_write" not in fused_b
