"""Weight gradients over a range of the layout's rows with an fp32 carry between ranges
(``mok_gemm_weight_grad``'s row0 / row1 / carry_in / carry_out, ``grouped_gemm.weight_grad_rows``).

CPU: the Python checks reject bad ranges and carries before anything reaches the library, the
C ABI rejects them before any CUDA call, the wrappers pass the range through, and the custom op
has a fake and traces under torch.compile. GPU: walking the layout range by range, over many
partitions at multiples of 64 rows, gives out bitwise equal to the whole-layout call, in every
epilogue (bf16 direct and TMA-staged, fp32, fp32 accumulated into a non-zero main_grad); every
call leaves the experts it does not own untouched, never reads a's and b's rows past row1, and
after the last range every element is written. With the experts' real-row counts, the 64-row
blocks of padding past an expert's last real row are never read (NaN there changes nothing) and
the result is bitwise the one that reads them.
"""

from __future__ import annotations

import ctypes
import os
import random

import pytest
import torch

from megatron_mok.ops import grouped_gemm as gg

MOK_ERR_INVALID_ARGUMENT = -1
M, N = 256, 512  # 2 x 2 output tiles per expert


# ---- CPU -------------------------------------------------------------------------------------

def _cpu_args(R=256, L=4, out_dtype=torch.bfloat16):
    a = torch.zeros(R, M, dtype=torch.bfloat16)
    b = torch.zeros(R, N, dtype=torch.bfloat16)
    offsets = torch.zeros(L + 1, dtype=torch.int32)
    out = torch.zeros(L, M, N, dtype=out_dtype)
    return a, b, offsets, out


def _carry():
    return torch.zeros(M, N)


def _no_library(monkeypatch):
    def fail():
        raise AssertionError("the library was reached: the arguments should have been rejected first")
    monkeypatch.setattr(gg, "_lib", fail)


@pytest.mark.parametrize("row0,row1,why", [
    (32, 288, "row0 = 32 must be a non-negative multiple of 64"),
    (-64, 192, "row0 = -64 must be a non-negative multiple of 64"),
    (0, 100, "row1 = 100 must be a multiple of 64 in \\(0, row0 \\+ R = 256\\]"),
    (0, 0, "row1 = 0 must be a multiple of 64"),
    (0, 320, "row1 = 320 must be a multiple of 64 in \\(0, row0 \\+ R = 256\\]"),
    (128, 64, "row1 = 64 must be a multiple of 64 in \\(128, row0 \\+ R = 384\\]"),
])
def test_bad_ranges_are_rejected_before_the_library(monkeypatch, row0, row1, why):
    _no_library(monkeypatch)
    a, b, offsets, out = _cpu_args()
    with pytest.raises(gg.GemmArgumentError, match=why):
        gg.weight_grad_rows(a, b, offsets, out, row0=row0, row1=row1, carry_in=_carry(), carry_out=None)


def test_bad_carries_and_outputs_are_rejected_before_the_library(monkeypatch):
    _no_library(monkeypatch)
    a, b, offsets, out = _cpu_args()

    def call(out=out, **kw):
        args = dict(row0=64, row1=192, carry_in=_carry(), carry_out=_carry())
        args.update(kw)
        gg.weight_grad_rows(a, b, offsets, out, **args)

    with pytest.raises(gg.GemmArgumentError, match="carry_in is needed when row0 = 64 > 0"):
        call(carry_in=None)
    with pytest.raises(gg.GemmArgumentError, match="carry_in must be torch.float32"):
        call(carry_in=_carry().bfloat16())
    with pytest.raises(gg.GemmArgumentError, match="carry_out must be fp32 \\[M=256, N=512\\]"):
        call(carry_out=torch.zeros(N, M))
    with pytest.raises(gg.GemmArgumentError, match="carry_in must have 2 dimensions"):
        call(carry_in=torch.zeros(1, M, N))
    with pytest.raises(gg.GemmArgumentError, match="carry_out must be contiguous"):
        call(carry_out=torch.zeros(N, M).t())
    same = _carry()
    with pytest.raises(gg.GemmArgumentError, match="carry_in and carry_out must not overlap"):
        call(carry_in=same, carry_out=same)
    buf = torch.zeros(M + 64, N)  # two [M, N] views sharing 192 rows
    with pytest.raises(gg.GemmArgumentError, match="carry_in and carry_out must not overlap"):
        call(carry_in=buf[:M], carry_out=buf[64:])
    with pytest.raises(gg.GemmArgumentError, match="carry_out must not overlap out"):
        fp32_out = torch.zeros(4, M, N)
        call(out=fp32_out, carry_out=fp32_out[1])
    with pytest.raises(gg.GemmArgumentError, match="needs an fp32 out"):
        call(accumulate=True)
    with pytest.raises(gg.GemmArgumentError, match="tma_store writes a bf16 out"):
        call(out=torch.zeros(4, M, N), tma_store=True)
    with pytest.raises(gg.GemmArgumentError, match="out must be the \\[L, M, N\\]"):
        call(out=None)
    with pytest.raises(gg.GemmArgumentError, match="weight-gradient output must be \\[L=4, M=256, N=512\\]"):
        call(out=torch.zeros(3, M, N))
    with pytest.raises(gg.GemmArgumentError, match="row0 must be an int"):
        call(row0=64.0)
    with pytest.raises(gg.GemmArgumentError, match="N \\(columns of b\\) = 320"):
        gg.weight_grad_rows(a, torch.zeros(256, 320, dtype=torch.bfloat16), offsets, out, row0=0, row1=256,
                            carry_in=None, carry_out=None)


def test_valid_ranges_pass_the_checks():
    a, b, offsets, out = _cpu_args(R=200)
    buf = torch.zeros(2, M, N)  # the ping-pong pair: two disjoint views of one buffer are fine
    gg.check_weight_grad_rows(a, b, offsets, out, 0, 128, None, buf[0])
    gg.check_weight_grad_rows(a, b, offsets, out, 0, 200, None, None)  # unaligned: exactly row0 + R
    gg.check_weight_grad_rows(a, b, offsets, out, 1024, 1152, buf[0], buf[1])
    gg.check_weight_grad_rows(a, b, offsets, out, 1024, 1224, buf[1], None)
    gg.check_weight_grad_rows(a, b, offsets, torch.zeros(4, M, N), 64, 192, buf[0], buf[1], accumulate=True)
    e_a, e_b, _, _ = _cpu_args(R=0)  # an empty last range: nothing but empty experts at row0
    gg.check_weight_grad_rows(e_a, e_b, offsets, out, 4096, 4096, buf[0], None)


def test_c_abi_rejects_bad_ranges_before_any_launch(lib):
    """These return before any CUDA call, so they run without a GPU."""
    i, i64, v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    wgrad = lib.function("mok_gemm_weight_grad", i, [v, v, v, v, v, v, i, i, i, i64, i, i, i, i64, i64, v, v, i, v])
    p = ctypes.c_void_p(0x10000)  # never dereferenced: the checks fail first
    c1, c2 = ctypes.c_void_p(0x100000), ctypes.c_void_p(0x900000)  # [M, N] fp32 = 512 KiB apart

    def call(rows_cap, row0, row1, cin, cout):
        return wgrad(p, p, p, p, p, None, 1, 0, 0, rows_cap, 4, M, N, row0, row1, cin, cout, 0, None)

    bad = {
        "row0 not a multiple of 64": call(256, 32, 288, c1, None),
        "negative row0": call(256, -64, 192, c1, None),
        "row1 unaligned and not row0 + rows_cap": call(256, 0, 100, None, None),
        "row1 past row0 + rows_cap": call(256, 0, 320, None, None),
        "row1 below row0": call(256, 128, 64, c1, None),
        "an empty range with rows": call(256, 128, 128, c1, None),
        "no carry_in with row0 > 0": call(256, 64, 320, None, c2),
        "carry_in is carry_out": call(256, 64, 320, c1, c1),
        "overlapping carries": call(256, 64, 320, c1, ctypes.c_void_p(0x100000 + 4096)),
        "misaligned carry_out": call(256, 0, 256, None, ctypes.c_void_p(0x900008)),
        "rows past 2^31": call(256, 2 ** 31 - 128, 2 ** 31 + 128, c1, None),
        "an out table without accumulate": wgrad(p, p, p, p, None, p, 0, 0, 0, 256, 4, M, N, 0, 256, None, None, 0,
                                                 None),
        "an out table with tma_store": wgrad(p, p, p, p, None, p, 0, 1, 1, 256, 4, M, N, 0, 256, None, None, 0, None),
        "neither out nor a table": wgrad(p, p, p, p, None, None, 0, 1, 0, 256, 4, M, N, 0, 256, None, None, 0, None),
    }
    assert all(code == MOK_ERR_INVALID_ARGUMENT for code in bad.values()), bad


def _recorder(monkeypatch):
    """Replaces the C side: returns the list of the argument tuples of mok_gemm_weight_grad's
    calls (pointers as ints, NULL as None)."""
    calls = []

    class Recorder:
        def check(self, code, what):
            assert code == 0, what

    def fake_lib():
        def wgrad(*args):
            calls.append(tuple(x.value if isinstance(x, ctypes.c_void_p) else x for x in args))
            return 0
        return Recorder(), {"wgrad": wgrad}

    monkeypatch.setattr(gg, "_lib", fake_lib)
    monkeypatch.setattr(gg, "stream_of", lambda t: ctypes.c_void_p(0))
    return calls


def test_wrappers_pass_the_range_through(monkeypatch):
    """weight_grad runs the whole layout (row0 0, row1 R, no carries); weight_grad_rows hands
    over its range, carries and epilogue. Arguments: a, b, offsets, counts, out, out_table, then
    (6 on) out_bf16, accumulate, tma_store, rows_cap, L, M, N, row0, row1, carry_in, carry_out,
    num_ctas."""
    calls = _recorder(monkeypatch)
    a, b, offsets, out = _cpu_args(R=200)
    gg.weight_grad(a, b, offsets, out_dtype=torch.bfloat16)
    assert calls[-1][6:18] == (1, 0, int(gg.WGRAD_TMA_STORE), 200, 4, M, N, 0, 200, None, None, 0)
    main = torch.zeros(4, M, N)
    gg.weight_grad(a, b, offsets, main_grad=main, num_ctas=5)
    assert calls[-1][6:18] == (0, 1, 0, 200, 4, M, N, 0, 200, None, None, 5)
    cin, cout = _carry(), _carry()
    gg.weight_grad_rows(a, b, offsets, out, row0=1024, row1=1152, carry_in=cin, carry_out=cout, tma_store=False,
                        num_ctas=7)
    assert calls[-1][6:18] == (1, 0, 0, 200, 4, M, N, 1024, 1152, cin.data_ptr(), cout.data_ptr(), 7)
    gg.weight_grad_rows(a, b, offsets, main, row0=1024, row1=1224, carry_in=cin, carry_out=None, accumulate=True)
    assert calls[-1][6:18] == (0, 1, 0, 200, 4, M, N, 1024, 1224, cin.data_ptr(), None, 0)
    gg.weight_grad_rows(a, b, offsets, out, row0=0, row1=128, carry_in=None, carry_out=cout)
    assert calls[-1][6:18] == (1, 0, int(gg.WGRAD_TMA_STORE), 200, 4, M, N, 0, 128, None, cout.data_ptr(), 0)
    assert all(args[:4] == (a.data_ptr(), b.data_ptr(), offsets.data_ptr(), None) for args in calls)
    counts = torch.zeros(4, dtype=torch.int32)
    gg.weight_grad_rows(a, b, offsets, out, row0=0, row1=128, carry_in=None, carry_out=cout, counts=counts)
    assert calls[-1][3] == counts.data_ptr()
    gg.weight_grad(a, b, offsets, counts, out_dtype=torch.bfloat16)
    assert calls[-1][3] == counts.data_ptr()
    gg.weight_grad(a, b, offsets, counts, main_grad=main)
    assert calls[-1][3] == counts.data_ptr()


def test_bad_counts_are_rejected_before_the_library(monkeypatch):
    _no_library(monkeypatch)
    a, b, offsets, out = _cpu_args()
    for counts, why in ((torch.zeros(3, dtype=torch.int32), "counts must have L = 4 entries"),
                        (torch.zeros(4, dtype=torch.int64), "counts")):
        with pytest.raises(ValueError, match=why):
            gg.weight_grad_rows(a, b, offsets, out, row0=0, row1=256, carry_in=None, carry_out=None, counts=counts)
        with pytest.raises(ValueError, match=why):
            gg.weight_grad(a, b, offsets, counts)


def test_op_is_registered_with_its_mutations_and_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = torch.ops.mok.gemm_weight_grad_rows.default._schema
    written = {arg.name for arg in schema.arguments if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == {"out", "carry_out"}
    with FakeTensorMode():
        a, b, offsets, out = _cpu_args()
        assert torch.ops.mok.gemm_weight_grad_rows(a, b, offsets, out, 64, 192, _carry(), None, False, True, 0) is None
        assert torch.ops.mok.gemm_weight_grad_rows(a, b, offsets, out, 0, 256, None, _carry(), False, False, 0) is None


def test_the_wrapper_traces_under_compile(monkeypatch):
    """Checks on fake tensors at trace time, the mutating op through functionalization: the
    compiled function makes the same C calls as eager (recorded, no GPU)."""
    calls = _recorder(monkeypatch)
    a, b, offsets, out = _cpu_args(R=256)
    c0, c1 = _carry(), _carry()

    def two_ranges(a, b, offsets, out, c0, c1):
        gg.weight_grad_rows(a[:128], b[:128], offsets, out, row0=0, row1=128, carry_in=None, carry_out=c0)
        gg.weight_grad_rows(a[128:], b[128:], offsets, out, row0=128, row1=256, carry_in=c0, carry_out=c1)
        return out

    torch._dynamo.reset()
    compiled = torch.compile(two_ranges, fullgraph=True, backend="aot_eager")
    compiled(a, b, offsets, out, c0, c1)
    ranges = [(args[13], args[14]) for args in calls]
    assert ranges == [(0, 128), (128, 256)], ranges


# ---- GPU -------------------------------------------------------------------------------------

# Empty experts first, in the middle and last; one row; counts that are not tile multiples; a
# hot expert spanning many ranges.
COUNTS = [0, 1, 130, 700, 63, 0, 2500, 64, 0]
EXTRA = 37  # rows of a and b past the layout's end: the last range ends unaligned
MODES = ["bf16", "bf16-tma", "fp32", "accumulate"]


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


class _Layout:
    """Segments padded to `tile`, R = R_pad + EXTRA rows; a, b bf16 random on the real rows and
    zero on the padding rows (and on the rows past the layout)."""

    def __init__(self, tile):
        self.offsets = [0]
        for c in COUNTS:
            self.offsets.append(self.offsets[-1] + -(-c // tile) * tile)
        self.L = len(COUNTS)
        self.R_pad = self.offsets[-1]
        self.R = self.R_pad + EXTRA
        self.offsets_d = torch.tensor(self.offsets, dtype=torch.int32, device="cuda")
        real = torch.zeros(self.R, dtype=torch.bool, device="cuda")
        for l, c in enumerate(COUNTS):
            real[self.offsets[l]:self.offsets[l] + c] = True
        self.a = torch.randn(self.R, M, device="cuda").bfloat16() * real[:, None]
        self.b = torch.randn(self.R, N, device="cuda").bfloat16() * real[:, None]
        self.counts_d = torch.tensor(COUNTS, dtype=torch.int32, device="cuda")
        # The same with NaN in each segment's 64-row blocks past its last real row (the blocks a
        # K loop given the counts skips); rows of zeros stay in the block of the last real row.
        skipped = torch.zeros(self.R, dtype=torch.bool, device="cuda")
        for l, c in enumerate(COUNTS):
            skipped[self.offsets[l] + -(-c // 64) * 64:self.offsets[l + 1]] = True
        self.skipped_rows = int(skipped.sum())
        self.a_nan = self.a.masked_fill(skipped[:, None], float("nan"))
        self.b_nan = self.b.masked_fill(skipped[:, None], float("nan"))

    def partitions(self, rng):
        """name -> the range bounds [0, ..., R]: inner bounds multiples of 64 below R_pad (every
        range then holds a row block), the last range [x, R) unaligned."""
        def steps(s):
            return list(range(0, self.R_pad, s)) + [self.R]
        inner = rng.sample(range(64, self.R_pad, 64), 12)
        return {
            "one range": [0, self.R],
            "64": steps(64),
            "128": steps(128),
            "192": steps(192),
            "1024": steps(1024),
            "random": [0] + sorted(inner) + [self.R],
            "layout end, then the tail": [0, 1024, self.R_pad, self.R],
        }

    def owns(self, row0, row1, carrying_out, accumulate):
        """Experts whose out a call over [row0, row1) writes."""
        row1 = row0 + (row1 - row0) // 64 * 64
        owned = set()
        for l in range(self.L):
            g0, g1 = self.offsets[l], self.offsets[l + 1]
            if g0 == g1:
                if row0 <= g0 <= row1 and not accumulate:
                    owned.add(l)
            elif g0 < row1 and g1 > row0 and not (carrying_out and g1 > row1):
                owned.add(l)
        return owned


def _tma(mode):
    return (mode == "bf16-tma") if mode.startswith("bf16") else None


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _same_bits(x, y):
    return torch.equal(_bits(x), _bits(y))


def _chunk(x, row0, row1, last):
    """The rows a range's caller holds: exactly the rest for the last range, else a buffer with
    64 NaN rows past row1 (never to be read)."""
    if last:
        return x[row0:].clone()
    buf = torch.full((row1 - row0 + 64, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    buf[:row1 - row0] = x[row0:row1]
    return buf


def _out(lay, mode, base):
    if mode == "accumulate":
        return base.clone()
    return torch.full((lay.L, M, N), float("nan"), dtype=torch.float32 if mode == "fp32" else torch.bfloat16,
                      device="cuda")


def _run_ranges(lay, bounds, mode, base, num_ctas, seed, name, a=None, b=None, counts=None):
    a = lay.a if a is None else a
    b = lay.b if b is None else b
    out = _out(lay, mode, base)
    carries = [torch.full((M, N), float("nan"), device="cuda") for _ in range(2)]
    accumulate = mode == "accumulate"
    for k, (row0, row1) in enumerate(zip(bounds[:-1], bounds[1:])):
        last = k == len(bounds) - 2
        carry_in = None if row0 == 0 else carries[k % 2]
        carry_out = None if last else carries[(k + 1) % 2]
        if carry_out is not None:
            carry_out.fill_(float("nan"))  # a carry is read only where this call wrote it
        before = out.clone()
        gg.weight_grad_rows(_chunk(a, row0, row1, last), _chunk(b, row0, row1, last), lay.offsets_d, out,
                            row0=row0, row1=row1, carry_in=carry_in, carry_out=carry_out, counts=counts,
                            accumulate=accumulate, tma_store=_tma(mode), num_ctas=num_ctas)
        owned = lay.owns(row0, row1, carry_out is not None, accumulate)
        for l in range(lay.L):
            if l not in owned:
                assert _same_bits(out[l], before[l]), \
                    f"{name}: range [{row0}, {row1}) wrote expert {l}, not its own (seed {seed})"
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("mode", MODES)
def test_ranges_with_carries_are_bitwise_the_whole_layout(tile, mode):
    seed = _seed()
    rng = random.Random(seed)
    lay = _Layout(tile)
    base = torch.randn(lay.L, M, N, device="cuda") if mode == "accumulate" else None
    # the whole layout in one call, through the plain wrapper
    if mode == "accumulate":
        whole = base.clone()
        gg.weight_grad(lay.a, lay.b, lay.offsets_d, main_grad=whole)
    else:
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        whole = gg.weight_grad(lay.a, lay.b, lay.offsets_d, out_dtype=dtype, tma_store=_tma(mode))
    torch.cuda.synchronize()
    assert not torch.isnan(whole).any(), f"unwritten weight-gradient elements (seed {seed})"
    ref = torch.zeros(lay.L, M, N, dtype=torch.float64, device="cuda")
    for l in range(lay.L):
        s, e = lay.offsets[l], lay.offsets[l + 1]
        ref[l] = lay.a[s:e].double().t() @ lay.b[s:e].double()
    expect = ref + base.double() if mode == "accumulate" else ref
    err = ((whole.double() - expect).norm() / expect.norm()).item()
    assert err < 1e-2, f"whole layout {mode}: relative error {err:.3e} (seed {seed})"
    for l, c in enumerate(COUNTS):
        if c == 0:
            want = base[l] if mode == "accumulate" else torch.zeros_like(whole[l])
            assert _same_bits(whole[l], want.to(whole.dtype)), f"empty expert {l} (seed {seed})"

    for num_ctas in (0, 3):  # 3 CTAs: carry-out and staged tiles mixed within a CTA
        for name, bounds in lay.partitions(rng).items():
            label = f"{mode}, tile {tile}, ctas {num_ctas}, ranges {name}"
            out = _run_ranges(lay, bounds, mode, base, num_ctas, seed, label)
            assert not torch.isnan(out).any(), f"{label}: unwritten elements after the last range (seed {seed})"
            if not _same_bits(out, whole):
                bad = [l for l in range(lay.L) if not _same_bits(out[l], whole[l])]
                raise AssertionError(f"{label}: differs from the whole-layout call on experts {bad} "
                                     f"(bounds {bounds}, seed {seed})")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_padding_blocks_past_the_last_real_row_are_skipped(mode):
    """With the counts, NaN in the 64-row blocks past each expert's last real row (128-row
    segments: experts of 1, 63, 64, 130 and 700 rows have one) changes nothing: the whole-layout
    call and every partition into ranges are bitwise the call that reads zeros there. Without
    the counts the same NaN reaches the output, so the blocks really are skipped."""
    seed = _seed()
    rng = random.Random(seed)
    lay = _Layout(128)
    assert lay.skipped_rows >= 5 * 64, lay.skipped_rows
    base = torch.randn(lay.L, M, N, device="cuda") if mode == "accumulate" else None
    dtype = torch.float32 if mode in ("fp32", "accumulate") else torch.bfloat16

    def whole(a, b, counts):
        if mode == "accumulate":
            out = base.clone()
            gg.weight_grad(a, b, lay.offsets_d, counts, main_grad=out)
            return out
        return gg.weight_grad(a, b, lay.offsets_d, counts, out_dtype=dtype, tma_store=_tma(mode))

    want = whole(lay.a, lay.b, None)
    got = whole(lay.a_nan, lay.b_nan, lay.counts_d)
    torch.cuda.synchronize()
    assert not torch.isnan(want).any() and not torch.isnan(got).any(), f"{mode}: NaN in the output (seed {seed})"
    assert _same_bits(got, want), f"{mode}: skipping padding blocks changed bits (seed {seed})"
    assert torch.isnan(whole(lay.a_nan, lay.b_nan, None)).any(), "without counts the padding blocks are read"
    for num_ctas in (0, 3):
        for name, bounds in lay.partitions(rng).items():
            label = f"{mode}, ctas {num_ctas}, ranges {name}, counts"
            out = _run_ranges(lay, bounds, mode, base, num_ctas, seed, label, lay.a_nan, lay.b_nan, lay.counts_d)
            assert _same_bits(out, want), f"{label}: differs from the whole layout read in full (seed {seed})"


# ---- per-expert outputs (gradient-accumulation fusion into main_grad) --------------------------

def test_per_expert_outputs_are_checked_before_the_library(monkeypatch):
    _no_library(monkeypatch)
    a, b, offsets, _ = _cpu_args()
    good = [torch.zeros(M, N) for _ in range(4)]
    buf = torch.zeros(5 * M * N)
    bad = {
        "a list or tuple of tensors": good[0],
        "3 per-expert outputs for L = 4": good[:3],
        "must be fp32": good[:3] + [torch.zeros(M, N, dtype=torch.bfloat16)],
        "must be fp32 \\[256, 512\\]": good[:3] + [torch.zeros(N, M)],
        "contiguous": good[:3] + [torch.zeros(N, M).t()],
        "16-byte aligned": good[:3] + [buf[1:1 + M * N].view(M, N)],
        "overlap": good[:2] + [buf[:M * N].view(M, N), buf[M * N // 2:M * N // 2 + M * N].view(M, N)],
    }
    for why, outs in bad.items():
        with pytest.raises(ValueError, match=why):
            gg.weight_grad_into(a, b, offsets, outs)
    with pytest.raises(ValueError, match="carry_out must not overlap out"):
        gg.weight_grad_into(a, b, offsets, good, row0=0, row1=128, carry_out=good[2])


def test_per_expert_outputs_reach_the_c_abi_as_a_table(monkeypatch):
    """out is NULL, the table holds the outputs' addresses in expert order, accumulate is on and
    tma_store off; the same outputs reuse one cached table."""
    calls = _recorder(monkeypatch)
    a, b, offsets, _ = _cpu_args(R=200)
    outs = [torch.zeros(M, N) for _ in range(4)][::-1]
    tables = []
    monkeypatch.setattr(gg, "expert_table", lambda o: tables.append([t.data_ptr() for t in o]) or torch.zeros(4))
    gg.weight_grad_into(a, b, offsets, outs, counts=torch.zeros(4, dtype=torch.int32), num_ctas=3)
    args = calls[-1]
    assert args[4] is None and args[5] is not None and args[6:9] == (0, 1, 0), args
    assert args[9:17] == (200, 4, M, N, 0, 200, None, None) and args[-2] == 3
    assert tables == [[t.data_ptr() for t in outs]]


def test_expert_table_is_cached_by_address():
    outs = [torch.zeros(4) for _ in range(3)]
    t1 = gg.expert_table(outs)
    assert t1.dtype == torch.int64 and t1.tolist() == [t.data_ptr() for t in outs]
    assert gg.expert_table(list(outs)) is t1
    assert gg.expert_table(outs[::-1]) is not t1


@pytest.mark.gpu
def test_per_expert_outputs_accumulate_bitwise_as_the_stacked_main_grad():
    """Per-expert fp32 outputs scattered through one buffer in shuffled order (as a gradient
    buffer may hold them), non-zero before: accumulating into them over the whole layout and
    over every partition into ranges, with the counts, gives bitwise what accumulating into the
    stacked [L, M, N] main_grad gives; empty experts keep their values; nothing outside the
    outputs is written."""
    seed = _seed()
    rng = random.Random(seed)
    lay = _Layout(128)
    base = torch.randn(lay.L, M, N, device="cuda")
    want = base.clone()
    gg.weight_grad(lay.a, lay.b, lay.offsets_d, lay.counts_d, main_grad=want)
    order = list(range(lay.L))
    rng.shuffle(order)
    gap = 64  # floats between outputs, poisoned
    for name, bounds in {"one range": [0, lay.R], **lay.partitions(rng)}.items():
        buf = torch.full((lay.L * (M * N + gap),), float("nan"), device="cuda")
        outs = [None] * lay.L
        for slot, e in enumerate(order):
            outs[e] = buf[slot * (M * N + gap):slot * (M * N + gap) + M * N].view(M, N)
            outs[e].copy_(base[e])
        carries = [torch.full((M, N), float("nan"), device="cuda") for _ in range(2)]
        for k, (row0, row1) in enumerate(zip(bounds[:-1], bounds[1:])):
            last = k == len(bounds) - 2
            gg.weight_grad_into(_chunk(lay.a_nan, row0, row1, last), _chunk(lay.b_nan, row0, row1, last),
                                lay.offsets_d, outs, counts=lay.counts_d, row0=row0, row1=row1,
                                carry_in=None if row0 == 0 else carries[k % 2],
                                carry_out=None if last else carries[(k + 1) % 2])
        torch.cuda.synchronize()
        got = torch.stack(outs)
        assert _same_bits(got, want), f"ranges {name}: differs from the stacked main_grad (seed {seed})"
        gaps = torch.cat([buf[slot * (M * N + gap) + M * N:(slot + 1) * (M * N + gap)] for slot in range(lay.L)])
        assert torch.isnan(gaps).all(), f"ranges {name}: wrote outside the outputs (seed {seed})"
    for l, c in enumerate(COUNTS):
        if c == 0:
            assert _same_bits(want[l], base[l]), f"empty expert {l} changed (seed {seed})"


@pytest.mark.gpu
def test_accumulating_is_one_fp32_add_per_element_subnormals_kept():
    """main_grad += weight gradient is, element by element, one IEEE fp32 add rounded to nearest
    of the fp32 gradient the plain fp32 epilogue stores: bitwise ``base + fp32 gradient`` (torch's
    add), over the whole layout and over ranges with carries. Rows of main_grad whose gradient is
    exactly zero (a's column zero) hold subnormal values, which must come back unchanged (no
    flush to zero); empty experts stay as they were."""
    seed = _seed()
    rng = random.Random(seed)
    lay = _Layout(128)
    zero_cols = [5, 130]  # gradient rows m of every expert that are exactly 0
    a = lay.a.clone()
    a[:, zero_cols] = 0
    grad = gg.weight_grad(a, lay.b, lay.offsets_d, lay.counts_d, out_dtype=torch.float32)
    base = torch.randn(lay.L, M, N, device="cuda")
    tiny = torch.finfo(torch.float32).tiny
    sub = (torch.rand(lay.L, len(zero_cols), N, device="cuda") - 0.5) * tiny  # |x| < tiny / 2: subnormal
    base[:, zero_cols] = sub
    assert (base[:, zero_cols] != 0).any() and (base[:, zero_cols].abs() < tiny).all()
    want = base + grad
    for l, c in enumerate(COUNTS):
        if c == 0:
            want[l] = base[l]
    torch.cuda.synchronize()
    for name, bounds in {"one range": [0, lay.R], **lay.partitions(rng)}.items():
        got = base.clone()
        carries = [torch.full((M, N), float("nan"), device="cuda") for _ in range(2)]
        for k, (row0, row1) in enumerate(zip(bounds[:-1], bounds[1:])):
            last = k == len(bounds) - 2
            gg.weight_grad_rows(_chunk(a, row0, row1, last), _chunk(lay.b, row0, row1, last), lay.offsets_d, got,
                                row0=row0, row1=row1, carry_in=None if row0 == 0 else carries[k % 2],
                                carry_out=None if last else carries[(k + 1) % 2], counts=lay.counts_d,
                                accumulate=True)
        torch.cuda.synchronize()
        assert _same_bits(got[:, zero_cols], base[:, zero_cols]), \
            f"ranges {name}: subnormal main_grad values under a zero gradient changed (seed {seed})"
        assert _same_bits(got, want), f"ranges {name}: not base + the fp32 gradient, bitwise (seed {seed})"
