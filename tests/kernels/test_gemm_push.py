"""The row GEMMs that push their output rows home from the epilogue (``mok_gemm_fc2_push``,
``mok_gemm_fc1_dgrad_push``; ``grouped_gemm.fc2_push`` / ``fc1_dgrad_push``).

CPU: the C ABI rejects bad push arguments before any CUDA call and builds exactly the variants
the Python side picks; the Python checks name the bad value before anything reaches the
library; the wrappers pass sizes, offsets and the variant through; the fakes trace. GPU: the
fused kernel is bitwise the plain GEMM followed by ``comm.push_rows``, compared byte for byte
over every rank's whole slot region (NaN-poisoned first): the pushed rows equal, padding rows,
table entries of -1, rows past offsets[L] and routes no row names still poisoned. On layouts with
empty experts, rows that are not tile multiples, a hot expert and several column blocks; P = 1
and three virtual ranks (three regions on one GPU); every built variant; few and many CTAs; over
chunks of the layout (a table slice, chunk-relative offsets) and weight segments, as the cuda
backend's training path runs them.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_mok.ops import grouped_gemm as gg

MOK_OK, MOK_ERR_INVALID_ARGUMENT, MOK_ERR_UNSUPPORTED = 0, -1, -2
H, I = 1024, 512


# ---- CPU: the C ABI ----------------------------------------------------------------------------

def _c_functions(lib):
    i, i64, v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fc2 = lib.function("mok_gemm_fc2_push", i, [v, v, v, v, v, i64, i64, i, i, i, i, i, i, v])
    dgrad = lib.function("mok_gemm_fc1_dgrad_push", i, [v, v, v, v, v, i64, v, i64, i64, i, i, i, i, i, i, v])
    return fc2, dgrad


def test_c_abi_rejects_bad_push_arguments_before_any_launch(lib):
    """Each call fails its checks before any CUDA call (the pointers are never dereferenced), so
    this runs without a GPU."""
    fc2, dgrad = _c_functions(lib)
    p = ctypes.c_void_p(0x10000)
    odd = ctypes.c_void_p(0x10004)  # 4-byte aligned: not an int2 table

    def f2(**kw):
        a = dict(h=p, w=p, offsets=p, table=p, bases=p, slots=256, rows=256, L=4, H=H, I=I, bm=128, wgn=256, ctas=0)
        a.update(kw)
        return fc2(a["h"], a["w"], a["offsets"], a["table"], a["bases"], a["slots"], a["rows"], a["L"], a["H"],
                   a["I"], a["bm"], a["wgn"], a["ctas"], None)

    def d1(**kw):
        a = dict(dgu=p, w=p, offsets=p, table=p, bases=p, slots=256, scalars=p, scalars_offset=64, rows=256, L=4,
                 H=H, I=I, bm=128, wgn=256, ctas=0)
        a.update(kw)
        return dgrad(a["dgu"], a["w"], a["offsets"], a["table"], a["bases"], a["slots"], a["scalars"],
                     a["scalars_offset"], a["rows"], a["L"], a["H"], a["I"], a["bm"], a["wgn"], a["ctas"], None)

    for call in (f2, d1):
        for bad in (dict(table=None), dict(bases=None), dict(offsets=None), dict(table=odd), dict(slots=8),
                    dict(slots=-16), dict(L=0), dict(L=5000), dict(rows=-1), dict(H=0), dict(I=0)):
            assert call(**bad) == MOK_ERR_INVALID_ARGUMENT, (call.__name__, bad)
        assert call(H=1000) == MOK_ERR_INVALID_ARGUMENT  # H not a multiple of the tile's 256 columns
        assert call(bm=96) == MOK_ERR_UNSUPPORTED
        assert call(bm=128, wgn=128) == MOK_ERR_UNSUPPORTED
        assert call(rows=0) == MOK_OK  # an empty layout: nothing to do, no CUDA call
    assert f2(h=None) == MOK_ERR_INVALID_ARGUMENT
    assert d1(dgu=None) == MOK_ERR_INVALID_ARGUMENT
    assert d1(scalars_offset=6) == MOK_ERR_INVALID_ARGUMENT  # fp32 scalar slots
    assert d1(scalars_offset=-4) == MOK_ERR_INVALID_ARGUMENT
    assert d1(scalars=None, scalars_offset=6, rows=32) == MOK_OK  # no scalars: the offset is not used
    assert d1(wgn=128, bm=64, rows=32) == MOK_ERR_UNSUPPORTED  # not a variant of the plain fc1 dgrad


def test_the_library_builds_every_push_variant_python_picks(lib):
    """With fewer rows than a row block the entry points return before any CUDA call once the
    variant is found: MOK_OK for every entry of PUSH_VARIANTS (which holds every layout's
    default), MOK_ERR_UNSUPPORTED for a tile the unfused kernel builds only TMA-staged."""
    fc2, dgrad = _c_functions(lib)
    p = ctypes.c_void_p(0x10000)
    call = {"fc2": lambda v: fc2(p, p, p, p, p, 0, 32, 4, H, I, v.block_m, v.wg_n, 0, None),
            "dgrad": lambda v: dgrad(p, p, p, p, p, 0, p, 0, 32, 4, H, I, v.block_m, v.wg_n, 0, None)}
    for kernel in ("fc2", "dgrad"):
        assert gg.PUSH_VARIANTS[kernel], kernel
        for v in gg.PUSH_VARIANTS[kernel]:
            assert call[kernel](v) == MOK_OK, (kernel, v)
        for tile in (128, 64):
            assert gg.push_variant(kernel, tile) in gg.PUSH_VARIANTS[kernel]
        for v in gg.VARIANTS[kernel] - gg.PUSH_VARIANTS[kernel]:
            if (v.block_m, v.wg_n) not in {(u.block_m, u.wg_n) for u in gg.PUSH_VARIANTS[kernel]}:
                assert call[kernel](v) == MOK_ERR_UNSUPPORTED, (kernel, v)


# ---- CPU: the Python checks ------------------------------------------------------------------

def _cpu_args(R=256, L=4, P=2):
    h = torch.zeros(R, I, dtype=torch.bfloat16)
    dgu = torch.zeros(R, 2 * I, dtype=torch.bfloat16)
    w1 = torch.zeros(L, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.zeros(L, H, I, dtype=torch.bfloat16)
    offsets = torch.zeros(L + 1, dtype=torch.int32)
    table = torch.zeros(R, 2, dtype=torch.int32)
    bases = torch.zeros(P, dtype=torch.int64)
    dw = torch.zeros(R)
    return h, dgu, w1, w2, offsets, table, bases, dw


def _no_library(monkeypatch):
    def fail():
        raise AssertionError("the library was reached: the arguments should have been rejected first")
    monkeypatch.setattr(gg, "_lib", fail)


@pytest.mark.parametrize("change, message", [
    (dict(table=torch.zeros(256, 2, dtype=torch.int64)), "table must be torch.int32"),
    (dict(table=torch.zeros(256, 3, dtype=torch.int32)), r"table must be int32 \[R=256, 2\]"),
    (dict(table=torch.zeros(255, 2, dtype=torch.int32)), r"table must be int32 \[R=256, 2\] .* got \(255, 2\)"),
    (dict(table=torch.zeros(2, 256, dtype=torch.int32).t()), "table must be contiguous"),
    (dict(table=torch.zeros(512, dtype=torch.int32)), "table must have 2 dimensions"),
    (dict(bases=torch.zeros(2, dtype=torch.int32)), "bases must be torch.int64"),
    (dict(bases=torch.zeros(0, dtype=torch.int64)), r"bases must hold the workspace address of every rank"),
    (dict(bases=torch.zeros(2, 1, dtype=torch.int64)), "bases must have 1 dimensions"),
    (dict(slots_offset=8), "slots_offset = 8 must be a non-negative multiple of 16"),
    (dict(slots_offset=-16), "slots_offset = -16 must be a non-negative multiple of 16"),
    (dict(slots_offset=16.0), "slots_offset must be an int"),
    (dict(slots_offset=True), "slots_offset must be an int"),
    (dict(row_scalars=torch.zeros(256, dtype=torch.float64)), "row_scalars must be torch.float32"),
    (dict(row_scalars=torch.zeros(200)), r"row_scalars must have one entry per row \(R = 256\), got 200"),
    (dict(scalars_offset=6), "scalars_offset = 6 must be a non-negative multiple of 4"),
    (dict(dgu=torch.zeros(256, 2 * I)), "dgu must be torch.bfloat16"),
    (dict(w1=torch.zeros(4, 2 * I, 640, dtype=torch.bfloat16)), r"H = 640 must be a multiple of 256"),
    (dict(tile_rows=32), "tile_rows = 32"),
    (dict(tile_rows=64, wg_n=128), "is not built"),
])
def test_fc1_dgrad_push_checks_name_the_bad_value(monkeypatch, change, message):
    _no_library(monkeypatch)
    h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args()
    a = dict(dgu=dgu, w1=w1, table=table, bases=bases, slots_offset=4096, row_scalars=dw, scalars_offset=64,
             tile_rows=128, wg_n=None)
    a.update(change)
    with pytest.raises(gg.GemmArgumentError, match=message):
        gg.fc1_dgrad_push(a["dgu"], a["w1"], offsets, a["table"], a["bases"], a["slots_offset"], a["row_scalars"],
                          a["scalars_offset"], tile_rows=a["tile_rows"], wg_n=a["wg_n"])


@pytest.mark.parametrize("change, message", [
    (dict(h=torch.zeros(256, I)), "h must be torch.bfloat16"),
    (dict(w2=torch.zeros(4, H, 256, dtype=torch.bfloat16)), r"fc2_weight must be \[L, H, I=512\]"),
    (dict(w2=torch.zeros(4, 640, I, dtype=torch.bfloat16)), r"H = 640 must be a multiple of 256"),
    (dict(table=torch.zeros(128, 2, dtype=torch.int32)), r"table must be int32 \[R=256, 2\]"),
    (dict(bases=[0, 0]), "bases must be a tensor"),
    (dict(slots_offset=24), "slots_offset = 24 must be a non-negative multiple of 16"),
    (dict(block_m=64, wg_n=512), "is not built"),
])
def test_fc2_push_checks_name_the_bad_value(monkeypatch, change, message):
    _no_library(monkeypatch)
    h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args()
    a = dict(h=h, w2=w2, table=table, bases=bases, slots_offset=0, block_m=None, wg_n=None)
    a.update(change)
    with pytest.raises(gg.GemmArgumentError, match=message):
        gg.fc2_push(a["h"], a["w2"], offsets, a["table"], a["bases"], a["slots_offset"], block_m=a["block_m"],
                    wg_n=a["wg_n"])


def test_push_variants_are_the_unfused_tiles_with_direct_stores():
    """The pushing kernels run the unfused kernel's tile (so its K loop and its bits), with
    direct stores and single CTAs; the checks return that variant."""
    h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args()
    for kernel in ("fc2", "dgrad"):
        for tile in (128, 64):
            want = gg.DEFAULTS[kernel][tile]._replace(tma_store=False, multicast=False)
            assert gg.push_variant(kernel, tile) == want, (kernel, tile)
    assert gg.check_fc2_push(h, w2, offsets, table, bases, 0, 64) == gg.push_variant("fc2", 64)
    assert gg.check_fc1_dgrad_push(dgu, w1, offsets, table, bases, 16, None, 3, 128) == gg.push_variant("dgrad", 128)
    assert gg.check_fc2_push(h, w2, offsets, table, bases, 0, 128, block_m=64) == gg.Variant(64, 256, False, False)


def test_push_wrappers_pass_sizes_offsets_and_variant_through(monkeypatch):
    """The wrappers, ops and launchers hand the C functions the pointers, sizes, byte offsets and
    the variant (the C side is replaced by a recorder: runs without a GPU)."""
    calls = {}

    class Recorder:
        def check(self, code, what):
            assert code == 0, what

    def fake_lib():
        def record(name):
            def fn(*args):
                calls[name] = args
                return 0
            return fn
        return Recorder(), {k: record(k) for k in ("fc2_push", "fc1_dgrad_push")}

    monkeypatch.setattr(gg, "_lib", fake_lib)
    monkeypatch.setattr(gg, "stream_of", lambda t: ctypes.c_void_p(0))
    h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args(R=384, L=4)
    address = lambda t: ctypes.c_void_p(t.data_ptr()).value
    value = lambda c: c.value if isinstance(c, ctypes.c_void_p) else c

    assert gg.fc2_push(h, w2, offsets, table, bases, 4096, tile_rows=64) is None
    args = [value(a) for a in calls["fc2_push"]]
    assert args[:5] == [address(h), address(w2), address(offsets), address(table), address(bases)]
    assert args[5:13] == [4096, 384, 4, H, I, 64, 128, 0]

    gg.fc1_dgrad_push(dgu, w1, offsets, table, bases, 1 << 20, dw, 512)
    args = [value(a) for a in calls["fc1_dgrad_push"]]
    assert args[:8] == [address(dgu), address(w1), address(offsets), address(table), address(bases), 1 << 20,
                        address(dw), 512]
    assert args[8:15] == [384, 4, H, I, 128, 256, 0]
    gg.fc1_dgrad_push(dgu, w1, offsets, table, bases, 0, tile_rows=64, num_ctas=7)
    args = [value(a) for a in calls["fc1_dgrad_push"]]
    assert args[6] is None and args[8:15] == [384, 4, H, I, 64, 256, 7]


def test_push_fakes_give_no_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args()
        assert torch.ops.mok.gemm_fc2_push(h, w2, offsets, table, bases, 0, [128, 256, 0, 0], 0) is None
        assert torch.ops.mok.gemm_fc1_dgrad_push(dgu, w1, offsets, table, bases, 0, dw, 64, [128, 256, 0, 0],
                                                 0) is None
        assert torch.ops.mok.gemm_fc1_dgrad_push(dgu, w1, offsets, table, bases, 0, None, 0, [64, 256, 0, 0],
                                                 0) is None


def test_push_wrappers_trace_under_torch_compile(monkeypatch):
    """fullgraph tracing through the checks and the custom ops (the C side is a recorder, so the
    compiled graph runs on the CPU): both ops reach the library once per call, with the eager
    call's arguments."""
    calls = []

    class Recorder:
        def check(self, code, what):
            assert code == 0, what

    def fake_lib():
        def record(name):
            return lambda *args: calls.append((name, [a.value if isinstance(a, ctypes.c_void_p) else a
                                                      for a in args])) or 0
        return Recorder(), {k: record(k) for k in ("fc2_push", "fc1_dgrad_push")}

    monkeypatch.setattr(gg, "_lib", fake_lib)
    monkeypatch.setattr(gg, "stream_of", lambda t: ctypes.c_void_p(0))
    h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args()

    def both(h, w2, dgu, w1, offsets, table, bases, dw):
        gg.fc2_push(h, w2, offsets, table, bases, 4096, tile_rows=64)
        gg.fc1_dgrad_push(dgu, w1, offsets, table, bases, 4096, dw, 128)
        return h + 1

    both(h, w2, dgu, w1, offsets, table, bases, dw)
    eager = list(calls)
    calls.clear()
    torch._dynamo.reset()
    torch.compile(both, fullgraph=True, backend="aot_eager")(h, w2, dgu, w1, offsets, table, bases, dw)
    assert [name for name, _ in eager] == ["fc2_push", "fc1_dgrad_push"]
    assert [name for name, _ in calls] == ["fc2_push", "fc1_dgrad_push"]
    pointers = {"fc2_push": range(5), "fc1_dgrad_push": (0, 1, 2, 3, 4, 6)}  # (traced operands may be copies)
    for (name, a), (_, b) in zip(eager, calls):
        plain = [i for i in range(len(a)) if i not in pointers[name]]
        assert [a[i] for i in plain] == [b[i] for i in plain], name  # sizes, byte offsets, variant


def test_training_checks_every_weight_segment_before_the_first_launch(monkeypatch):
    """training._push_rows_from_gemm (the cuda backend's fused push) rejects a bad second weight
    segment before it launches the first."""
    from megatron_mok.functional import training
    from megatron_mok.functional.expert_ffn import ExpertCall

    launched = []
    monkeypatch.setattr(gg, "gemm_fc1_dgrad_push_op", lambda *a: launched.append(a))
    monkeypatch.setattr(gg, "gemm_fc2_push_op", lambda *a: launched.append(a))
    h, dgu, w1, w2, offsets, table, bases, dw = _cpu_args(L=4)
    ws = SimpleNamespace(bases=bases, layout=SimpleNamespace(slots=4096, scalars=64))
    call = ExpertCall(segment_rows=128, timeout_s=1.0, num_experts=8, hopper_gemms=True)
    counts = torch.zeros(4, dtype=torch.int32)
    bad = torch.zeros(1, 2 * I, H)  # fp32
    with pytest.raises(gg.GemmArgumentError, match="fc1_weight must be torch.bfloat16"):
        training._push_rows_from_gemm(ws, call, False, dgu, (w1[:3], bad), offsets, counts, table, dw)
    with pytest.raises(gg.GemmArgumentError, match="fc2_weight must be"):
        training._push_rows_from_gemm(ws, call, True, h, (w2[:3], w2[:1, :, :256].contiguous()), offsets, counts,
                                      table)
    assert launched == []
    training._push_rows_from_gemm(ws, call, False, dgu, (w1[:3], w1[3:]), offsets, counts, table, dw)
    assert len(launched) == 2
    assert [a[2].numel() for a in launched] == [4, 2]  # each segment's offsets, from its first expert on
    assert all(a[3] is table and a[5] == 4096 and a[6] is dw and a[7] == 64 for a in launched)


# ---- GPU ---------------------------------------------------------------------------------------

SMALL = [0, 1, 130, 700, 63, 0, 2500, 64]  # empty, one row, not tile multiples, a hot expert
SLOTS_OFFSET = 4096                        # the slots do not start at the region's base


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


class Layout:
    """counts per expert, segments padded to ``tile``, ``extra`` spare rows past R_pad."""

    def __init__(self, counts, tile, extra=None):
        self.counts, self.tile = list(counts), tile
        self.offsets = [0]
        for c in self.counts:
            self.offsets.append(self.offsets[-1] + -(-c // tile) * tile)
        self.R_pad = self.offsets[-1]
        self.R = self.R_pad + (2 * tile if extra is None else extra)
        self.L = len(self.counts)
        self.offsets_d = torch.tensor(self.offsets, dtype=torch.int32, device="cuda")
        self.counts_d = torch.tensor(self.counts, dtype=torch.int32, device="cuda")

    def real_mask(self):
        m = torch.zeros(self.R, dtype=torch.bool)
        for l, c in enumerate(self.counts):
            m[self.offsets[l]:self.offsets[l] + c] = True
        return m


class Homes:
    """P ranks' workspace regions on one GPU (virtual ranks): bf16 slots [routes, H] at
    SLOTS_OFFSET and fp32 scalar slots [routes] after them, everything poisoned with 0xFF bytes
    (NaN in bf16 and fp32); and a table for a layout: each real row a distinct route of a random
    rank, about a tenth of the real rows -1 (a dropped slot), padding rows -1, rows past R_pad a
    valid-looking entry. Padding and -1 entries name routes that no pushed row names, so a push
    that ignored the -1 would show."""

    def __init__(self, lay: Layout, P: int, gen: torch.Generator):
        R = lay.R
        self.P, self.routes = P, 2 * R + 64
        self.scalars_offset = SLOTS_OFFSET + self.routes * H * 2
        self.regions = [torch.full((self.scalars_offset + 4 * self.routes + 256,), 255, dtype=torch.uint8,
                                   device="cuda") for _ in range(P)]
        self.bases = torch.tensor([r.data_ptr() for r in self.regions], dtype=torch.int64, device="cuda")
        perm = torch.randperm(self.routes, generator=gen)
        src = torch.randint(0, P, (R,), generator=gen, dtype=torch.int32)
        real = lay.real_mask()
        dropped = real & (torch.rand(R, generator=gen) < 0.1)
        self.pushed = real & ~dropped
        table = torch.stack([src, perm[:R].to(torch.int32)], 1)
        table[~real, 0] = -1
        table[dropped, 0] = -1
        table[lay.R_pad:, 0] = src[lay.R_pad:]  # never pushed: past offsets[L]
        self.table_cpu = table
        self.table = table.cuda()

    def fresh(self) -> "Homes":
        """The same table and geometry with newly poisoned regions."""
        other = object.__new__(Homes)
        other.__dict__.update(self.__dict__)
        other.regions = [torch.full_like(r, 255) for r in self.regions]
        other.bases = torch.tensor([r.data_ptr() for r in other.regions], dtype=torch.int64, device="cuda")
        return other

    def slots(self, rank: int) -> torch.Tensor:
        return self.regions[rank][SLOTS_OFFSET:self.scalars_offset].view(torch.bfloat16).view(self.routes, H)

    def scalars(self, rank: int) -> torch.Tensor:
        return self.regions[rank][self.scalars_offset:self.scalars_offset + 4 * self.routes].view(torch.float32)


def _assert_same_homes(fused: Homes, ref: Homes, with_scalars: bool, label: str) -> None:
    """Byte for byte the same regions, and the pushed routes written (not NaN) while every other
    byte of every region is still poison (so equal regions cannot come from neither writing)."""
    torch.cuda.synchronize()
    for r in range(fused.P):
        assert torch.equal(fused.regions[r], ref.regions[r]), f"{label}: rank {r}'s region differs from GEMM + push"
    written = {r: torch.zeros(fused.routes, dtype=torch.bool) for r in range(fused.P)}
    for i in torch.nonzero(fused.pushed).flatten().tolist():
        s, route = fused.table_cpu[i].tolist()
        written[s][route] = True
    for r in range(fused.P):
        w = written[r].cuda()
        slots = fused.slots(r)
        assert not torch.isnan(slots[w]).any(), f"{label}: rank {r}: a pushed row is missing"
        assert (slots[~w].view(torch.int16) == -1).all(), f"{label}: rank {r}: a row no pushed row names was written"
        scalars = fused.scalars(r)
        if with_scalars:
            assert not torch.isnan(scalars[w]).any(), f"{label}: rank {r}: a pushed scalar is missing"
            assert (scalars[~w].view(torch.int32) == -1).all(), f"{label}: rank {r}: a stray scalar was written"
        else:
            assert (scalars.view(torch.int32) == -1).all(), f"{label}: rank {r}: scalars written without scalars"
        region = fused.regions[r]
        outside = torch.cat([region[:SLOTS_OFFSET], region[fused.scalars_offset + 4 * fused.routes:]])
        assert (outside == 255).all(), f"{label}: rank {r}: bytes outside the slots were written"


def _operands(kind: str, lay: Layout):
    """(A, weight) of the kind: fc2 h [R, I] and fc2_weight [L, H, I]; dgrad d gate|up [R, 2I] and
    fc1_weight [L, 2I, H]."""
    if kind == "fc2":
        return (torch.randn(lay.R, I, device="cuda").bfloat16(),
                (torch.randn(lay.L, H, I, device="cuda") / I ** 0.5).bfloat16())
    return (torch.randn(lay.R, 2 * I, device="cuda").bfloat16(),
            (torch.randn(lay.L, 2 * I, H, device="cuda") / (2 * I) ** 0.5).bfloat16())


def _reference(kind, a, w, offsets, homes: Homes, dw, variant, topk=8):
    """The unfused path: the plain GEMM into [R, H], then the push kernel."""
    from megatron_mok.ops import comm as comm_ops

    rows = torch.full((a.shape[0], H), float("nan"), dtype=torch.bfloat16, device="cuda")
    if kind == "fc2":
        gg.launch_fc2(a, w, offsets, rows, variant=variant)
    else:
        gg.launch_fc1_dgrad(a, w, offsets, rows, variant=variant)
    comm_ops.push_rows(homes.bases, SLOTS_OFFSET, homes.scalars_offset, homes.table, offsets, topk, rows, dw, 0)


def _fused(kind, a, w, offsets, table, homes: Homes, dw, variant, num_ctas=0):
    if kind == "fc2":
        gg.launch_fc2_push(a, w, offsets, table, homes.bases, SLOTS_OFFSET, variant=variant, num_ctas=num_ctas)
    else:
        gg.launch_fc1_dgrad_push(a, w, offsets, table, homes.bases, SLOTS_OFFSET, dw, homes.scalars_offset,
                                 variant=variant, num_ctas=num_ctas)


def _kinds():
    """(kind, with router-weight scalars)."""
    return [("fc2", False), ("dgrad", False), ("dgrad", True)]


def _configs():
    """(kind, scalars, tile_rows, push variant) for every built push variant on each layout it takes."""
    return [(kind, scalars, tile, v) for kind, scalars in _kinds() for tile in (128, 64)
            for v in sorted(gg.PUSH_VARIANTS[kind]) if tile % v.block_m == 0]


def _cfg_id(c):
    kind, scalars, tile, v = c
    return f"{kind}{'-dw' if scalars else ''}-t{tile}-m{v.block_m}n{v.wg_n}"


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("cfg", _configs(), ids=_cfg_id)
def test_fused_push_is_bitwise_gemm_then_push(cfg, P):
    """Against the plain GEMM with the same tile, direct and (where the layout's default is that
    tile) TMA-staged, followed by mok_push_rows: every rank's region byte for byte, for one CTA
    per SM and for three CTAs walking many tiles each."""
    kind, scalars, tile, v = cfg
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lay = Layout(SMALL, tile)
    a, w = _operands(kind, lay)
    dw = torch.randn(lay.R, device="cuda") if scalars else None
    homes = Homes(lay, P, gen)
    plain = "fc2" if kind == "fc2" else "dgrad"
    refs = [gg.Variant(v.block_m, v.wg_n, False, False)]
    default = gg.DEFAULTS[plain][tile]
    if (default.block_m, default.wg_n) == (v.block_m, v.wg_n) and default != refs[0]:
        refs.append(default)
    for ref_variant in refs:
        ref = homes.fresh()
        _reference(kind, a, w, lay.offsets_d, ref, dw, ref_variant)
        for num_ctas in (0, 3):
            fused = homes.fresh()
            _fused(kind, a, w, lay.offsets_d, homes.table, fused, dw, v, num_ctas)
            _assert_same_homes(fused, ref, scalars, f"{_cfg_id(cfg)}, P={P}, ctas={num_ctas}, reference "
                                                    f"{tuple(ref_variant)} (seed {seed})")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("kind, scalars", _kinds(), ids=["fc2", "dgrad", "dgrad-dw"])
def test_fused_push_over_chunks_and_weight_segments(kind, scalars, tile):
    """As the cuda backend's training path runs it: the layout walked in chunks (each chunk's rows
    of A, its slice of the table, its chunk-relative offsets and counts from
    training.chunk_layout) and, in each chunk, one launch per weight segment (offsets from the
    segment's first expert on) through the public wrappers: bitwise the whole-layout GEMM followed
    by one push over the whole table. Chunks of three tiles cut through the segments."""
    from megatron_mok.functional import training

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lay = Layout(SMALL, tile)
    a, w = _operands(kind, lay)
    dw = torch.randn(lay.R, device="cuda") if scalars else None
    homes = Homes(lay, 2, gen)
    ref = homes.fresh()
    plain = "fc2" if kind == "fc2" else "dgrad"
    _reference(kind, a, w, lay.offsets_d, ref, dw, gg.DEFAULTS[plain][tile])
    fused = homes.fresh()
    l0 = 5
    segments = [(w[:l0].contiguous(), 0, l0), (w[l0:].contiguous(), l0, lay.L)]
    plan = training.chunk_plan(lay.R, 2 * tile, 3 * tile)
    assert len(plan) > 3
    for c in plan:
        offs, cnts = training.chunk_layout(lay.offsets_d, lay.counts_d, c.row0, c.row1)
        a_c, tab = a[c.row0:c.row1], homes.table[c.row0:c.row1]
        for w_s, e0, e1 in segments:
            o = offs[e0:e1 + 1]
            if kind == "fc2":
                gg.fc2_push(a_c, w_s, o, tab, fused.bases, SLOTS_OFFSET, tile_rows=tile)
            else:
                gg.fc1_dgrad_push(a_c, w_s, o, tab, fused.bases, SLOTS_OFFSET,
                                  dw[c.row0:c.row1] if scalars else None, fused.scalars_offset, tile_rows=tile)
    _assert_same_homes(fused, ref, scalars, f"{kind} tile {tile}, chunks and segments (seed {seed})")


@pytest.mark.gpu
def test_fused_push_under_torch_compile_is_eager():
    """The ops trace (fullgraph) and give the eager bits."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    lay = Layout([5, 300, 0, 77], 128)
    h, w2 = _operands("fc2", lay)
    dgu, w1 = _operands("dgrad", lay)
    dw = torch.randn(lay.R, device="cuda")
    homes = Homes(lay, 2, gen)

    def both(h, w2, dgu, w1, offsets, table, bases, dw):
        gg.fc2_push(h, w2, offsets, table, bases, SLOTS_OFFSET)
        gg.fc1_dgrad_push(dgu, w1, offsets, table, bases, SLOTS_OFFSET, dw, homes.scalars_offset)

    eager, compiled = homes.fresh(), homes.fresh()
    both(h, w2, dgu, w1, lay.offsets_d, homes.table, eager.bases, dw)
    torch.compile(both, fullgraph=True, backend="aot_eager")(h, w2, dgu, w1, lay.offsets_d, homes.table,
                                                              compiled.bases, dw)
    _assert_same_homes(compiled, eager, True, f"compiled vs eager (seed {seed})")
