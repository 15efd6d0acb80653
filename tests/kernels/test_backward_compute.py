"""The backward megakernel's compute launch (``mok_megakernel_backward_compute``,
``megatron_mok.ops.megakernel_backward``).

CPU: the C ABI rejects bad arguments before any CUDA call, and the counter buffer's size follows
the plan; the Python checks name the bad value before anything reaches the library.
GPU: the launch is bitwise the unfused chain it replaces (the fc2 data gradient with the SwiGLU
backward over gate|up, both weight gradients with counts, the fc1 data gradient pushing dX and
the router-weight gradient home): d gate|up, both weight gradients and every rank's slot region
byte for byte, outputs poisoned with NaN first, on layouts with empty experts, a one-row expert,
a hot expert and many small experts; P = 1 and three virtual ranks' regions; every CTA count from
one CTA to one per SM gives the same bits (a single CTA runs every tile and every wait itself), and
so does a traced launch, whose records cover every tile with their stamps in order.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from megatron_mok.ops import grouped_gemm as gg
from megatron_mok.ops import megakernel_backward as bwd

from tests.kernels.test_gemm_push import SLOTS_OFFSET, Homes, Layout, H, I, _assert_same_homes, _seed

MOK_OK, MOK_ERR_INVALID_ARGUMENT = 0, -1


# ---- CPU ---------------------------------------------------------------------------------------

def _args(**change) -> bwd.BackwardComputeArgs:
    p = 0x10000
    a = dict(dy=p, x=p, gu=p, router_weights=p, h=p, partials=p, fc1_weight=p, fc2_weight=p, d_fc1=p, d_fc2=p,
             offsets=p, counts=p, table=p, bases=p, slots_offset=4096, scalars_offset=64, counters=p,
             counter_words=1 << 20, status=p, timeout_ns=10**9, rank=0, rows=1024, L=4, H=H, I=I, num_ctas=0,
             trace=None, trace_capacity=0)
    a.update(change)
    return bwd.BackwardComputeArgs(**a)


def test_c_abi_rejects_bad_arguments_before_any_launch(lib):
    """Every call below fails its checks before any CUDA call (no pointer is dereferenced), so
    this runs without a GPU."""
    run = lib.function("mok_megakernel_backward_compute", ctypes.c_int,
                       [ctypes.POINTER(bwd.BackwardComputeArgs), ctypes.c_void_p])
    words = lib.function("mok_megakernel_backward_compute_counter_words", ctypes.c_int64,
                         [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int])
    assert run(None, None) == MOK_ERR_INVALID_ARGUMENT
    for bad in (dict(dy=None), dict(gu=None), dict(partials=None), dict(fc1_weight=None), dict(d_fc2=None),
                dict(offsets=None), dict(counts=None), dict(table=None), dict(bases=None), dict(counters=None),
                dict(status=None), dict(table=0x10004), dict(d_fc1=0x10008), dict(slots_offset=8),
                dict(scalars_offset=2), dict(timeout_ns=0), dict(rank=-1), dict(rows=1000), dict(rows=-128),
                dict(L=0), dict(L=1025), dict(H=1000), dict(I=384), dict(counter_words=16),
                dict(trace=0x10000, trace_capacity=0), dict(trace=0x10008, trace_capacity=64)):
        assert run(ctypes.byref(_args(**bad)), None) == MOK_ERR_INVALID_ARGUMENT, bad
    assert words(1024, 4, H, I) > 0
    assert words(1024, 48, H, I) > words(1024, 4, H, I)  # unit counters per expert
    assert words(4096, 4, H, I) > words(1024, 4, H, I)   # slot counters per row block
    for bad in ((1000, 4, H, I), (1024, 0, H, I), (1024, 4, 640, I), (1024, 4, H, 128)):
        assert words(*bad) == -1, bad


def _cpu_operands(R=256, L=4):
    bf = dict(dtype=torch.bfloat16)
    return dict(dy=torch.zeros(R, H, **bf), x=torch.zeros(R, H, **bf), gu=torch.zeros(R, 2 * I, **bf),
                router_weights=torch.zeros(R), fc1_weight=torch.zeros(L, 2 * I, H, **bf),
                fc2_weight=torch.zeros(L, H, I, **bf), offsets=torch.zeros(L + 1, dtype=torch.int32),
                counts=torch.zeros(L, dtype=torch.int32), table=torch.zeros(R, 2, dtype=torch.int32),
                bases=torch.zeros(1, dtype=torch.int64), slots_offset=4096, scalars_offset=64,
                status=torch.zeros(8, dtype=torch.int32), timeout_s=1.0, rank=0)


@pytest.mark.parametrize("change, message", [
    (dict(dy=torch.zeros(256, H)), r"dy must be a contiguous torch.bfloat16 tensor"),
    (dict(x=torch.zeros(128, H, dtype=torch.bfloat16)), r"x must be .* shape \(256, 1024\)"),
    (dict(gu=torch.zeros(256, I, dtype=torch.bfloat16)), r"gu must be .* shape \(256, 1024\)"),
    (dict(router_weights=torch.zeros(256, dtype=torch.float64)), "router_weights must be"),
    (dict(fc2_weight=torch.zeros(4, H, 256, dtype=torch.bfloat16)), r"fc2_weight must be .* \(4, 1024, 512\)"),
    (dict(counts=torch.zeros(3, dtype=torch.int32)), r"counts must be .* shape \(4,\)"),
    (dict(table=torch.zeros(256, 2, dtype=torch.int64)), "table must be"),
    (dict(trace=torch.zeros(16, 5, dtype=torch.int64)), r"trace must be a contiguous int64 tensor \[N, 6\]"),
])
def test_checks_name_the_bad_value(change, message):
    a = _cpu_operands()
    a.update(change)
    with pytest.raises(gg.GemmArgumentError, match=message):
        bwd.backward_compute(**a)


def test_rows_not_in_whole_blocks_and_unsupported_widths_are_clear_errors():
    a = _cpu_operands(R=200)
    with pytest.raises(gg.GemmArgumentError, match="R = 200 must be a multiple of 128"):
        bwd.backward_compute(**a)
    assert not bwd.applies(1024, 384, 128, 1, False)
    assert not bwd.applies(1024, 512, 64, 1, False)
    assert not bwd.applies(1024, 512, 128, 2, False)
    assert not bwd.applies(1024, 512, 128, 1, True)
    assert bwd.applies(7168, 2048, 128, 1, False)


# ---- GPU ---------------------------------------------------------------------------------------

MANY = [37, 0, 170, 129, 1, 256, 0, 91] * 6  # 48 experts of ~100 rows, empties and whole blocks
LAYOUTS = {"small": [0, 1, 130, 700, 63, 0, 2500, 64], "many": MANY}


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _inputs(lay: Layout):
    dev = "cuda"
    dy = torch.randn(lay.R, H, device=dev).bfloat16()
    x = torch.randn(lay.R, H, device=dev).bfloat16()
    gu = (2 * torch.randn(lay.R, 2 * I, device=dev)).bfloat16()
    w = torch.rand(lay.R, device=dev)
    fc1 = (torch.randn(lay.L, 2 * I, H, device=dev) / H ** 0.5).bfloat16()
    fc2 = (torch.randn(lay.L, H, I, device=dev) / I ** 0.5).bfloat16()
    return dy, x, gu, w, fc1, fc2


def _unfused(lay: Layout, homes: Homes, dy, x, gu, w, fc1, fc2):
    """The chain training.moe_backward runs without the launch: (d gate|up, d fc1, d fc2)."""
    d_gu = gu.clone()
    dw_rows, h = gg.fc2_dgrad_swiglu_(dy, fc2, d_gu, lay.offsets_d, lay.counts_d, w, tile_rows=128, want_h=True)
    d_fc2, d_fc1 = _nan_like(fc2), _nan_like(fc1)
    for a, b, out in ((dy, h, d_fc2), (d_gu, x, d_fc1)):
        gg.weight_grad_rows(a, b, lay.offsets_d, out, row0=0, row1=lay.R, carry_in=None, carry_out=None,
                            counts=lay.counts_d)
    gg.launch_fc1_dgrad_push(d_gu, fc1, lay.offsets_d, homes.table, homes.bases, SLOTS_OFFSET, dw_rows,
                             homes.scalars_offset, variant=gg.push_variant("dgrad", 128))
    return d_gu, d_fc1, d_fc2


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _trace_buffer(lay: Layout) -> torch.Tensor:
    """Records for every item the launch can have (2 per item) and one per CTA."""
    blocks = lay.R // 128
    w_tiles = (2 * I // 128) * (H // 256) + (H // 128) * (I // 256)
    items = blocks * (I // 256 + H // 256) + lay.L * w_tiles
    return torch.zeros(2 * items + 1024, 6, dtype=torch.int64, device="cuda")


def _assert_trace_is_a_timeline(trace: torch.Tensor, lay: Layout, label: str) -> None:
    """Every D2 and D1 tile of the layout has an item record whose stamps are in order, and the W
    items cover every weight-gradient tile of the experts with rows."""
    rec = trace.cpu()[:-1024]  # the CTAs' records are in the last 1024
    items, extra = rec[0::2], rec[1::2]
    written = items[:, 0] > 0
    n = int(written.sum())
    assert n > 0 and bool(written[:n].all()) and not bool(written[n:].any()), f"{label}: items not 0 .. n-1"
    items, extra = items[:n], extra[:n]
    kind = items[:, 4] & 0xFF
    assert set(kind.tolist()) <= {8, 9, 10}, f"{label}: kinds {set(kind.tolist())}"
    for a, b in ((0, 1), (1, 2), (2, 3)):
        assert bool((items[:, a] <= items[:, b]).all()), f"{label}: stamps {a} > {b}"
    blocks = lay.R_pad // 128
    assert int((kind == 8).sum()) == blocks * (I // 256), f"{label}: D2 tiles"
    assert int((kind == 9).sum()) == blocks * (H // 256), f"{label}: D1 tiles"
    d2 = kind == 8
    assert bool((extra[d2, 3] >= items[d2, 2]).all()), f"{label}: a D2 offload released before its MMAs began"
    w_tiles = (2 * I // 128) * (H // 256) + (H // 128) * (I // 256)
    experts = sum(1 for c in lay.counts if c > 0)
    assert int(extra[kind == 10, 4].sum()) == experts * w_tiles, f"{label}: W tiles"


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_launch_is_bitwise_the_unfused_chain(layout, P):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lay = Layout(LAYOUTS[layout], 128)
    homes = Homes(lay, P, gen)
    dy, x, gu, w, fc1, fc2 = _inputs(lay)
    ref = homes.fresh()
    d_gu, d_fc1, d_fc2 = _unfused(lay, ref, dy, x, gu, w, fc1, fc2)
    assert not torch.isnan(d_fc1).any() and not torch.isnan(d_fc2).any()
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    for num_ctas, traced in ((0, False), (0, True), (7, False), (1, False)):
        label = f"{layout}, P={P}, ctas={num_ctas}, traced={traced} (seed {seed})"
        trace = _trace_buffer(lay) if traced else None
        fused = homes.fresh()
        f_gu = gu.clone()
        f_fc1, f_fc2 = _nan_like(fc1), _nan_like(fc2)
        bwd.backward_compute(dy, x, f_gu, w, fc1, fc2, lay.offsets_d, lay.counts_d, homes.table, fused.bases,
                             SLOTS_OFFSET, fused.scalars_offset, status, 20.0, 0, num_ctas=num_ctas, d_fc1=f_fc1,
                             d_fc2=f_fc2, trace=trace)
        torch.cuda.synchronize()
        assert status.abs().sum().item() == 0, f"{label}: status {status.tolist()}"
        assert _same_bits(f_gu, d_gu), f"{label}: d gate|up differs"
        assert _same_bits(f_fc1, d_fc1), f"{label}: d fc1 differs"
        assert _same_bits(f_fc2, d_fc2), f"{label}: d fc2 differs"
        _assert_same_homes(fused, ref, True, label)
        if traced:
            _assert_trace_is_a_timeline(trace, lay, label)
