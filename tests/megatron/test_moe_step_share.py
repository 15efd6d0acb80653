"""tools/perf/moe_step_share.py, the MoE layers' share of a training step, on the CPU.

The tool lives in tools/perf (outside the package); its tests are here so that the README's
test command runs them. Its arithmetic on synthetic intervals; its hooks on a toy layer (a
recompute outside the layer's backward is one recompute, one inside is not counted again); its
hooks on real Megatron MoE layers (``alltoall`` and MoK, with and without recompute) in
Megatron's schedule through the wrapped ``train_step``, with markers whose backward sleeps
inside and on both sides of the layer, so that a backward interval that starts late, ends early
or swallows a neighbour's work fails; its JSON; its command line, on the real launcher (which,
without a GPU, builds the model and trains nothing). examples/gpu_pretrain_compare.sh's
``SHARE=1`` is tested in tests/megatron/test_megatron_launcher.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.megatron.megatron_utils import (
    BATCH,
    SEQ,
    _CudaDeviceToCpu,
    batch,
    build_gpt,
    megatron_ranks,
    moe_layers,
    tiny_config,
)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "perf" / "moe_step_share.py"
SLEEP_S = 0.005


def load_tool():
    """The tool as a module (it is a script in an unpackaged folder)."""
    if "moe_step_share" in sys.modules:
        return sys.modules["moe_step_share"]
    spec = importlib.util.spec_from_file_location("moe_step_share", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_step_share"] = module
    spec.loader.exec_module(module)
    return module


# ---- arithmetic ---------------------------------------------------------------------------------

def test_share_of_synthetic_intervals():
    tool = load_tool()
    row = tool.iteration_row(7, 500.0, [(0, "forward", 10.0), (1, "forward", 20.0), (0, "backward", 30.0),
                                        (1, "backward", 40.0), (1, "recompute", 5.0), (0, "forward", 1.0)])
    assert row["iteration"] == 7 and row["layers"] == 2
    assert (row["moe_fwd_ms"], row["moe_bwd_ms"], row["moe_recompute_ms"], row["moe_ms"]) == (31.0, 70.0, 5.0, 106.0)
    assert math.isclose(row["moe_share"], 106.0 / 500.0)
    assert row["per_layer"]["0"] == {"forward_ms": 11.0, "backward_ms": 30.0, "recompute_ms": 0.0,
                                     "forwards": 2, "backwards": 1, "recomputes": 0}
    assert row["per_layer"]["1"]["recomputes"] == 1 and row["per_layer"]["1"]["recompute_ms"] == 5.0
    with pytest.raises(ValueError, match="interval kind"):
        tool.iteration_row(1, 1.0, [(0, "sideways", 1.0)])
    assert math.isnan(tool.iteration_row(1, 0.0, [])["moe_share"])

    # Iterations 1-2 are warm-up; the medians of 3-7 are taken column by column.
    rows = [tool.iteration_row(i, step, [(0, "forward", f), (0, "backward", b)])
            for i, (step, f, b) in enumerate([(900, 90, 90), (800, 80, 80), (100, 10, 20), (200, 10, 40),
                                              (300, 30, 60), (400, 40, 80), (500, 20, 100)], start=1)]
    s = tool.summarize(rows, warmup=2)
    assert (s["first_iteration"], s["last_iteration"], s["iterations"]) == (3, 7, 5)
    assert (s["step_ms"], s["moe_fwd_ms"], s["moe_bwd_ms"], s["layers"]) == (300, 20, 60, 1)
    assert math.isclose(s["moe_share"], 0.3)  # shares 0.3, 0.25, 0.3, 0.3, 0.24
    assert tool.summary_line(s) == ("MoE layers: 1, forward 20.0 ms, backward 60.0 ms, 30.0% of a 300.0 ms step "
                                    "(median of iterations 3-7)")
    s = tool.summarize(rows[:3] + [tool.iteration_row(4, 100.0, [(0, "recompute", 5.0)])], warmup=3)
    assert tool.summary_line(s) == ("MoE layers: 1, forward 0.0 ms, backward 0.0 ms, recompute 5.0 ms, "
                                    "5.0% of a 100.0 ms step (median of iteration 4)")
    assert tool.summarize(rows, warmup=7) is None
    assert "all within the 7 warm-up iterations" in tool.summary_line(None, 7, 7)
    assert "no training iteration recorded" in tool.summary_line(None, 0, 5)


# ---- the hooks on a toy layer -------------------------------------------------------------------

class _Marker(torch.autograd.Function):
    """Identity; its backward sleeps SLEEP_S between two recorded perf_counter times. The
    forward's times are recorded too (a recompute shows as a second forward)."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        log.setdefault("forward", []).append(time.perf_counter())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(SLEEP_S)
        ctx.log.setdefault("backward", []).append((start, time.perf_counter()))
        return grad, None


class _Toy(torch.nn.Module):
    def __init__(self, inner_checkpoint=False):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.inner_checkpoint = inner_checkpoint
        self.log = {}

    def body(self, x):
        return torch.tanh(self.linear(_Marker.apply(x, self.log)))

    def forward(self, x):
        if self.inner_checkpoint:  # as Megatron's --recompute-modules moe: the module call is not re-run
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=True), None
        return self.body(x), None  # a tuple, as MoELayer returns (output, mlp_bias)


class _CallAgainInBackward(torch.autograd.Function):
    """Identity whose backward calls ``module`` once more (a forward inside that module's own
    backward interval)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            ctx.module(torch.ones(2, 4))
        return grad, None


def _intervals(step, layer=0):
    """{kind: (start, end)} of one layer in one resolved step (one microbatch)."""
    return {i.kind: (i.start, i.end) for i in step.intervals if i.layer == layer}


def _counts(row, layer="0"):
    """[forwards, backwards, recomputes] of one layer in one row."""
    return [row["per_layer"][layer][k] for k in ("forwards", "backwards", "recomputes")]


def test_recorder_on_a_toy_layer():
    tool = load_tool()
    rec = tool.StepShareRecorder(tool.CpuClock())
    toy = _Toy()
    assert rec.hook(toy) == 0 and rec.hook(toy) == 0  # once per module
    pre, post = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    toy(x)[0].sum().backward()  # outside a step: not recorded
    assert rec.outside_steps == 2 and not rec.rows

    with rec.step():  # plain
        post(toy(pre(x))[0]).sum().backward()
    # full recompute: a reentrant checkpoint around the block re-runs the module call in the backward
    with rec.step():
        block = lambda h: post(toy(h)[0])  # noqa: E731
        torch.utils.checkpoint.checkpoint(block, pre(x), use_reentrant=True).sum().backward()
    rec.resolve()
    plain, full = rec.rows
    assert _counts(plain) == [1, 1, 0]
    assert _counts(full) == [1, 1, 1]
    for step in rec.steps:
        spans = _intervals(step)
        assert all(step.start <= a <= b <= step.end for a, b in spans.values())
    # The marker's backward (inside the module) lies in the backward interval; the recompute
    # (holding the marker's second forward) ends before the module's backward begins.
    p_bwd, f_bwd = toy.log["backward"][1:]  # the first: the call outside a step
    spans = _intervals(rec.steps[0])
    assert spans["backward"][0] <= p_bwd[0] and p_bwd[1] <= spans["backward"][1]
    spans = _intervals(rec.steps[1])
    assert spans["backward"][0] <= f_bwd[0] and f_bwd[1] <= spans["backward"][1]
    assert spans["recompute"][0] <= toy.log["forward"][-1] <= spans["recompute"][1] <= spans["backward"][0]

    # Recompute inside the module (its body checkpointed): one forward, one backward interval
    # that holds the recompute.
    rec2 = tool.StepShareRecorder(tool.CpuClock())
    inner = _Toy(inner_checkpoint=True)
    rec2.hook(inner)
    with rec2.step():
        post(inner(pre(x))[0]).sum().backward()
    rec2.resolve()
    assert _counts(rec2.rows[0]) == [1, 1, 0]
    spans = _intervals(rec2.steps[0])
    assert spans["backward"][0] <= inner.log["forward"][1] <= spans["backward"][1]

    # A forward of the module inside its own open backward interval (a node of the module whose
    # backward calls it again) is time counted there already: not a recompute.
    rec3 = tool.StepShareRecorder(tool.CpuClock())

    class _Reentrant(_Toy):
        def forward(self, h):
            out = self.body(h)
            if not getattr(self, "_inside", False):
                self._inside = True
                try:
                    out = _CallAgainInBackward.apply(out, self)
                finally:
                    self._inside = False
            return out, None

    reentrant = _Reentrant()
    rec3.hook(reentrant)
    with rec3.step():
        post(reentrant(pre(x))[0]).sum().backward()
    rec3.resolve()
    assert len(reentrant.log["forward"]) == 2  # it did run again, inside its backward
    assert _counts(rec3.rows[0]) == [1, 1, 0]
    assert rec3.unmatched == 0


# ---- the hooks on Megatron's MoE layers, in Megatron's schedule ---------------------------------

def _marker_hooks(model, moe, logs):
    """Markers around the decoder's MoE layer: ``inner`` on the router's input (the last of the
    layer's backward), ``before`` on the decoder's final norm output (its backward runs before
    the layer's), ``after`` on the input of the layer's pre-MLP norm (its backward runs after)."""
    decoder_layer = next(m for m in model.decoder.layers if m.mlp is moe)

    def wrap_input(log):
        return lambda module, args: (_Marker.apply(args[0], log), *args[1:])

    moe.router.register_forward_pre_hook(wrap_input(logs["inner"]))
    decoder_layer.pre_mlp_layernorm.register_forward_pre_hook(wrap_input(logs["after"]))
    model.decoder.final_layernorm.register_forward_hook(lambda m, a, out: _Marker.apply(out, logs["before"]))


def _fake_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                     forward_backward_func, iteration=None, **kwargs):
    """What Megatron's train_step does that matters here: every microbatch's forward and backward
    through the schedule (its device="cuda" tensors made on the CPU), then the optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    with _CudaDeviceToCpu():
        forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                              num_microbatches=config.microbatches, seq_length=SEQ, micro_batch_size=BATCH)
    optimizer.step()
    return {}, 0, False, False, 0, None, None, None


def _forward_step(data_iterator, model):
    tokens, position_ids, mask, labels = next(data_iterator)
    return model(tokens, position_ids, mask, labels=labels), lambda out: (out.float().mean(), {})


CASES = [  # dispatcher, config overrides, microbatches
    ("alltoall", {}, 1),
    ("mok", {}, 2),
    ("alltoall", {"recompute_granularity": "selective", "recompute_modules": ["moe"]}, 1),
    ("alltoall", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, 1),
    ("mok", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, 1),
]


def _megatron_layers(rank, world, json_path):
    import megatron_mok
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.training import training

    from megatron_mok.megatron import MoKLayerSettings, MoKMoELayer

    megatron_mok.register()
    tool = load_tool()
    for dispatcher, overrides, microbatches in CASES:
        what = f"{dispatcher} {overrides} x{microbatches}"
        recompute = overrides.get("recompute_granularity")
        rec = tool.StepShareRecorder(tool.CpuClock())
        extra = {"mok_settings": MoKLayerSettings(backend="reference")} if dispatcher == "mok" else {}
        original = training.train_step
        training.train_step = _fake_train_step  # stands in for Megatron's, which needs its global state
        try:
            with tool.installed(rec):
                model = build_gpt(tiny_config(dispatcher, world, **overrides, **extra))
                config = model.config
                config.microbatches = microbatches
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
                layers = [m for _, m in moe_layers(model)]
                assert len(layers) == 2 and len(rec.layers) == 2, what
                assert all(isinstance(m, MoKMoELayer) == (dispatcher == "mok") for m in layers), what
                assert [m._moe_step_share_index for m in layers] == [0, 1], what
                logs = {k: {} for k in ("inner", "before", "after")}
                _marker_hooks(model, layers[0], logs)
                for iteration in range(2):  # as Megatron's train() calls it: the module's global, iteration=
                    data = iter([batch(rank, seed=10 * iteration + m) for m in range(microbatches)])
                    training.train_step(_forward_step, data, [model], optimizer, None, config,
                                        forward_backward_no_pipelining, iteration=iteration)
            assert training.train_step is _fake_train_step, what  # undone on leaving the block
        finally:
            training.train_step = original
        rec.resolve()
        assert [r["iteration"] for r in rec.rows] == [1, 2], what
        # (a) one forward and one backward interval per MoE layer per microbatch; a recompute
        # interval only where the whole transformer layer is recomputed.
        for row in rec.rows:
            assert row["layers"] == 2, what
            recomputes = microbatches if recompute == "full" else 0
            for layer in ("0", "1"):
                assert _counts(row, layer) == [microbatches, microbatches, recomputes], (what, row)
            assert 0 < row["moe_ms"] < row["step_ms"] and math.isclose(row["moe_share"], row["moe_ms"] / row["step_ms"])
        assert rec.unmatched == 0 and rec.outside_steps == 0, what
        # (b) the decoder MoE layer's backward interval holds its router's backward (the marker's
        # sleep) and neither neighbour's.
        inner, before, after = (logs[k]["backward"] for k in ("inner", "before", "after"))
        assert len(inner) == len(before) == len(after) == 2 * microbatches, what
        for n, step in enumerate(rec.steps):
            backward = [(i.start, i.end) for i in step.intervals if i.layer == 0 and i.kind == "backward"]
            for m, (start, end) in enumerate(backward):
                k = n * microbatches + m
                assert before[k][1] <= start <= inner[k][0] and inner[k][1] <= end <= after[k][0], (what, n, m)
                assert end - start >= SLEEP_S, what
            forwards = logs["inner"]["forward"]  # the router marker's forwards: a recompute adds one
            per_microbatch = 2 if recompute else 1
            assert len(forwards) == 2 * microbatches * per_microbatch, what
            if recompute == "selective":  # re-run inside the backward interval: counted there
                for m, (start, end) in enumerate(backward):
                    assert start <= forwards[2 * (n * microbatches + m) + 1] <= end, what
            if recompute == "full":  # re-run before the layer's backward: one recompute interval
                spans = [(i.start, i.end) for i in step.intervals if i.layer == 0 and i.kind == "recompute"]
                assert len(spans) == len(backward) == microbatches, what
                for m, ((r_start, r_end), (b_start, _)) in enumerate(zip(spans, backward)):
                    assert r_start <= forwards[2 * (n * microbatches + m) + 1] <= r_end <= b_start, what
    # The report of the last case: the JSON and the printed line.
    result = tool.report(rec, warmup=1, path=json_path, status=0, argv=["--x"])
    assert result["summary"]["first_iteration"] == 2 and result["summary"]["iterations"] == 1
    assert [layer["mtp"] for layer in result["moe_layers"]] == [False, True]


def test_hooks_on_megatron_moe_layers(tmp_path, capfd):
    path = tmp_path / "share.json"
    megatron_ranks(_megatron_layers, 1, str(path))
    data = json.loads(path.read_text())
    assert data["clock"] == "cpu" and data["warmup"] == 1 and len(data["iterations"]) == 2
    assert data["ranks"] == [{"rank": 0, "summary": data["summary"]}]
    row = data["iterations"][1]
    assert {"iteration", "step_ms", "moe_fwd_ms", "moe_bwd_ms", "moe_share", "layers"} <= set(row)
    assert data["summary"]["moe_recompute_ms"] > 0  # the last case recomputes whole layers
    out = capfd.readouterr().out
    assert "moe_step_share: 2 MoE layers hooked on rank 0, clock cpu" in out
    line = next(line for line in out.splitlines() if line.startswith("moe_step_share: MoE layers: 2, forward"))
    assert line.endswith(f"% of a {data['summary']['step_ms']:.1f} ms step (median of iteration 2)")


# ---- the command line ---------------------------------------------------------------------------

def test_options_are_split_from_the_pretrain_arguments():
    tool = load_tool()
    assert tool.split_argv(["--share-warmup", "3", "--", "--num-layers", "2", "--", "x"]) == (
        ["--share-warmup", "3"], ["--num-layers", "2", "--", "x"])
    # Without "--": the leading --share-* options (and their values) are ours.
    assert tool.split_argv(["--share-json=a.json", "--share-clock", "cpu", "@x.args", "--share-warmup", "1"]) == (
        ["--share-json=a.json", "--share-clock", "cpu"], ["@x.args", "--share-warmup", "1"])
    assert tool.split_argv(["--help"]) == (["--help"], [])
    with pytest.raises(SystemExit):
        tool.main(["--share-json", "x.json"])  # no pretrain arguments
    with pytest.raises(SystemExit):
        tool.main(["--share-warmup", "-1", "--", "--num-layers", "2"])


def test_tool_on_the_launcher_without_a_gpu(tmp_path):
    """The real launcher through the tool on a CPU: every MoE layer of configs/tiny.args is built
    (on the meta device) with the hooks, nothing is trained, the launcher's status 1 is the tool's."""
    path = tmp_path / "share.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--share-json", str(path), "--share-warmup", "2", "--",
         "@configs/tiny.args", "@configs/local_no_te.args", "--moe-token-dispatcher-type", "mok",
         "--mok-backend", "reference", "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3",
         "--lr", "3e-3", "--split", "100,0,0", "--no-bias-swiglu-fusion"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mok-pretrain-gpt: no CUDA GPU on this machine" in proc.stdout
    data = json.loads(path.read_text())
    layers = data["moe_layers"]
    assert layers and all(layer["class"] == "MoKMoELayer" for layer in layers)
    assert data["launcher_status"] == 1 and data["iterations"] == [] and data["summary"] is None
    assert f"moe_step_share: {len(layers)} MoE layers hooked on rank 0, clock cpu" in proc.stdout
    assert ("moe_step_share: MoE layers: no training iteration recorded (Megatron's train_step never ran) "
            "(the launcher exited with status 1)") in proc.stdout
