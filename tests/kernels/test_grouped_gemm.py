"""The Hopper grouped GEMMs (csrc/src/grouped_gemm_*.cu, megatron_mok/ops/grouped_gemm.py).

CPU: the library compiles with the kernels' C entry points, the C ABI rejects bad arguments
before touching the GPU, the Python checks name the bad value, and the fake implementations
give the right shapes. GPU: every kernel against a float64 reference on fresh random inputs,
outputs poisoned with NaN first and checked written on every row of the layout and untouched
beyond it, on layouts with empty experts, one expert with thousands of rows and counts that
are not multiples of the tile.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from megatron_mok import _build
from megatron_mok.ops import grouped_gemm as gg
from megatron_mok.ops import library

MOK_ERR_INVALID_ARGUMENT = -1
MOK_ERR_UNSUPPORTED = -2


# ---- CPU -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built_library(tmp_path_factory):
    if _build.find_nvcc() is None:
        pytest.skip("nvcc not found: the CUDA library cannot be compiled on this machine")
    return _build.build_library(tmp_path_factory.mktemp("moklib-gemm"))


def _c(lib, name, restype, nargs):
    return lib.function(name, restype, [ctypes.c_void_p] * nargs)


def test_library_exports_the_gemm_entry_points(built_library):
    lib = library.MokLibrary(built_library)
    for name in ("mok_gemm_fc1_swiglu", "mok_gemm_fc2", "mok_gemm_fc2_dgrad_swiglu", "mok_gemm_fc2_dgrad",
                 "mok_gemm_fc1_dgrad", "mok_gemm_weight_grad", "mok_gemm_fc2_dgrad_scratch_floats"):
        assert hasattr(lib._dll, name), name
    fn = lib.function("mok_gemm_fc2_dgrad_scratch_floats", ctypes.c_int64, [ctypes.c_int64, ctypes.c_int])
    assert fn(1000, 2048) == 1000 * 8


def test_c_abi_rejects_bad_arguments_before_any_launch(built_library):
    """These return before any CUDA call, so they run without a GPU."""
    lib = library.MokLibrary(built_library)
    i, i64, v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fc1 = lib.function("mok_gemm_fc1_swiglu", i, [v, v, v, v, v, v, v, i64, i, i, i, i, i, i, i, i, v])
    p = ctypes.c_void_p(0x10000)  # never dereferenced: the checks fail first
    # null pointer
    assert fc1(None, p, p, p, None, p, None, 256, 4, 1024, 512, 128, 256, 0, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    # H not a multiple of 64
    assert fc1(p, p, p, p, None, p, None, 256, 4, 1000, 512, 128, 256, 0, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    # I not a multiple of the tile's h columns (128 for block_m 128)
    assert fc1(p, p, p, p, None, p, None, 256, 4, 1024, 200, 128, 256, 1, 1, 0, None) == MOK_ERR_INVALID_ARGUMENT
    # block_m 96, block_m 128 with wg_n 128, or multicast with block_m 64 are not built
    assert fc1(p, p, p, p, None, p, None, 256, 4, 1024, 512, 96, 256, 0, 0, 0, None) == MOK_ERR_UNSUPPORTED
    assert fc1(p, p, p, p, None, p, None, 256, 4, 1024, 512, 128, 128, 0, 0, 0, None) == MOK_ERR_UNSUPPORTED
    assert fc1(p, p, p, p, None, p, None, 256, 4, 1024, 512, 64, 256, 0, 1, 0, None) == MOK_ERR_UNSUPPORTED
    # too many experts
    assert fc1(p, p, p, p, None, p, None, 256, 5000, 1024, 512, 128, 256, 0, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    wgrad = lib.function("mok_gemm_weight_grad", i, [v, v, v, v, v, v, i, i, i, i64, i, i, i, i64, i64, v, v, i, v])
    assert wgrad(p, p, p, p, p, None, 0, 0, 0, 256, 4, 100, 256, 0, 256, None, None, 0, None) == \
        MOK_ERR_INVALID_ARGUMENT  # M % 128
    assert wgrad(p, p, p, p, p, None, 1, 1, 0, 256, 4, 128, 256, 0, 256, None, None, 0, None) == \
        MOK_ERR_INVALID_ARGUMENT  # bf16 + accumulate
    assert wgrad(p, p, p, p, p, None, 0, 0, 1, 256, 4, 128, 256, 0, 256, None, None, 0, None) == \
        MOK_ERR_INVALID_ARGUMENT  # staged fp32
    dgrad = lib.function("mok_gemm_fc2_dgrad_swiglu", i, [v] * 10 + [i64, i, i, i, i, i, i, v])
    # a router weight without the buffers for its gradient
    assert dgrad(p, p, p, p, p, p, p, None, None, None, 256, 4, 1024, 512, 128, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    plain = lib.function("mok_gemm_fc2_dgrad", i, [v, v, v, v, i64, i, i, i, i, i, i, i, i, v])
    assert plain(p, p, p, p, 256, 4, 1024, 384, 128, 256, 1, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT  # I % 256


def test_python_signatures_match_the_c_abi(built_library, monkeypatch):
    """Every ctypes signature of the op module has the arity of its declaration in
    grouped_gemm.h, and each entry point called through it refuses L = 0 before any CUDA call."""
    import re

    header = (_build.CSRC_DIR / "include" / "mok" / "grouped_gemm.h").read_text()
    arity = {name: len([a for a in args.split(",") if a.strip()])
             for name, args in re.findall(r"MOK_API \w+ (mok_gemm_\w+)\(([^)]*)\);", header)}
    monkeypatch.setattr(library, "_library", library.MokLibrary(built_library))
    lib, fns = gg._lib()
    names = {"fc1": "mok_gemm_fc1_swiglu", "fc2": "mok_gemm_fc2", "scratch": "mok_gemm_fc2_dgrad_scratch_floats",
             "fc2_dgrad_swiglu": "mok_gemm_fc2_dgrad_swiglu", "fc2_dgrad": "mok_gemm_fc2_dgrad",
             "fc1_dgrad": "mok_gemm_fc1_dgrad", "wgrad": "mok_gemm_weight_grad", "fc2_push": "mok_gemm_fc2_push",
             "fc1_dgrad_push": "mok_gemm_fc1_dgrad_push"}
    assert set(names.values()) == set(arity), sorted(arity)
    for key, name in names.items():
        assert len(fns[key].argtypes) == arity[name], name
    p = ctypes.c_void_p(0x10000)
    assert fns["fc1"](p, p, p, p, None, p, None, 256, 0, 1024, 512, 128, 256, 0, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    assert fns["fc2"](p, p, p, p, 256, 0, 1024, 512, 128, 256, 0, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    assert fns["fc2_dgrad_swiglu"](p, p, p, p, p, None, p, None, None, None, 256, 0, 1024, 512, 128, 0, 0,
                                   None) == MOK_ERR_INVALID_ARGUMENT
    for key in ("fc2_dgrad", "fc1_dgrad"):
        assert fns[key](p, p, p, p, 256, 0, 1024, 512, 128, 256, 1, 0, 0, None) == MOK_ERR_INVALID_ARGUMENT
    assert fns["wgrad"](p, p, p, p, p, None, 0, 0, 0, 256, 0, 128, 256, 0, 256, None, None, 0, None) == \
        MOK_ERR_INVALID_ARGUMENT
    assert fns["scratch"](100, 512) == 200
    assert fns["fc2_push"](p, p, p, p, p, 0, 256, 0, 1024, 512, 128, 256, 0, None) == MOK_ERR_INVALID_ARGUMENT
    assert fns["fc1_dgrad_push"](p, p, p, p, p, 0, None, 0, 256, 0, 1024, 512, 128, 256, 0, None) == \
        MOK_ERR_INVALID_ARGUMENT


def _cpu_args(R=256, L=4, H=1024, I=512):
    x = torch.zeros(R, H, dtype=torch.bfloat16)
    w1 = torch.zeros(L, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.zeros(L, H, I, dtype=torch.bfloat16)
    offsets = torch.zeros(L + 1, dtype=torch.int32)
    counts = torch.zeros(L, dtype=torch.int32)
    return x, w1, w2, offsets, counts


def test_python_checks_name_the_bad_value():
    x, w1, w2, offsets, counts = _cpu_args()
    with pytest.raises(gg.GemmArgumentError, match="x must be torch.bfloat16"):
        gg.check_fc1_swiglu(x.float(), w1, offsets, counts, None, 128)
    with pytest.raises(gg.GemmArgumentError, match="fc1_weight must be"):
        gg.check_fc1_swiglu(x, w1[:, :, :512], offsets, counts, None, 128)
    with pytest.raises(gg.GemmArgumentError, match="offsets must have L \\+ 1 = 5"):
        gg.check_fc1_swiglu(x, w1, offsets[:4], counts, None, 128)
    with pytest.raises(gg.GemmArgumentError, match="tile_rows = 32"):
        gg.check_fc1_swiglu(x, w1, offsets, counts, None, 32)
    with pytest.raises(gg.GemmArgumentError, match="block_m = 128 must be 64 or 128 and divide tile_rows = 64"):
        gg.check_fc1_swiglu(x, w1, offsets, counts, None, 64, block_m=128)
    with pytest.raises(gg.GemmArgumentError, match="is not built"):
        gg.check_fc1_swiglu(x, w1, offsets, counts, None, 128, block_m=128, wg_n=128)
    with pytest.raises(gg.GemmArgumentError, match="is not built"):
        gg.check_fc2(torch.zeros(256, 512, dtype=torch.bfloat16), w2, offsets, 64, multicast=True)
    with pytest.raises(gg.GemmArgumentError, match="router_weight must have one entry per row"):
        gg.check_fc1_swiglu(x, w1, offsets, counts, torch.ones(7), 128)
    with pytest.raises(gg.GemmArgumentError, match="I = 192 must be a multiple of 128"):
        gg.check_fc1_swiglu(x, torch.zeros(4, 384, 1024, dtype=torch.bfloat16), offsets, counts, None, 128)
    with pytest.raises(gg.GemmArgumentError, match="contiguous"):
        gg.check_fc2(torch.zeros(512, 256, dtype=torch.bfloat16).t(), w2, offsets, 128)
    with pytest.raises(gg.GemmArgumentError, match="H = 768 must be a multiple of 512"):
        gg.check_fc2(torch.zeros(256, 512, dtype=torch.bfloat16), torch.zeros(4, 768, 512, dtype=torch.bfloat16),
                     offsets, 64, wg_n=256, tma_store=False)
    with pytest.raises(gg.GemmArgumentError, match="gu must be"):
        gg.check_fc2_dgrad_swiglu(x, w2, torch.zeros(256, 512, dtype=torch.bfloat16), offsets, counts, None, 128)
    with pytest.raises(gg.GemmArgumentError, match="I = 128 must be a multiple of 256"):
        gg.check_fc2_dgrad_swiglu(x, w2[:, :, :128].contiguous(), torch.zeros(256, 256, dtype=torch.bfloat16),
                                  offsets, counts, None, 64)
    assert gg.check_fc2_dgrad_swiglu(x, w2, torch.zeros(256, 1024, dtype=torch.bfloat16), offsets, counts, None,
                                     128, block_m=64) == gg.Variant(64, 128, True, False)
    with pytest.raises(gg.GemmArgumentError, match="N \\(columns of b\\) = 320"):
        gg.check_weight_grad(x, torch.zeros(256, 320, dtype=torch.bfloat16), offsets)
    with pytest.raises(gg.GemmArgumentError, match="main_grad must be fp32"):
        gg.weight_grad(x, x, offsets, main_grad=torch.zeros(4, 1024, 1024, dtype=torch.bfloat16))
    # valid arguments pass and pick the variant from the layout
    assert gg.check_fc1_swiglu(x, w1, offsets, counts, torch.ones(256), 128) == gg.DEFAULTS["fc1"][128]
    assert gg.check_fc1_swiglu(x, w1, offsets, counts, None, 64, wg_n=128, tma_store=True) == \
        gg.Variant(64, 128, True, False)
    assert gg.check_fc2(torch.zeros(256, 512, dtype=torch.bfloat16), w2, offsets, 128, block_m=64).block_m == 64
    assert gg.check_fc1_dgrad(torch.zeros(256, 1024, dtype=torch.bfloat16), w1, offsets, 64) == \
        gg.DEFAULTS["dgrad"][64]
    assert gg.check_fc2_dgrad(x, w2, offsets, 128, multicast=True).multicast
    # fc1_preact runs fc2's kernel on fc1's weight; its errors speak of fc1's operands
    with pytest.raises(gg.GemmArgumentError, match="fc1_weight must be \\[L, 2I, H=256\\]"):
        gg.fc1_preact(torch.zeros(256, 256, dtype=torch.bfloat16), w1, offsets)
    with pytest.raises(gg.GemmArgumentError, match="2I = 640 must be a multiple of 256"):
        gg.check_fc2(x, torch.zeros(4, 640, 1024, dtype=torch.bfloat16), offsets, 128,
                     names=("x", "fc1_weight", "H", "2I"))


def test_wrappers_pass_sizes_and_variant_through(monkeypatch):
    """The wrappers, ops and launchers hand the C functions the sizes and the chosen variant
    (the C side is replaced by a recorder, so this runs without a GPU)."""
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
        fns = {k: record(k) for k in ("fc1", "fc2", "fc2_dgrad_swiglu", "fc2_dgrad", "fc1_dgrad", "wgrad")}
        fns["scratch"] = lambda rows, inter: rows * (inter // 256)
        return Recorder(), fns

    monkeypatch.setattr(gg, "_lib", fake_lib)
    monkeypatch.setattr(gg, "stream_of", lambda t: ctypes.c_void_p(0))
    x, w1, w2, offsets, counts = _cpu_args(R=384, L=4, H=1024, I=512)
    rw = torch.ones(384)
    h, gu = gg.fc1_swiglu(x, w1, offsets, counts, rw, save_preact=True)
    assert h.shape == (384, 512) and gu.shape == (384, 1024)
    assert calls["fc1"][7:15] == (384, 4, 1024, 512) + tuple(int(f) for f in gg.DEFAULTS["fc1"][128])
    y = gg.fc2(h, w2, offsets, tile_rows=64)
    assert y.shape == (384, 1024) and calls["fc2"][4:12] == (384, 4, 1024, 512, 64, 128, 1, 0)
    dgu, dw, hh = gg.fc2_dgrad_swiglu(y, w2, gu, offsets, counts, rw, want_h=True, multicast=True)
    assert dgu.shape == (384, 1024) and dw.shape == (384,) and hh.shape == (384, 512)
    assert calls["fc2_dgrad_swiglu"][10:16] == (384, 4, 1024, 512, 128, 1)
    assert gg.fc2_dgrad(y, w2, offsets, block_m=64).shape == (384, 512)
    assert calls["fc2_dgrad"][4:12] == (384, 4, 1024, 512, 64, 256, 0, 0)
    assert gg.fc1_dgrad(dgu, w1, offsets).shape == (384, 1024)
    assert calls["fc1_dgrad"][4:8] == (384, 4, 1024, 512)
    assert gg.weight_grad(dgu, x, offsets).dtype == torch.float32
    assert calls["wgrad"][6:13] == (0, 0, 0, 384, 4, 1024, 1024)
    assert gg.weight_grad(y, h, offsets, counts, out_dtype=torch.bfloat16).shape == (4, 1024, 512)
    assert calls["wgrad"][6:9] == (1, 0, int(gg.WGRAD_TMA_STORE))
    main = torch.zeros(4, 1024, 512)
    assert gg.weight_grad(y, h, offsets, main_grad=main) is main and calls["wgrad"][6:9] == (0, 1, 0)


def test_fake_impls_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w1, w2, offsets, counts = _cpu_args(R=384, L=4, H=1024, I=512)
        rw = torch.ones(384)
        v = [128, 256, 1, 0]
        h, gu = torch.ops.mok.gemm_fc1_swiglu(x, w1, offsets, counts, rw, v, True, 0)
        assert h.shape == (384, 512) and gu.shape == (384, 1024) and h.dtype == torch.bfloat16
        h2, gu2 = torch.ops.mok.gemm_fc1_swiglu(x, w1, offsets, counts, None, v, False, 0)
        assert gu2.shape == (0, 1024)
        y = torch.ops.mok.gemm_fc2(h, w2, offsets, v, 0)
        assert y.shape == (384, 1024)
        dgu, dw, hh = torch.ops.mok.gemm_fc2_dgrad_swiglu(y, w2, gu, offsets, counts, rw, [128, 256, 0, 0], True, 0)
        assert dgu.shape == (384, 1024) and dw.shape == (384,) and dw.dtype == torch.float32 and hh.shape == (384, 512)
        dw2, hh2 = torch.ops.mok.gemm_fc2_dgrad_swiglu_(y, w2, gu, offsets, counts, rw, [128, 256, 0, 0], True, 0)
        assert dw2.shape == (384,) and dw2.dtype == torch.float32 and hh2.shape == (384, 512)
        dw3, hh3 = torch.ops.mok.gemm_fc2_dgrad_swiglu_(y, w2, gu, offsets, counts, None, [128, 256, 0, 0], False, 0)
        assert dw3.shape == (0,) and hh3.shape == (0, 512)
        assert torch.ops.mok.gemm_fc2_dgrad(y, w2, offsets, v, 0).shape == (384, 512)
        dx = torch.ops.mok.gemm_fc1_dgrad(dgu, w1, offsets, v, 0)
        assert dx.shape == (384, 1024)
        d1 = torch.ops.mok.gemm_weight_grad(dgu, x, offsets, torch.float32, False, 0)
        assert d1.shape == (4, 1024, 1024) and d1.dtype == torch.float32
        d2 = torch.ops.mok.gemm_weight_grad(y, h, offsets, torch.bfloat16, True, 0)
        assert d2.shape == (4, 1024, 512) and d2.dtype == torch.bfloat16


# ---- GPU -------------------------------------------------------------------------------------

REL_TOL = 1e-2  # bf16 operands and outputs, fp32 accumulation


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


class Layout:
    """An expert-grouped layout: counts per expert, segments padded to `tile`, plus `extra`
    spare rows after R_pad (outputs must leave them untouched)."""

    def __init__(self, counts, tile, extra=None):
        self.counts = list(counts)
        self.tile = tile
        self.offsets = [0]
        for c in self.counts:
            self.offsets.append(self.offsets[-1] + -(-c // tile) * tile)
        self.R_pad = self.offsets[-1]
        self.R = self.R_pad + (2 * tile if extra is None else extra)
        self.L = len(self.counts)
        self.offsets_d = torch.tensor(self.offsets, dtype=torch.int32, device="cuda")
        self.counts_d = torch.tensor(self.counts, dtype=torch.int32, device="cuda")

    def segments(self):
        for l in range(self.L):
            yield l, self.offsets[l], self.offsets[l] + self.counts[l], self.offsets[l + 1]

    def real_mask(self):
        m = torch.zeros(self.R, dtype=torch.bool, device="cuda")
        for _, s, e, _ in self.segments():
            m[s:e] = True
        return m


def _poisoned(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(name, out, ref, lay: Layout, seed, rows_written=None):
    rows = lay.R_pad if rows_written is None else rows_written
    body = out[:rows]
    assert not torch.isnan(body).any(), f"{name}: unwritten (NaN) elements in rows [0, {rows}) (seed {seed})"
    if out.shape[0] > rows:
        assert torch.isnan(out[rows:]).all(), f"{name}: rows beyond R_pad were written (seed {seed})"
    err = _rel(body, ref[:rows])
    assert err < REL_TOL, f"{name}: relative error {err:.3e} (seed {seed})"
    return err


def _inputs(lay: Layout, H, I, padding="random"):
    """Expert-grouped x (padding rows random or zero), weights scaled for unit-size outputs."""
    x = torch.randn(lay.R, H, device="cuda").bfloat16()
    if padding == "zero":
        x[~lay.real_mask()] = 0
    w1 = (torch.randn(lay.L, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
    w2 = (torch.randn(lay.L, H, I, device="cuda") / I ** 0.5).bfloat16()
    rw = torch.rand(lay.R, device="cuda")
    return x, w1, w2, rw


def _silu(g):
    return g * torch.sigmoid(g)


def ref_fc1(lay, x, w1, rw):
    I = w1.shape[1] // 2
    h = torch.zeros(lay.R, I, dtype=torch.float64, device="cuda")
    gu = torch.zeros(lay.R, 2 * I, dtype=torch.float64, device="cuda")
    for l, s, e, _ in lay.segments():
        a = x[s:e].double() @ w1[l].double().t()
        gu[s:e] = a
        hv = _silu(a[:, :I]) * a[:, I:]
        h[s:e] = hv * (rw[s:e, None].double() if rw is not None else 1)
    return h, gu


def ref_rowwise(lay, a, b_of):
    """out[rows of l] = a[rows of l] @ b_of(l) over whole segments (padding rows included)."""
    out = torch.zeros(lay.R, b_of(0).shape[1], dtype=torch.float64, device="cuda")
    for l, s, _, p in lay.segments():
        out[s:p] = a[s:p].double() @ b_of(l).double()
    return out


def ref_swiglu_bwd(lay, dh, gu, rw):
    I = dh.shape[1]
    g, u = gu[:, :I].double(), gu[:, I:].double()
    s = torch.sigmoid(g)
    act = g * s
    w = rw.double()[:, None] if rw is not None else torch.ones_like(g[:, :1])
    mask = lay.real_mask()[:, None].double()
    dgate = dh * w * u * (s + act * (1 - s)) * mask
    dup = dh * w * act * mask
    dw = (dh * act * u * mask).sum(1)
    h = act * u * w * mask
    return torch.cat([dgate, dup], 1), dw, h


SMALL = [0, 1, 130, 700, 63, 0, 2500, 64]  # empty, one row, not tile multiples, a hot expert


def _configs(kernel):
    """(tile_rows, variant) of every built variant on every layout it takes."""
    return [(tile, v) for tile in (128, 64) for v in sorted(gg.VARIANTS[kernel]) if tile % v.block_m == 0]


def _id(c):
    tile, v = c
    return f"t{tile}-m{v.block_m}n{v.wg_n}" + ("-tma" if v.tma_store else "") + ("-mc" if v.multicast else "")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _configs("fc1"), ids=_id)
@pytest.mark.parametrize("weighted", [False, True])
def test_fc1_swiglu(cfg, weighted):
    tile, v = cfg
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    x, w1, _, rw = _inputs(lay, H, I)
    rw = rw if weighted else None
    h_ref, gu_ref = ref_fc1(lay, x, w1, rw)
    for num_ctas, keep_gu in ((0, True), (3, True), (0, False)):  # few CTAs: many tiles each
        h, gu = _poisoned(lay.R, I), _poisoned(lay.R, 2 * I)
        gg.launch_fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw, h, gu if keep_gu else None, variant=v,
                             num_ctas=num_ctas)
        torch.cuda.synchronize()
        _check(f"h (ctas={num_ctas})", h, h_ref, lay, seed)
        if keep_gu:
            _check(f"gu (ctas={num_ctas})", gu, gu_ref, lay, seed)
        else:
            assert torch.isnan(gu).all(), "gu was written though not asked for"
        pad = ~lay.real_mask()[:lay.R_pad]
        assert (h[:lay.R_pad][pad] == 0).all(), f"padding rows of h must be 0 (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _configs("fc2"), ids=_id)
def test_fc2(cfg):
    tile, v = cfg
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    h = torch.randn(lay.R, I, device="cuda").bfloat16()
    w2 = (torch.randn(lay.L, H, I, device="cuda") / I ** 0.5).bfloat16()
    ref = ref_rowwise(lay, h, lambda l: w2[l].t())
    for num_ctas in (0, 5):
        y = _poisoned(lay.R, H)
        gg.launch_fc2(h, w2, lay.offsets_d, y, variant=v, num_ctas=num_ctas)
        torch.cuda.synchronize()
        _check(f"y (ctas={num_ctas})", y, ref, lay, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 64])
def test_fc1_preact_is_the_fused_kernels_pre_activation(tile):
    """fc1_preact (the plain row GEMM on fc1's weight) gives x W1^T: against float64, and bitwise
    the gu the fused fc1 + SwiGLU kernel saves (same K order per element)."""
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    x, w1, _, _ = _inputs(lay, H, I, padding="zero")  # the plain GEMM maps zero padding rows to zeros
    _, gu_ref = ref_fc1(lay, x, w1, None)
    gu = _poisoned(lay.R, 2 * I)
    gg.launch_fc2(x, w1, lay.offsets_d, gu, variant=gg.variant("fc2", tile))
    gu_op = gg.fc1_preact(x, w1, lay.offsets_d, tile_rows=tile)
    _, gu_fused = gg.fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, None, tile_rows=tile, save_preact=True)
    torch.cuda.synchronize()
    _check("gu", gu, gu_ref, lay, seed)
    assert torch.equal(gu_op[:lay.R_pad], gu[:lay.R_pad]), f"the op differs from its launcher (seed {seed})"
    real = lay.real_mask()
    assert torch.equal(gu[real], gu_fused[real]), f"fc1_preact differs from the fused kernel's gu (seed {seed})"


def _fc2_dgrad_swiglu_inputs(lay, H, I, weighted):
    """dy bf16 [R, H], fc2 weight bf16 [L, H, I], gu bf16 [R, 2I], router weight fp32 [R] or None."""
    dy = torch.randn(lay.R, H, device="cuda").bfloat16()
    w2 = (torch.randn(lay.L, H, I, device="cuda") / H ** 0.5).bfloat16()
    gu = torch.randn(lay.R, 2 * I, device="cuda").bfloat16()
    rw = torch.rand(lay.R, device="cuda") if weighted else None
    return dy, w2, gu, rw


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _configs("fc2_dgrad_swiglu"), ids=_id)
@pytest.mark.parametrize("weighted", [False, True])
def test_fc2_dgrad_swiglu(cfg, weighted):
    tile, v = cfg
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    dy, w2, gu, rw = _fc2_dgrad_swiglu_inputs(lay, H, I, weighted)
    dh = ref_rowwise(lay, dy, lambda l: w2[l])
    dgu_ref, dw_ref, h_ref = ref_swiglu_bwd(lay, dh, gu, rw)
    for num_ctas in (0, 4):
        dgu, hh = _poisoned(lay.R, 2 * I), _poisoned(lay.R, I)
        dw = _poisoned(lay.R, dtype=torch.float32) if weighted else None
        scratch = torch.empty(gg.dgrad_scratch_floats(lay.R, I), device="cuda") if weighted else None
        gg.launch_fc2_dgrad_swiglu(dy, w2, gu, lay.offsets_d, lay.counts_d, rw, dgu, hh, dw, scratch, variant=v,
                                   num_ctas=num_ctas)
        torch.cuda.synchronize()
        _check(f"dgu (ctas={num_ctas})", dgu, dgu_ref, lay, seed)
        _check(f"h recomputed (ctas={num_ctas})", hh, h_ref, lay, seed)
        if weighted:
            _check(f"d router weight (ctas={num_ctas})", dw, dw_ref, lay, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _configs("fc2_dgrad_swiglu"), ids=_id)
@pytest.mark.parametrize("weighted", [False, True])
def test_fc2_dgrad_swiglu_written_over_gu_is_bitwise_the_separate_output(cfg, weighted):
    """fc2_dgrad_swiglu_ (dgu written over gu, as the backward runs it) gives bitwise the dgu, h
    and router-weight gradient of the kernel with a separate output, padding rows included, and
    leaves the rows past R_pad as they were; the op and the function agree with the launcher."""
    tile, v = cfg
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    dy, w2, gu, rw = _fc2_dgrad_swiglu_inputs(lay, H, I, weighted)
    dgu, hh = _poisoned(lay.R, 2 * I), _poisoned(lay.R, I)
    dw = _poisoned(lay.R, dtype=torch.float32) if weighted else None
    scratch = torch.empty(gg.dgrad_scratch_floats(lay.R, I), device="cuda") if weighted else None
    gg.launch_fc2_dgrad_swiglu(dy, w2, gu, lay.offsets_d, lay.counts_d, rw, dgu, hh, dw, scratch, variant=v)
    for num_ctas in (0, 4):
        over = gu.clone()
        dw_o, h_o = gg.fc2_dgrad_swiglu_(dy, w2, over, lay.offsets_d, lay.counts_d, rw, tile_rows=tile, want_h=True,
                                         block_m=v.block_m, multicast=v.multicast, num_ctas=num_ctas)
        torch.cuda.synchronize()
        P = lay.R_pad
        assert torch.equal(over[:P], dgu[:P]), f"dgu over gu differs (ctas={num_ctas}, seed {seed})"
        assert torch.equal(over[P:], gu[P:]), f"rows past R_pad changed (ctas={num_ctas}, seed {seed})"
        assert torch.equal(h_o[:P], hh[:P]), f"h differs (ctas={num_ctas}, seed {seed})"
        if weighted:
            assert torch.equal(dw_o[:P], dw[:P]), f"router-weight gradient differs (ctas={num_ctas}, seed {seed})"
        else:
            assert dw_o is None


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("weighted", [False, True])
def test_fc2_dgrad_swiglu_is_bitwise_the_separate_path(tile, weighted):
    """The fused kernel's offloaded epilogue runs the separate SwiGLU backward's math on the
    bf16 dh the plain data gradient (same tile) writes, in the same summation order: dgu, h and
    the router-weight gradient agree bitwise on the real rows, at the real Kimi-K2 shape."""
    from megatron_mok.ops.swiglu import swiglu_backward
    seed = _seed()
    H, I = 7168, 2048
    lay = Layout([1500, 0, 170, 1, 680, 129, 64], tile)
    fused = gg.DEFAULTS["fc2_dgrad_swiglu"][tile]
    plain = gg.Variant(fused.block_m, fused.wg_n, True, False)
    dy = torch.randn(lay.R, H, device="cuda").bfloat16()
    w2 = (torch.randn(lay.L, H, I, device="cuda") / H ** 0.5).bfloat16()
    gu = torch.randn(lay.R, 2 * I, device="cuda").bfloat16()
    rw = torch.rand(lay.R, device="cuda") if weighted else None
    dgu, hh = _poisoned(lay.R, 2 * I), _poisoned(lay.R, I)
    dw = _poisoned(lay.R, dtype=torch.float32) if weighted else None
    scratch = torch.empty(gg.dgrad_scratch_floats(lay.R, I), device="cuda") if weighted else None
    gg.launch_fc2_dgrad_swiglu(dy, w2, gu, lay.offsets_d, lay.counts_d, rw, dgu, hh, dw, scratch, variant=fused)
    dh = _poisoned(lay.R, I)
    gg.launch_fc2_dgrad(dy, w2, lay.offsets_d, dh, variant=plain)
    dgu_sep, dw_sep, h_sep = swiglu_backward(gu, rw, dh, lay.offsets_d, True)
    torch.cuda.synchronize()
    real = lay.real_mask()
    pairs = [("dgu", dgu, dgu_sep), ("h", hh, h_sep)] + ([("d router weight", dw, dw_sep)] if weighted else [])
    for name, a, b in pairs:
        assert not torch.isnan(a[real]).any(), f"{name}: unwritten real rows (seed {seed})"
        assert torch.equal(a[real], b[real]), f"{name}: fused differs from the separate path (seed {seed})"
    pad = ~real
    pad[lay.R_pad:] = False
    assert (dgu[pad] == 0).all() and (hh[pad] == 0).all(), f"padding rows not zero (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _configs("dgrad"), ids=_id)
def test_fc1_dgrad(cfg):
    tile, v = cfg
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    dgu = torch.randn(lay.R, 2 * I, device="cuda").bfloat16()
    w1 = (torch.randn(lay.L, 2 * I, H, device="cuda") / (2 * I) ** 0.5).bfloat16()
    ref = ref_rowwise(lay, dgu, lambda l: w1[l])
    for num_ctas in (0, 7):
        dx = _poisoned(lay.R, H)
        gg.launch_fc1_dgrad(dgu, w1, lay.offsets_d, dx, variant=v, num_ctas=num_ctas)
        torch.cuda.synchronize()
        _check(f"dx (ctas={num_ctas})", dx, ref, lay, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _configs("dgrad"), ids=_id)
def test_fc2_dgrad_plain(cfg):
    tile, v = cfg
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    dy = torch.randn(lay.R, H, device="cuda").bfloat16()
    w2 = (torch.randn(lay.L, H, I, device="cuda") / H ** 0.5).bfloat16()
    ref = ref_rowwise(lay, dy, lambda l: w2[l])
    for num_ctas in (0, 4):
        dh = _poisoned(lay.R, I)
        gg.launch_fc2_dgrad(dy, w2, lay.offsets_d, dh, variant=v, num_ctas=num_ctas)
        torch.cuda.synchronize()
        _check(f"dh (ctas={num_ctas})", dh, ref, lay, seed)


def _ref_wgrad(lay, a, b):
    out = torch.zeros(lay.L, a.shape[1], b.shape[1], dtype=torch.float64, device="cuda")
    for l, s, _, p in lay.segments():
        out[l] = a[s:p].double().t() @ b[s:p].double()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-tma", "accumulate"])
def test_weight_grad(tile, mode):
    seed = _seed()
    lay = Layout(SMALL, tile)
    M, N = 1024, 512
    a = torch.randn(lay.R, M, device="cuda").bfloat16()
    b = torch.randn(lay.R, N, device="cuda").bfloat16()
    ref = _ref_wgrad(lay, a, b)
    for num_ctas in (0, 6):
        if mode == "accumulate":
            base = torch.randn(lay.L, M, N, device="cuda")
            out = base.clone()
            gg.launch_weight_grad(a, b, lay.offsets_d, out, accumulate=True, num_ctas=num_ctas)
            expect = ref + base.double()
        else:
            out = _poisoned(lay.L, M, N, dtype=torch.float32 if mode == "fp32" else torch.bfloat16)
            gg.launch_weight_grad(a, b, lay.offsets_d, out, tma_store=mode == "bf16-tma", num_ctas=num_ctas)
            expect = ref
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), f"unwritten weight-gradient elements (seed {seed})"
        for l, c in enumerate(lay.counts):
            if c == 0:  # empty experts: zero gradient, or main_grad left exactly as it was
                want = base[l] if mode == "accumulate" else torch.zeros_like(out[l])
                assert torch.equal(out[l], want.to(out.dtype)), f"empty expert {l} (seed {seed})"
        err = _rel(out, expect)
        assert err < REL_TOL, f"weight grad {mode} (ctas={num_ctas}): relative error {err:.3e} (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("l0", [3, 7])
def test_a_launch_over_a_segment_of_experts_writes_exactly_its_rows(tile, l0):
    """offsets + l0, counts + l0 and the weights of experts l0..: bitwise the rows of those
    experts that a launch over all of them writes, and no other row (NaN stays NaN). This is how
    the cuda backend runs a weight segment (a shared expert in parameters of its own)."""
    seed = _seed()
    lay = Layout(SMALL, tile)
    H, I = 1024, 512
    x, w1, w2, rw = _inputs(lay, H, I)
    dy = torch.randn(lay.R, H, device="cuda").bfloat16()
    offs, cnts = lay.offsets_d[l0:], lay.counts_d[l0:]
    s, e = lay.offsets[l0], lay.R_pad
    seg1, seg2 = w1[l0:].contiguous(), w2[l0:].contiguous()
    v1, v2 = gg.variant("fc1", tile), gg.variant("fc2", tile)
    vs, vd = gg.variant("fc2_dgrad_swiglu", tile), gg.variant("dgrad", tile)

    def same_rows(name, full, seg):
        torch.cuda.synchronize()
        assert torch.equal(seg[s:e], full[s:e]), f"{name}: segment rows differ (l0={l0}, seed {seed})"
        assert torch.isnan(seg[:s]).all() and torch.isnan(seg[e:]).all(), \
            f"{name}: rows outside the segment were written (l0={l0}, seed {seed})"

    h, gu = _poisoned(lay.R, I), _poisoned(lay.R, 2 * I)
    gg.launch_fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw, h, gu, variant=v1)
    h_s, gu_s = _poisoned(lay.R, I), _poisoned(lay.R, 2 * I)
    gg.launch_fc1_swiglu(x, seg1, offs, cnts, rw, h_s, gu_s, variant=v1)
    same_rows("fc1 h", h, h_s)
    same_rows("fc1 gu", gu, gu_s)

    y, y_s = _poisoned(lay.R, H), _poisoned(lay.R, H)
    gg.launch_fc2(h, w2, lay.offsets_d, y, variant=v2)
    gg.launch_fc2(h, seg2, offs, y_s, variant=v2)
    same_rows("fc2", y, y_s)

    outs = []
    for w, o, c in ((w2, lay.offsets_d, lay.counts_d), (seg2, offs, cnts)):
        dgu, hh, dw = _poisoned(lay.R, 2 * I), _poisoned(lay.R, I), _poisoned(lay.R, dtype=torch.float32)
        scratch = torch.full((gg.dgrad_scratch_floats(lay.R, I),), float("nan"), device="cuda")
        gg.launch_fc2_dgrad_swiglu(dy, w, gu, o, c, rw, dgu, hh, dw, scratch, variant=vs)
        outs.append((dgu, hh, dw))
    for name, full, seg in zip(("dgu", "h recomputed", "d router weight"), *outs):
        same_rows(f"fc2 dgrad + SwiGLU {name}", full, seg)

    dgu = outs[0][0]
    dx, dx_s = _poisoned(lay.R, H), _poisoned(lay.R, H)
    gg.launch_fc1_dgrad(dgu, w1, lay.offsets_d, dx, variant=vd)
    gg.launch_fc1_dgrad(dgu, seg1, offs, dx_s, variant=vd)
    same_rows("fc1 dgrad", dx, dx_s)

    full = gg.weight_grad(dgu, x, lay.offsets_d, out_dtype=torch.bfloat16)
    seg = gg.weight_grad(dgu, x, offs, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert seg.shape[0] == lay.L - l0 and torch.equal(seg, full[l0:]), f"weight grad (l0={l0}, seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["kimi", "qwen"])
def test_expert_ffn_chain_at_real_shapes(shape):
    """fc1+SwiGLU -> fc2 forward and the whole backward at the real H, I with skewed counts,
    through the public wrappers, against one float64 reference of the chain."""
    seed = _seed()
    H, I = (7168, 2048) if shape == "kimi" else (4096, 1536)
    lay = Layout([3000, 0, 170, 1, 680, 0, 129, 64], 128)
    x, w1, w2, rw = _inputs(lay, H, I, padding="zero")
    dy = torch.randn(lay.R, H, device="cuda").bfloat16()
    # forward
    h, gu = gg.fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw, save_preact=True)
    y = gg.fc2(h, w2, lay.offsets_d)
    # backward
    dgu, dw, h_re = gg.fc2_dgrad_swiglu(dy, w2, gu, lay.offsets_d, lay.counts_d, rw, want_h=True)
    dx = gg.fc1_dgrad(dgu, w1, lay.offsets_d)
    d_w1 = gg.weight_grad(dgu, x, lay.offsets_d)
    d_w2 = torch.zeros(lay.L, H, I, device="cuda")
    gg.weight_grad(dy, h_re, lay.offsets_d, main_grad=d_w2)
    torch.cuda.synchronize()
    # float64 chain on the real rows (padding rows of x are zero, as dispatch leaves them)
    h_ref, gu_ref = ref_fc1(lay, x, w1, rw)
    y_ref = ref_rowwise(lay, h_ref, lambda l: w2[l].double().t())
    dh = ref_rowwise(lay, dy, lambda l: w2[l])
    dgu_ref, dw_ref, h_re_ref = ref_swiglu_bwd(lay, dh, gu_ref, rw)
    dx_ref = ref_rowwise(lay, dgu_ref, lambda l: w1[l].double())
    dw1_ref = _ref_wgrad(lay, dgu_ref, x)
    dw2_ref = _ref_wgrad(lay, dy, h_re_ref)
    R = lay.R_pad
    errs = {}
    for name, out, ref in [("h", h, h_ref), ("gu", gu, gu_ref), ("y", y, y_ref), ("dgu", dgu, dgu_ref),
                           ("h recomputed", h_re, h_re_ref), ("dx", dx, dx_ref)]:
        assert not torch.isnan(out[:R]).any(), f"{name}: NaN (seed {seed})"
        errs[name] = _rel(out[:R], ref[:R])
    errs["d router weight"] = _rel(dw[:R], dw_ref[:R])
    errs["d fc1_weight"] = _rel(d_w1, dw1_ref)
    errs["d fc2_weight"] = _rel(d_w2, dw2_ref)
    bad = {k: v for k, v in errs.items() if not v < REL_TOL}
    assert not bad, f"relative errors over {REL_TOL}: {bad} (all: {errs}, seed {seed})"


@pytest.mark.gpu
def test_results_are_deterministic_and_ops_match_launchers():
    seed = _seed()
    lay = Layout(SMALL, 128)
    H, I = 1024, 512
    x, w1, w2, rw = _inputs(lay, H, I)
    h1, gu1 = gg.fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw, save_preact=True)
    h2, gu2 = gg.fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw, save_preact=True, num_ctas=9)
    R = lay.R_pad
    assert torch.equal(h1[:R], h2[:R]) and torch.equal(gu1[:R], gu2[:R]), f"seed {seed}"
    dy = torch.randn(lay.R, H, device="cuda").bfloat16()
    a = gg.fc2_dgrad_swiglu(dy, w2, gu1, lay.offsets_d, lay.counts_d, rw)
    b = gg.fc2_dgrad_swiglu(dy, w2, gu1, lay.offsets_d, lay.counts_d, rw, num_ctas=5)
    assert torch.equal(a[0][:R], b[0][:R]) and torch.equal(a[1][:R], b[1][:R]), f"seed {seed}"
    d1 = gg.weight_grad(a[0], x, lay.offsets_d)
    d2 = gg.weight_grad(a[0], x, lay.offsets_d, num_ctas=11)
    assert torch.equal(d1, d2), f"seed {seed}"


@pytest.mark.gpu
def test_empty_layout_and_wrappers_under_compile():
    lay = Layout([0, 0, 0], 128, extra=128)
    H, I = 1024, 512
    x, w1, w2, rw = _inputs(lay, H, I)
    h, _ = gg.fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw)
    y = gg.fc2(h, w2, lay.offsets_d)
    d = gg.weight_grad(torch.randn(lay.R, 2 * I, device="cuda").bfloat16(), x, lay.offsets_d)
    torch.cuda.synchronize()
    assert y.shape == (lay.R, H) and torch.equal(d, torch.zeros_like(d))

    lay = Layout([5, 300, 0, 77], 128)
    x, w1, w2, rw = _inputs(lay, H, I)

    def ffn(x, w1, w2, offsets, counts, rw):
        h, _ = gg.fc1_swiglu(x, w1, offsets, counts, rw)
        return gg.fc2(h, w2, offsets)

    eager = ffn(x, w1, w2, lay.offsets_d, lay.counts_d, rw)
    compiled = torch.compile(ffn, fullgraph=True, backend="aot_eager")(x, w1, w2, lay.offsets_d, lay.counts_d, rw)
    torch.cuda.synchronize()
    assert torch.equal(eager[:lay.R_pad], compiled[:lay.R_pad])


@pytest.mark.gpu
def test_mc_variants_match_single_cta_bitwise():
    """Clusters of two sharing B by multicast compute every tile exactly as one CTA does: the
    same K order, so the same bits, at a real shape with odd row-block counts (a CTA of a pair
    then has no tile to store)."""
    seed = _seed()
    H, I = 7168, 2048
    lay = Layout([3000, 0, 170, 1, 680, 0, 129, 64], 128)
    x, w1, w2, rw = _inputs(lay, H, I, padding="zero")
    R = lay.R_pad
    one, two = gg.Variant(128, 256, True, False), gg.Variant(128, 256, True, True)
    outs = []
    for v in (one, two):
        h, gu = _poisoned(lay.R, I), _poisoned(lay.R, 2 * I)
        gg.launch_fc1_swiglu(x, w1, lay.offsets_d, lay.counts_d, rw, h, gu, variant=v)
        y = _poisoned(lay.R, H)
        gg.launch_fc2(h, w2, lay.offsets_d, y, variant=v)
        dx = _poisoned(lay.R, H)
        gg.launch_fc1_dgrad(gu, w1, lay.offsets_d, dx, variant=v)
        dh = _poisoned(lay.R, I)
        gg.launch_fc2_dgrad(y, w2, lay.offsets_d, dh, variant=v)
        outs.append((h, gu, y, dx, dh))
    torch.cuda.synchronize()
    for name, a, b in zip(("h", "gu", "y", "dx", "dh"), *outs):
        assert not torch.isnan(b[:R]).any(), f"{name}: unwritten rows with multicast (seed {seed})"
        assert torch.isnan(b[R:]).all(), f"{name}: rows beyond R_pad written with multicast (seed {seed})"
        assert torch.equal(a[:R], b[:R]), f"{name}: multicast differs from one CTA (seed {seed})"
