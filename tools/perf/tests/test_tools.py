"""The tools of tools/perf on the CPU: their parsing and arithmetic, their command lines (each
Python tool answers --help, each shell tool parses), and the standalone CUDA programs build."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1]
ROOT = TOOLS.parents[1]
CONSTS = SimpleNamespace(block_rows=128, fc1_cols=128, fc2_cols=256, first_pull_parts=8)
"""The kernel's tile sizes as megatron_mok.ops.megakernel.constants() gives them (the tools ask
the library; these tests need none)."""


# ---- every tool starts --------------------------------------------------------------------------

@pytest.mark.parametrize("tool", sorted(p.name for p in TOOLS.glob("*.py")))
def test_python_tool_answers_help(tool):
    r = subprocess.run([sys.executable, str(TOOLS / tool), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                    "CUDA_VISIBLE_DEVICES": ""})
    if tool == "ab_stats.py":  # a library of the others: importing it is all it does
        assert r.returncode == 0, r.stderr[-2000:]
        return
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


@pytest.mark.parametrize("tool", sorted(p.name for p in TOOLS.glob("*.sh")))
def test_shell_tool_parses(tool):
    assert subprocess.run(["bash", "-n", str(TOOLS / tool)]).returncode == 0


def test_gpu_ab_loads_says_how_to_call_it():
    """gpu_ab_loads.sh (a device script): without FIELD=A,B it prints its usage and exits 2
    before any GPU work."""
    script = TOOLS / "gpu_ab_loads.sh"
    for args in ([], ["group_blocks=8"], ["16,8"], ["pairs=on,off", "out", "6", "3", "extra"]):
        r = subprocess.run(["bash", str(script), *args], capture_output=True, text=True)
        assert r.returncode == 2 and "usage: tools/perf/gpu_ab_loads.sh FIELD=A,B" in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("bench", ["peer_store_bench", "slot_sum_bench"])
def test_standalone_cuda_program_builds(bench, tmp_path):
    """peer_store_bench.cu (fc2's push store pattern, two GPUs) and slot_sum_bench.cu (the
    megakernel's own slot sum and variants of it, one GPU) build against the headers they
    measure."""
    from megatron_mok import _build

    nvcc = _build.find_nvcc()
    if nvcc is None:
        pytest.skip(f"nvcc not found: cannot compile tools/perf/{bench}.cu")
    out = tmp_path / bench
    res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                          f"-I{ROOT / 'csrc' / 'include'}", str(TOOLS / f"{bench}.cu"), "-o", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert out.stat().st_size > 0


# ---- ab_positions.py ----------------------------------------------------------------------------

def test_ab_positions_reads_paired_runs_and_skips_bound_lines(capsys, monkeypatch):
    import ab_positions

    text = "\n".join([
        "# a comment",
        "L=48 ::: X=1 5.7 ms, X=0 5.6 ms (...); X=1 by block 6.2 5.8 5.7 5.7; X=0 by block 5.6 5.6 5.7 5.8",
        "L=48 settings: :: 5.7 ms, 10:: 5.7 ms (...); :: by block 6.1 5.8 5.7 5.7; 10:: by block 5.6 5.6 5.9 5.8",
        "L=48 ::: Y=a 5.8 ms (...); Y=a by block 6.0 5.9 5.8 5.8; Y=b by block 5.7 5.7 5.8 5.8",
        "L=48 ::: megakernel 5.8 ms, torch (...); ratio 1.16x; "
        "megakernel by block 5.7 5.8 5.8 5.8; torch by block 5.0 5.1 5.0 5.0",
        "L=6-grad ::: Z=1 by block 5.0 5.1 5.2 5.1; Z=0 by block 5.0 5.2 5.0 5.1",
    ])
    runs = ab_positions.parse_runs(text)
    assert sorted(runs) == ["L=48", "L=6-grad"] and len(runs["L=48"]) == 3  # the bound line is skipped
    label, blocks = runs["L=48"][1]
    assert label == ":: against 10::" and blocks == [6.1, 5.6, 5.6, 5.8, 5.9, 5.7, 5.7, 5.8]
    lines = ab_positions.report(runs)
    assert len(lines) == 5 and "needs three or more" in lines[-1]
    assert lines[1].startswith("L=48 | X=1 against X=0 | -0.175 | -0.058 |")
    monkeypatch.setattr("sys.stdin", io.StringIO("L=48 ::: nothing paired here\n"))
    assert ab_positions.main([]) == 2
    assert "no paired block runs" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert ab_positions.main([]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_ab_positions_reads_the_timelines_ab_lines():
    """A line as megakernel_timeline.py --ab FIELD=A,B --blocks prints it parses as one run."""
    import ab_positions

    line = ("L=48 ::: group_blocks=8 5.700 ms, group_blocks=16 5.650 ms (medians of 4 x 20 calls ...); "
            "group_blocks=16 - group_blocks=8: -0.050 ms, ...; "
            "group_blocks=8 by block 5.800 5.700 5.690 5.700; group_blocks=16 by block 5.600 5.650 5.660 5.640")
    runs = ab_positions.parse_runs(line)
    assert list(runs) == ["L=48"]
    assert runs["L=48"][0][0] == "group_blocks=8 against group_blocks=16"


# ---- ncu_bytes.py -------------------------------------------------------------------------------

def _ncu_csv(kernels, clock=True):
    """An `ncu --csv --page raw` output: program output, the header, the units row, one row per
    (name, ns, read, written, l2, pct[, hz])."""
    cols = ["ID", "Kernel Name", "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
            "lts__t_bytes.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed"]
    cols += ["sm__cycles_elapsed.avg.per_second"] if clock else []
    lines = ["rank 0/1: torch._grouped_mm fc1 + fc2 alone", "==PROF== Disconnected",
             ",".join(f'"{c}"' for c in cols), ",".join(['""', '""', '"byte"', '"byte"', '"ns"', '"byte"', '"%"']
                                                         + (['"hz"'] if clock else []))]
    for i, (name, ns, rd, wr, l2, pct, hz) in enumerate(kernels):
        vals = [str(i), name, f"{rd:,}", f"{wr:,}", f"{ns:,}", f"{l2:,}", str(pct)] + ([f"{hz:,}"] if clock else [])
        lines.append(",".join(f'"{v}"' for v in vals))
    return "\n".join(lines) + "\n"


def test_ncu_bytes_summary_pairs_torch_launches_and_takes_medians():
    """CUTLASS launches alternate fc1, fc2 and are summed per call; the megakernel's launches
    give medians; the clock is weighted by time; units are converted."""
    import ncu_bytes as mod

    gemm, mk = "void device_kernel<enable_3x_kernel_for_sm90>", "<unnamed>::forward_kernel(<unnamed>::KernelParams)"
    kernels = [(gemm, 3_000_000, 5_000_000_000, 200_000_000, 20_000_000_000, 90.0, 1.5e9),
               (gemm, 1_000_000, 2_000_000_000, 500_000_000, 10_000_000_000, 80.0, 1.7e9)] * 3
    kernels[4] = (gemm, 3_200_000, 5_000_000_000, 200_000_000, 20_000_000_000, 90.0, 1.5e9)
    kernels += [(mk, t, 8_000_000_000, 1_200_000_000, 37_000_000_000, 77.0, 1.4e9) for t in (4_500_000, 4_600_000, 9_000_000)]
    summary = mod.summarize(mod.read_ncu_csv(_ncu_csv(kernels)))
    assert set(summary) == {"megakernel", "torch fc1", "torch fc2", "torch fc1 + fc2"}
    assert summary["megakernel"]["time_ms"] == pytest.approx(4.6)
    assert summary["megakernel"]["dram_read_gb"] == pytest.approx(8.0)
    assert summary["torch fc1"]["time_ms"] == pytest.approx(3.0)
    assert summary["torch fc2"]["dram_write_gb"] == pytest.approx(0.5)
    both = summary["torch fc1 + fc2"]
    assert both["time_ms"] == pytest.approx(4.0) and both["dram_read_gb"] == pytest.approx(7.0)
    assert both["l2_gb"] == pytest.approx(30.0)
    assert both["sm_pct"] == pytest.approx((90 * 3 + 80 * 1) / 4)
    assert both["clock_mhz"] == pytest.approx((1500 * 3 + 1700 * 1) / 4)
    text = mod.format_summary(summary)
    assert "megakernel: 4.600 ms, DRAM read 8.00 GB" in text and "SM clock 1400 MHz" in text


def test_ncu_bytes_rejects_missing_metrics_and_unpaired_launches():
    import ncu_bytes as mod

    gemm = "void device_kernel<x>"
    no_clock = mod.read_ncu_csv(_ncu_csv([(gemm, 1000, 1, 1, 1, 1.0, 1.0)] * 2, clock=False))
    assert "clock_mhz" not in no_clock[0] and "SM clock" not in mod.format_summary(mod.summarize(no_clock))
    with pytest.raises(ValueError, match="expected fc1 and fc2"):
        mod.summarize(mod.read_ncu_csv(_ncu_csv([(gemm, 1000, 1, 1, 1, 1.0, 1.0)] * 3)))
    with pytest.raises(ValueError, match="no ncu CSV header"):
        mod.read_ncu_csv("just the program's output\n")
    text = _ncu_csv([(gemm, 1000, 1, 1, 1, 1.0, 1.0)] * 2).replace("lts__t_bytes.sum", "lts__other")
    with pytest.raises(ValueError, match="lts__t_bytes.sum"):
        mod.read_ncu_csv(text)


# ---- call_kernels.py ----------------------------------------------------------------------------

def test_call_kernels_splits_the_profile_at_each_megakernel():
    """The work between two megakernels is one call's; medians per kernel name and of the gaps;
    too few megakernels is an error."""
    import call_kernels as mod

    events, t = [], 0.0
    for publish_us in (28.0, 30.0, 29.0):
        events += [("Memcpy DtoH", t + 2, t + 4), ("publish_kernel", t + 12, t + 12 + publish_us),
                   ("publish_kernel", t + 13, t + 16), ("forward_kernel(KernelParams)", t + 50, t + 5050)]
        t += 5050
    summary = mod.per_call(events, "forward_kernel")
    assert summary["calls"] == 2
    # From the end of call 0's megakernel (5050) to call 1's start (5100): 50 us; idle before the copy 2 us.
    assert summary["between_us"] == pytest.approx(50.0) and summary["idle_us"] == pytest.approx(2.0)
    assert summary["marker_us"] == pytest.approx(5000.0) and summary["period_us"] == pytest.approx(5050.0)
    kernels = {name: (n, us) for name, n, us in summary["kernels"]}
    assert kernels["publish_kernel"] == (2, pytest.approx(29.5)) and kernels["Memcpy DtoH"] == (2, pytest.approx(2.0))
    assert kernels["publish_kernel [2]"] == (2, pytest.approx(3.0))  # a second launch in a call, counted apart
    assert [name for name, _, _ in summary["kernels"]] == ["Memcpy DtoH", "publish_kernel", "publish_kernel [2]",
                                                          "forward_kernel(KernelParams)"]
    text = mod.format_per_call(summary, "rank 0/2 L=48")
    assert "medians over 2" in text and "publish_kernel: 2 launches, 29.5 us" in text
    with pytest.raises(ValueError, match="need two calls"):
        mod.per_call(events[:3], "forward_kernel")


# ---- megakernel_timeline.py ---------------------------------------------------------------------

def test_timeline_ab_flips_one_tunable_of_the_setting():
    import megakernel_timeline as tl
    from megatron_mok.bench.tune import Candidate

    got = tl.ab_variants("8::", "group_blocks=8,16")
    assert got == [("group_blocks=8", Candidate(8, None, None, group_blocks=8)),
                   ("group_blocks=16", Candidate(8, None, None, group_blocks=16))]
    got = tl.ab_variants("::", "pairs=on,off")
    assert [c.pairs for _, c in got] == [True, False]
    assert [c.comm_sms for _, c in tl.ab_variants("::::16", "comm=6,8")] == [6, 8]
    assert [c.group_blocks for _, c in tl.ab_variants("::::16", "comm=6,8")] == [16, 16]
    assert [c.ring_rows for _, c in tl.ab_variants(":2048:", "ring_rows=4096,8192")] == [4096, 8192]
    same = tl.ab_variants("::", "pairs=on,on")  # an A/A run still gets two names
    assert [label for label, _ in same] == ["pairs=on (A)", "pairs=on (B)"]
    for bad, message in (("pairs=on", "FIELD=A,B"), ("OLD_SWITCH=0,1", "unknown field"),
                         ("pairs=yes,no", "PAIRS must be on, off"), ("group_blocks=a,b", "integers or empty")):
        with pytest.raises(ValueError, match=message):
            tl.ab_variants("::", bad)


def test_timeline_decode_splits_items_and_cta_records():
    import megakernel_timeline as tl

    def meta(kind, block=0, col=0):
        return kind | (block << 8) | (col << 40)
    t0 = 1_000_000_000
    records = np.array([
        [t0 + 1000, t0 + 2000, t0 + 3000, t0 + 9000, meta(1, 3, 2), 7],     # fc1 of block 3, column 2, CTA 7
        [t0 + 500, t0 + 600, t0 + 600, t0 + 800, meta(6, 1), 0],           # a first block's pull part
        [t0, t0 + 9000, t0 + 9500, t0 + 12000, meta(5) | (1 << 8), 0],     # CTA 0, a comm CTA
        [t0 + 100, t0 + 9100, t0 + 9600, t0 + 11000, meta(5), 7],          # CTA 7, a compute CTA
        [0, 0, 0, 0, 0, 0],                                                # not written
    ], dtype=np.int64)
    items, ctas = tl.decode(records, cta_kind=5)
    assert items["kind"].tolist() == [1, 6] and items["block"].tolist() == [3, 1] and items["col"].tolist() == [2, 0]
    assert items["cta"].tolist() == [7, 0]
    assert items["start"].tolist() == pytest.approx([0.003, 0.0006]) and items["done"][0] == pytest.approx(0.009)
    assert ctas["role"].tolist() == [1, 0] and ctas["cta"].tolist() == [0, 7]
    assert ctas["end"].tolist() == pytest.approx([0.012, 0.011])


def test_timeline_clock_summary_takes_medians_per_gpu_after_the_first_fifth():
    import megakernel_timeline as tl

    # GPU 0: five samples, the first (settling) dropped; GPU 1: clocks 1500, 1400, 1300, 1200,
    # 1100 after its first; a line nvidia-smi prints for an unsupported field is skipped.
    lines = ["0, 1980, 300.5", "0, 1500, 690", "0, 1510, 700", "0, 1490, 699", "0, 1520, 701",
             "1, 1980, 200", "1, 1500, 650", "1, 1400, 660", "1, 1300, 670", "1, 1200, 680", "1, 1100, 690",
             "1, [N/A], [N/A]"]
    summary = tl.clock_summary("\n".join(lines))
    assert summary[0] == (1505.0, 700.0 - 0.5, 4)
    assert summary[1] == (1300.0, 670.0, 5)
    assert tl.clock_summary("") == {}


def test_timeline_tile_boundaries_measure_from_the_previous_tile_end():
    # Two compute CTAs (a pair: CTA 0 leads), each running fc1, fc2, fc2 back to back; times in
    # ms as decode() gives them. Next tile taken 3 us before / input 1 us after / MMAs 2 us after
    # the previous tile's end on the leader, shifted by 1 us on the follower.
    import megakernel_timeline as tl

    rows = {k: [] for k in ("kind", "block", "col", "cta", "take", "ready", "start", "done")}
    for cta, shift in ((0, 0.0), (1, 0.001)):
        end = 0.0
        for kind in (1, 2, 2):
            for name, value in (("kind", kind), ("block", 0), ("col", 0), ("cta", cta),
                                ("take", end - 0.003 + shift), ("ready", end + 0.001 + shift),
                                ("start", end + 0.002 + shift), ("done", end + 0.002 + shift + 0.05)):
                rows[name].append(value)
            end = rows["done"][-1]
    items = {k: np.array(v) for k, v in rows.items()}
    lines = tl.tile_boundaries(items, pairs=True)
    assert len(lines) == 4, lines  # (leader, follower) x (fc1 -> fc2, fc2 -> fc2)
    assert lines[0].startswith("  leader fc1 -> fc2 (n=1): next taken -3.00, input in +1.00, MMAs start +2.00")
    assert lines[3].startswith("  follower fc2 -> fc2 (n=1): next taken -2.00, input in +2.00, MMAs start +3.00")
    single = tl.tile_boundaries(items, pairs=False)
    assert [line.split(" (")[0] for line in single] == ["  fc1 -> fc2", "  fc2 -> fc2"]
    assert "(n=2)" in single[0] and "(n=2)" in single[1]


def test_timeline_maps_blocks_to_layout_rows_and_their_homes():
    # Two local experts: 300 rows (100 from rank 0, 200 from rank 1) and 130 rows (all from
    # rank 0), seen from rank 0. Layout blocks: expert 0 -> 0, 1, 2 (rows 0-299), expert 1 -> 3, 4.
    import megakernel_timeline as tl

    by_source = np.array([[100, 130], [200, 0]])
    real = tl.block_real_rows(by_source.sum(axis=0), 5, 128)
    assert real.tolist() == [128, 128, 44, 128, 2]
    # Rows [100, 300) of expert 0 come from rank 1: 28 of block 0, all of block 1, 44 of block 2.
    assert tl.block_remote_rows(by_source, 0, 5, 128).tolist() == [28, 128, 44, 0, 0]
    assert tl.block_remote_rows(by_source, 1, 5, 128).tolist() == [100, 0, 0, 128, 2]
    assert tl.block_experts(np.array([300, 130]), 128).tolist() == [0, 0, 0, 1, 1]
    assert tl.block_real_rows(np.array([100]), 2, 64).tolist() == [64, 36]


def test_timeline_counts_joining_comm_ctas_apart():
    # CTA 0 is a comm CTA (role 1) that ran one fc2 tile after its pulls; CTA 1 a compute CTA
    # with an fc1 and an fc2 tile. The busy share and stalls are the compute CTA's alone.
    import megakernel_timeline as tl

    items = dict(kind=np.array([1, 2, 2, 3]), block=np.array([0, 0, 1, 1]), col=np.zeros(4, dtype=np.int64),
                 cta=np.array([1, 1, 0, 0]), take=np.array([0.01, 0.1, 0.5, 0.0]),
                 ready=np.array([0.01, 0.1, 0.5, 0.0]), start=np.array([0.02, 0.11, 0.5, 0.0]),
                 done=np.array([0.1, 0.14, 0.53, 0.05]))
    ctas = dict(role=np.array([1, 0]), cta=np.array([0, 1]), start=np.zeros(2), queue_end=np.array([0.5, 0.2]),
                combine=np.array([0.6, 0.6]), end=np.array([0.7, 0.7]))
    lines = tl.summarize(items, ctas, H=256, I=128, mb_rows=256, label="joined", consts=CONSTS,
                         real_rows=np.array([128, 40]), pairs=True, experts=np.array([0, 0]))
    assert any(line.startswith("comm CTAs that joined the compute queue: 1, 1 tiles from 0.500 ms") for line in lines)
    busy = [line for line in lines if line.startswith("compute CTAs")]
    # CTA 1: tiles 0.02-0.10 and 0.11-0.14 of its window 0-0.14 -> 110 / 140 us busy.
    assert busy and busy[0].startswith("compute CTAs 1: busy 78.6%"), busy
    assert any("blocks with <= 64 real rows: n=1" in line for line in lines)
    assert any("pair tiles of one expert (weights shared)" in line for line in lines)
    # fc1: 128 x 256 gate and up columns x H = 256 per tile, in 80 us.
    fc1 = next(line for line in lines if line.startswith("fc1 "))
    assert f"{2 * 128 * 256 * 256 / 0.08 / 1e9:.1f} TFLOP/s per CTA" in fc1


def test_timeline_bound_times_each_side_in_blocks_after_warmup(monkeypatch):
    # 2 x `warmup` alternating untimed calls, then blocks A B B A B A A B, each `warmup` untimed
    # calls and then `rounds` timed ones; the medians are the calls' own times (12 ms and 3 ms
    # here, on the CPU clock).
    import megakernel_timeline as tl

    monkeypatch.setattr(tl, "check_errors", lambda: None)
    order = []

    def sleeper(name, ms):
        def call():
            order.append(name)
            time.sleep(ms / 1e3)
        return call
    mk_ms, mm_ms = tl.bound_timing(sleeper("mk", 12.0), sleeper("mm", 3.0), rounds=3, warmup=2, distributed=False,
                                   rank=1, label="test", device=torch.device("cpu"))
    blocks = {"A": ["mk"] * 5, "B": ["mm"] * 5}
    assert order == ["mk", "mm"] * 2 + sum((blocks[c] for c in "ABBABAAB"), [])
    assert 12.0 <= mk_ms < 12.0 + 50 and 3.0 <= mm_ms < 3.0 + 50 and mk_ms > mm_ms


# ---- host_profile.py ----------------------------------------------------------------------------

def test_host_profile_times_steps_at_start_or_return_and_restores_them(monkeypatch):
    """--to-launch's instrument: a step marks the clock when its function starts or returns, a
    path this version lacks is skipped, and everything is put back (a staticmethod as a
    staticmethod)."""
    import host_profile as hp

    import megatron_mok

    class Autograd:
        @staticmethod
        def forward(x):
            if x is None:
                raise AttributeError("fails inside")
            return x

    def checks(x):
        if x is None:
            raise ValueError("bad input")
        return x
    probe = SimpleNamespace(checks=checks, Autograd=Autograd)
    monkeypatch.setattr(megatron_mok, "_probe", probe, raising=False)
    steps = [("checks", "_probe.checks", "end"), ("forward", "_probe.Autograd.forward", "start"),
             ("gone", "_probe.no_such_step", "end"), ("gone too", "no_such_module.f", "end")]
    before = (probe.checks, Autograd.__dict__["forward"])
    ticks = iter(range(100))
    with hp.timed_steps(steps, lambda: next(ticks)) as marks:
        assert isinstance(Autograd.__dict__["forward"], staticmethod)
        assert probe.checks(1) == 1
        with pytest.raises(ValueError):  # fails inside: a step that does not return is not marked
            probe.checks(None)
        with pytest.raises(AttributeError):  # marked on entry, then fails inside
            Autograd.forward(None)
    assert marks == {"checks": [0], "forward": [1], "gone": [], "gone too": []}
    assert (probe.checks, Autograd.__dict__["forward"]) == before
    # The package's own steps resolve where this version has them (the others are skipped).
    assert any(hasattr(*hp._resolve(path)) for _, path, _ in hp.LAUNCH_STEPS)


def test_backward_breakdown_lists_the_gpu_gaps_and_the_kernels(monkeypatch):
    """gpu_gaps: the idle time between consecutive GPU events (overlaps merged) at or above the
    threshold, named by the event after the gap; kernel_table: kernels by total time."""
    import json
    sys.path.insert(0, str(TOOLS))
    try:
        import backward_breakdown as bb
    finally:
        sys.path.pop(0)
    events = [
        {"cat": "kernel", "name": "a", "ts": 0.0, "dur": 10.0},
        {"cat": "kernel", "name": "b", "ts": 5.0, "dur": 10.0},      # overlaps a: no gap
        {"cat": "gpu_memcpy", "name": "c", "ts": 40.0, "dur": 5.0},  # 25 us after b ends
        {"cat": "cpu_op", "name": "host", "ts": 46.0, "dur": 100.0},  # not GPU work
        {"cat": "kernel", "name": "d", "ts": 48.0, "dur": 2.0},      # 3 us: below the threshold
    ]

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

        def key_averages(self):
            return [SimpleNamespace(key="k1", count=2, self_device_time_total=3000.0),
                    SimpleNamespace(key="k2", count=1, self_device_time_total=1000.0),
                    SimpleNamespace(key="cpu", count=5, self_device_time_total=0.0)]

    out = bb.gpu_gaps(Prof(), 5.0)
    assert "gap     25.0 us before c" in out and "before d" not in out
    assert "0.025 ms idle in gaps >= 5 us, span 0.050 ms" in out
    table = bb.kernel_table(Prof(), 5).splitlines()
    assert "k1" in table[0] and "2x" in table[0] and "k2" in table[1] and "cpu" not in "".join(table)
    assert table[-1].strip() == "4.000 ms in all kernels"


# ---- ncu_stalls.py ------------------------------------------------------------------------------

def _source_csv(lines):
    """An `ncu --page source --csv` output: program output, the kernel-name row, the header, one row
    per (address, source, {reason: samples})."""
    reasons = ["stall_barrier", "stall_long_sb", "stall_wait"]
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)",
              "Warp Stall Sampling (Not-issued Samples)"] + reasons + [r + " (Not Issued)" for r in reasons]
    out = ["done", '"Kernel Name","void wgrad_kernel<...>"', ",".join(f'"{c}"' for c in header)]
    for addr, src, by in lines:
        vals = [addr, src, f"{sum(by.values()):,}", "0"] + [str(by.get(r, 0)) for r in reasons] + ["0"] * 3
        out.append(",".join(f'"{v}"' for v in vals))
    return "\n".join(out) + "\n"


def test_ncu_stalls_reports_reasons_and_the_lines_with_most_samples():
    import ncu_stalls as mod

    text = _source_csv([("0x10", "HGMMA.64x256x16", {"stall_wait": 100}),
                        ("0x20", "@!P1 BRA 0x80", {"stall_long_sb": 1500, "stall_wait": 500}),
                        ("0x30", "WARPGROUP.DEPBAR.LE gsb0, 0x1", {"stall_barrier": 1000})])
    reasons, samples, lines = mod.read_source_csv(text)
    assert reasons == ["stall_barrier", "stall_long_sb", "stall_wait"] and len(lines) == 3
    report = mod.summarize(reasons, samples, lines, top=2)
    assert "3 SASS lines, 3100 samples" in report
    assert "long_sb 48.4%" in report and "barrier 32.3%" in report and "wait 19.4%" in report
    body = report.splitlines()[2:]
    assert len(body) == 2 and "0x20" in body[0] and "long_sb 48.4%, wait 16.1%" in body[0] and "0x30" in body[1]


def test_ncu_stalls_rejects_other_pages_and_empty_samples():
    import ncu_stalls as mod

    with pytest.raises(ValueError, match="no source-page header"):
        mod.read_source_csv('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(ValueError, match="no warp-stall samples"):
        mod.summarize(*mod.read_source_csv(_source_csv([("0x10", "NOP", {})])), top=5)


# ---- ab_builds ------------------------------------------------------------------------------------

def _fake_ab_dir(tmp_path):
    """An ab dir whose two 'libraries' are marker files, and a repository root beside it."""
    ab = tmp_path / "ab"
    for side in ("base", "cand"):
        (ab / side / "lib").mkdir(parents=True)
        (ab / side / "lib" / "libmegatron_mok.so").write_text(side)
    root = tmp_path / "root"
    root.mkdir()
    return ab, root


def test_ab_builds_order_takes_both_sides_and_nothing_else():
    import ab_builds

    assert ab_builds.parse_order("abba") == ["A", "B", "B", "A"]
    for bad in ("", "AAA", "ABC", "B"):
        with pytest.raises(ValueError, match="both A and B"):
            ab_builds.parse_order(bad)


def test_ab_builds_runs_each_side_in_its_tree_with_its_library(tmp_path):
    """Side A in the ref's tree, B in the root; each with its own MOK_LIBRARY, its tree first on
    PYTHONPATH and the root's path dropped from A's; lines labelled by run; the first failing
    run's status is returned and every run still runs."""
    import ab_builds

    ab, root = _fake_ab_dir(tmp_path)
    code = ("import os, sys; print(os.getcwd()); print(os.environ['MOK_LIBRARY']); "
            "print(os.environ['PYTHONPATH']); sys.exit(3 if os.getcwd().endswith('base') else 0)")
    out = io.StringIO()
    os_env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), "/elsewhere"])
    try:
        status = ab_builds.run(["A", "B", "B", "A"], [sys.executable, "-c", code], ab, root=root, out=out)
    finally:
        if os_env_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = os_env_path
    lines = out.getvalue().splitlines()
    by_run = {}
    for line in lines:
        label, _, rest = line.partition(" ")
        by_run.setdefault(label, []).append(rest)
    assert list(by_run) == ["A1", "B1", "B2", "A2"]
    for label, rows in by_run.items():
        side = "base" if label[0] == "A" else "cand"
        tree = ab / "base" if label[0] == "A" else root
        assert rows[0] == str(tree)
        assert rows[1] == str(ab / side / "lib" / "libmegatron_mok.so")
        assert rows[2].split(os.pathsep) == [str(tree), "/elsewhere"]
        assert rows[3] == f"exit {3 if label[0] == 'A' else 0}"
    assert status == 3


def test_ab_builds_run_needs_both_libraries(tmp_path):
    import ab_builds

    ab, root = _fake_ab_dir(tmp_path)
    (ab / "cand" / "lib" / "libmegatron_mok.so").unlink()
    with pytest.raises(FileNotFoundError, match="side B"):
        ab_builds.run(["A", "B"], [sys.executable, "-c", "pass"], ab, root=root, out=io.StringIO())


def test_ab_builds_prepare_exports_the_ref_and_builds_both_sides(tmp_path):
    """prepare on this repository with HEAD as the ref (the builder is a recorder): the ref's
    package, tools and csrc are exported, the builder gets (ref tree, its lib) and (root, cand lib),
    and the manifest names the commits."""
    import ab_builds

    built = []
    ab = tmp_path / "ab"
    manifest = ab_builds.prepare("HEAD", ab, build=lambda tree, out: built.append((tree, out)))
    for path in ab_builds.TREE_PATHS:
        assert (ab / "base" / path).is_dir(), path
    assert (ab / "base" / "megatron_mok" / "_build.py").is_file()
    assert built == [(ab / "base", ab / "base" / "lib"), (ab_builds.ROOT, ab / "cand" / "lib")]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert manifest["A"] == {"ref": "HEAD", "commit": head} and manifest["B"]["commit"] == head
    assert json.loads((ab / "manifest.json").read_text()) == manifest
    with pytest.raises(subprocess.CalledProcessError):
        ab_builds.prepare("no-such-ref-xyz", tmp_path / "ab2", build=lambda tree, out: None)
