"""The public entry point's checks: bad inputs and bad tunables fail with clear messages before
any GPU work; backend selection says why a backend cannot run."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import MegakernelTunables, MoKConfig, MoKConfigError
from megatron_mok.config import default_minibatch_rows
from megatron_mok.functional import BackendUnavailable, MoKInputError, mok_moe

from tests.cases import make_case
from tests.distributed import run_ranks


def _args(T=6, H=8, I=4, L=3, K=2, dtype=torch.float32):
    case = make_case(0, [T], H, I, L, K, dtype=dtype)
    return [case.x[0], case.ids[0], case.weights[0].float(), case.local_fc1(0), case.local_fc2(0)]


@pytest.mark.parametrize("index,bad,message", [
    (0, lambda a: a.to(torch.int32), "x has dtype torch.int32"),
    (1, lambda a: a.to(torch.int32), "topk_ids has dtype torch.int32; it must be torch.int64"),
    (2, lambda a: a.to(torch.bfloat16), "topk_weights has dtype torch.bfloat16; it must be torch.float32"),
    (3, lambda a: a.to(torch.float64), "fc1_weight has dtype torch.float64 but x has torch.float32"),
    (0, lambda a: a[:, :4], r"fc1_weight is \(3, 8, 8\); it must be \[E/P, 2I, H\] with H = 4"),
    (1, lambda a: a[:5], r"topk_ids is \(5, 2\)"),
    (2, lambda a: a[:, :1], r"topk_weights is \(6, 1\)"),
    (4, lambda a: a[:, :, :3], r"fc2_weight is \(3, 8, 3\); it must be \[E/P, H, I\] = \(3, 8, 4\)"),
    (3, lambda a: a[0], r"fc1_weight has shape \(8, 8\); it must be 3-D"),
    (3, lambda a: a[:, :7], "even, non-zero 2I"),
])
def test_bad_inputs_are_clear_errors(index, bad, message):
    args = _args()
    args[index] = bad(args[index])
    with pytest.raises(MoKInputError, match=message):
        mok_moe(*args, backend="reference")


def _split(w, at):
    return (w[:at].clone(), w[at:].clone())


def test_weight_segments_give_the_stacked_results_and_split_gradients():
    """Tuple weights (routed experts, then a shared one) are the same local experts as their
    concatenation: same output, and each segment gets its slice of the stacked gradient."""
    x, ids, w, fc1, fc2 = _args(L=4, K=3)
    def leaves_of(f):  # the same container (tensor, tuple or list) of fresh leaves
        if isinstance(f, torch.Tensor):
            return f.clone().requires_grad_(), [f]
        segs = [t.clone().requires_grad_() for t in f]
        return type(f)(segs), segs

    def run(f1, f2):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        (a1, seg1), (a2, seg2) = leaves_of(f1), leaves_of(f2)
        seg1 = [a1] if isinstance(a1, torch.Tensor) else seg1
        seg2 = [a2] if isinstance(a2, torch.Tensor) else seg2
        y = mok_moe(leaves[0], ids, leaves[1], a1, a2, backend="reference")
        y.backward(torch.ones_like(y))
        return y, [t.grad for t in leaves], [t.grad for t in seg1], [t.grad for t in seg2]
    y, (dx, dw), (d1,), (d2,) = run(fc1, fc2)
    y_s, (dx_s, dw_s), d1_s, d2_s = run(_split(fc1, 3), list(_split(fc2, 3)))
    assert torch.equal(y, y_s) and torch.equal(dx, dx_s) and torch.equal(dw, dw_s)
    assert torch.equal(d1, torch.cat(d1_s)) and torch.equal(d2, torch.cat(d2_s))
    assert [t.shape[0] for t in d1_s] == [3, 1] and [t.shape[0] for t in d2_s] == [3, 1]


@pytest.mark.parametrize("make,message", [
    (lambda f1, f2: (f1, _split(f2, 2)), r"fc1_weight has 1 weight segments and fc2_weight 2"),
    (lambda f1, f2: (_split(f1, 2), (f2[:2], f2[1:])), r"fc2_weight\[1\] is \(2, 8, 4\); .* = \(1, 8, 4\)"),
    (lambda f1, f2: ((f1[:2], f1[2:, :4]), _split(f2, 2)), r"fc1_weight\[1\] is \(1, 4, 8\).*same 2I = 8"),
    (lambda f1, f2: ((f1[:2], f1[2:], f1[2:]), (f2[:2], f2[2:], f2[2:])), "a tuple of 1 to 2 tensors"),
    (lambda f1, f2: ((f1[:2], "shared"), _split(f2, 2)), r"fc1_weight\[1\] must be a torch.Tensor, got str"),
    (lambda f1, f2: ((f1[:3], f1[3:]), (f2[:3], f2[3:])), r"fc1_weight\[1\] holds no experts"),
])
def test_bad_weight_segments_are_clear_errors(make, message):
    x, ids, w, fc1, fc2 = _args()
    f1, f2 = make(fc1, fc2)
    with pytest.raises(MoKInputError, match=message):
        mok_moe(x, ids, w, f1, f2, backend="reference")


@pytest.mark.parametrize("bad", [3, -2, 2 ** 40])
def test_expert_id_out_of_range_gives_nan_then_a_clear_error(bad):
    """The GPU backends' rule on the reference backend too (docs/contract.md, "Errors"): the call
    returns NaN, its backward, the next call and check_errors() raise naming the rank and the id;
    the workspace stays failed until released."""
    from megatron_mok.functional import MoKRuntimeError, check_errors
    from megatron_mok.functional.workspace import release_workspaces

    release_workspaces()
    args = _args()
    args[1] = args[1].clone()
    args[1][2, 0] = bad  # E = 3 experts at P = 1
    args[0].requires_grad_()
    y = mok_moe(*args, backend="reference")
    assert torch.isnan(y).all()
    message = rf"topk_ids of EP rank 0 held expert id {bad} in an earlier call; ids must lie in \[0, 3\)"
    with pytest.raises(MoKRuntimeError, match=message):
        y.sum().backward()
    with pytest.raises(MoKRuntimeError, match=message):
        check_errors()
    with pytest.raises(MoKRuntimeError, match=message):
        mok_moe(*_args(), backend="reference")  # a clean call on the failed workspace
    release_workspaces()
    assert torch.isfinite(mok_moe(*_args(), backend="reference")).all()


def _indivisible_worker(rank, world):
    import torch.distributed as dist

    args = _args()
    with pytest.raises(MoKConfigError, match="num_experts=5 is not divisible by the expert-parallel size 2"):
        mok_moe(*args, ep_group=dist.group.WORLD, config=MoKConfig(num_experts=5), backend="reference")
    with pytest.raises(MoKConfigError, match="gives 4 experts per rank, but the expert weights hold 3"):
        mok_moe(*args, ep_group=dist.group.WORLD, config=MoKConfig(num_experts=8), backend="reference")


def test_experts_not_divisible_by_ep_size_is_a_clear_error():
    run_ranks(_indivisible_worker, 2)


def _disagreeing_worker(rank, world, field, values, message):
    """Every rank calls with its own value of ``field``: each must raise the same mismatch error
    (naming the ranks and values) before any data is exchanged."""
    import torch.distributed as dist

    from megatron_mok.functional import MoKMismatchError

    args = _args()
    if field == "hidden":  # a different model size on one rank
        args = _args(H=8 if rank == 0 else 16)
        config = MoKConfig()
    elif field.startswith("megakernel."):
        config = MoKConfig(megakernel=MegakernelTunables(**{field.split(".")[1]: values[rank]}))
    else:
        config = MoKConfig(**{field: values[rank]})
    with pytest.raises(MoKMismatchError, match=message):
        mok_moe(*args, ep_group=dist.group.WORLD, config=config, backend="reference")
    # The same settings on every rank then agree (and run).
    y = mok_moe(*_args(), ep_group=dist.group.WORLD, config=MoKConfig(), backend="reference")
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("field, values, message", [
    ("tile_rows", (4, 1), r"tile_rows: EP rank 0 \(global rank 0\) has 4, EP rank 1 \(global rank 1\) has 1"),
    ("megakernel.group_blocks", (8, 16), r"megakernel.group_blocks: EP rank 0 .* has 8, EP rank 1 .* has 16"),
    ("megakernel.pairs", (None, False), r"megakernel.pairs: EP rank 0 .* has None, EP rank 1 .* has False"),
    ("max_tokens_per_rank", (None, 64), r"max_tokens_per_rank: .* has None, .* has 64"),
    ("hidden", None, r"hidden size H: EP rank 0 .* has 8, EP rank 1 .* has 16"),
])
def test_ranks_with_different_settings_get_the_same_clear_error(field, values, message):
    run_ranks(_disagreeing_worker, 2, field, values, message)


def test_unknown_backend_and_unavailable_backend():
    args = _args()
    with pytest.raises(MoKInputError, match="backend='fast' is not one of"):
        mok_moe(*args, backend="fast")
    with pytest.raises(BackendUnavailable, match="backend='cuda' cannot run: the tensors are on cpu"):
        mok_moe(*args, backend="cuda")
    # auto on the CPU runs the reference backend
    y = mok_moe(*args)
    assert y.shape == args[0].shape and torch.isfinite(y).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(tile_rows=96), "tile_rows=96 is not supported"),
    (dict(tile_rows=0), "tile_rows=0"),
    (dict(timeout_s=0), "timeout_s=0 must be a positive"),
    (dict(timeout_s=float("inf")), "timeout_s=inf"),
    (dict(comm_sms_forward=0), "comm_sms_forward=0 must be None"),
    (dict(minibatch_rows=100), "minibatch_rows=100 must be a multiple of tile_rows=128"),
    (dict(minibatch_rows=256, ring_rows=384), "ring_rows=384 must be a multiple of minibatch_rows=256"),
    (dict(minibatch_rows=256, ring_rows=256), "at least two minibatches"),
    (dict(max_tokens_per_rank=True), "max_tokens_per_rank=True"),
])
def test_bad_config_values_are_clear_errors(kwargs, message):
    with pytest.raises(MoKConfigError, match=message):
        MoKConfig(**kwargs)


def test_comm_sms_must_leave_compute_sms():
    with pytest.raises(MoKConfigError, match="comm_sms_backward=132 leaves no compute SM"):
        MoKConfig(comm_sms_backward=132).resolve(hidden=7168, ffn_hidden=2048, num_sms=132)


def test_default_heuristic_gives_two_waves():
    cfg = MoKConfig().resolve(hidden=7168, ffn_hidden=2048, num_sms=132, ep_size=2)
    assert cfg.comm_sms_forward == 8 and cfg.comm_sms_backward == 10
    compute = 132 - 8
    tiles_fc1 = cfg.minibatch_rows // 128 * (2 * 2048 // 256)
    tiles_fc2 = cfg.minibatch_rows // 128 * (7168 // 256)
    assert tiles_fc1 >= 2 * compute and tiles_fc2 >= 2 * compute
    # ... and is the smallest such multiple of the tile
    smaller = cfg.minibatch_rows - 128
    assert smaller // 128 * 16 < 2 * compute or smaller // 128 * 28 < 2 * compute
    assert cfg.ring_rows == 4 * cfg.minibatch_rows
    assert cfg.minibatch_rows == 2048  # 16 row blocks x 16 fc1 column tiles = 256 >= 2 x 124
    assert MoKConfig().resolve(hidden=1024, ffn_hidden=512, ep_size=1).comm_sms_forward == 8
    assert MoKConfig().resolve(hidden=1024, ffn_hidden=512, num_sms=20).comm_sms_forward == 5  # a quarter
    assert default_minibatch_rows(hidden=7168, ffn_hidden=2048, compute_sms=124, tile_rows=128) == 2048
    # The megakernel's launch-shape tunables come from the library (megakernel_backend.resolve_tunables):
    # resolve leaves them as given.
    assert cfg.megakernel == MegakernelTunables()
    off = MoKConfig(megakernel=MegakernelTunables(pairs=False, group_blocks=16))
    assert off.resolve(hidden=7168, ffn_hidden=2048).megakernel == MegakernelTunables(pairs=False, group_blocks=16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pairs=1), "pairs=1 must be None"), (dict(group_blocks=7), "group_blocks=7 must be None"),
    (dict(group_blocks=0), "group_blocks=0"), (dict(group_blocks=True), "group_blocks=True"),
    (dict(group_blocks="8"), "group_blocks='8'")])
def test_megakernel_tunables_are_checked_where_written(kwargs, message):
    with pytest.raises(MoKConfigError, match=message):
        MegakernelTunables(**kwargs)
    with pytest.raises(MoKConfigError, match="must be a MegakernelTunables"):
        MoKConfig(megakernel={"pairs": True})


def test_import_without_gpu():
    """`import megatron_mok` needs no GPU and no Megatron (a fresh interpreter, GPUs hidden)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    code = "import megatron_mok, megatron_mok.functional, sys; assert 'megatron.core' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_cuda_backend_gemm_family_follows_the_shape():
    """MoK's Hopper GEMMs (with SwiGLU fused) wherever the shape allows, torch._grouped_mm with the
    separate SwiGLU kernels elsewhere: H and I multiples of 256, layouts padded to 64 or 128."""
    from megatron_mok.functional import expert_ffn
    from megatron_mok.functional.validate import MoEShape

    kimi = MoEShape(tokens=4096, hidden=7168, topk=8, experts_per_rank=6, ffn_hidden=2048)
    assert expert_ffn.hopper_gemms_apply(kimi, 128) and expert_ffn.hopper_gemms_apply(kimi, 64)
    assert not expert_ffn.hopper_gemms_apply(kimi, 32)
    assert not expert_ffn.hopper_gemms_apply(MoEShape(4096, 4096, 8, 16, 1152), 128)  # I % 256
    assert not expert_ffn.hopper_gemms_apply(MoEShape(4096, 1152, 8, 16, 2048), 128)  # H % 256


def test_expert_ffn_torch_path_orients_the_weights():
    """The torch._grouped_mm path of the expert FFN (shapes MoK's GEMMs refuse) multiplies by W_e^T
    for the [L, N, K] weights (fc1, fc2) and W_e for the data gradients: forward and backward
    checked on the CPU against autograd through a per-expert reference, with SwiGLU done by
    torch in place of the GPU kernels."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from megatron_mok.functional import expert_ffn

    def swiglu_forward(ab, w, offsets):
        a, b = ab.float().chunk(2, dim=1)
        return (w[:, None] * F.silu(a) * b).to(ab.dtype)

    def swiglu_backward(ab, w, g, offsets, want_hw):
        ab32 = ab.float().requires_grad_()
        w32 = w.clone().requires_grad_()
        a, b = ab32.chunk(2, dim=1)
        hw = w32[:, None] * F.silu(a) * b
        hw.backward(g.float())
        return ab32.grad.to(ab.dtype), w32.grad, hw.detach().to(ab.dtype)

    gen = torch.Generator().manual_seed(0)
    R, H, I, L = 32, 64, 24, 2
    x = torch.randn(R, H, generator=gen).bfloat16()
    w = torch.rand(R, generator=gen)
    fc1 = (torch.randn(L, 2 * I, H, generator=gen) / 8).bfloat16()
    fc2 = (torch.randn(L, H, I, generator=gen) / 5).bfloat16()
    d_out = torch.randn(R, H, generator=gen).bfloat16()
    offsets = torch.tensor([0, 16, 32], dtype=torch.int32)
    call = SimpleNamespace(hopper_gemms=False, segment_rows=16)
    ops = SimpleNamespace(swiglu_forward=swiglu_forward, swiglu_backward=swiglu_backward)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expert_ffn, "swiglu_ops", ops)
        out, hw, ab = expert_ffn.expert_forward(call, x, w, fc1, fc2, offsets, None)
        dx, dw, d_fc1, d_fc2, _, _ = expert_ffn.expert_backward(call, d_out, x, w, ab, fc1, fc2, offsets, None)
    xs, ws = x.float().requires_grad_(), w.clone().requires_grad_()
    f1, f2 = fc1.float().requires_grad_(), fc2.float().requires_grad_()
    rows = []
    for e in range(L):
        r = slice(16 * e, 16 * (e + 1))
        a, b = (xs[r] @ f1[e].t()).chunk(2, dim=1)
        rows.append((ws[r, None] * F.silu(a) * b) @ f2[e].t())
    want = torch.cat(rows)
    want.backward(d_out.float())
    close = dict(rtol=5e-2, atol=5e-2)
    assert torch.allclose(out.float(), want.detach(), **close)
    assert torch.allclose(dx.float(), xs.grad, **close)
    assert torch.allclose(dw, ws.grad, **close)
    assert torch.allclose(d_fc1.float(), f1.grad, **close)
    assert torch.allclose(d_fc2.float(), f2.grad, **close)


@pytest.mark.parametrize("hopper", [True, False])
def test_gpu_backends_read_weight_segments_in_place_only_where_the_gemms_can(hopper):
    """The GPU backends' weight arguments: the segments themselves (no copy) with MoK's Hopper
    GEMMs, else one concatenated tensor, whose gradient autograd splits back."""
    from types import SimpleNamespace

    from megatron_mok.functional.expert_ffn import weight_arguments

    call = SimpleNamespace(hopper_gemms=hopper)
    f1 = (torch.randn(3, 8, 4, requires_grad=True), torch.randn(1, 8, 4, requires_grad=True))
    f2 = (torch.randn(3, 4, 4, requires_grad=True), torch.randn(1, 4, 4, requires_grad=True))
    fc1, fc2, fc1_2, fc2_2 = weight_arguments(f1, f2, call)
    if hopper:
        assert fc1 is f1[0] and fc2 is f2[0] and fc1_2 is f1[1] and fc2_2 is f2[1]
    else:
        assert fc1_2 is None and fc2_2 is None
        assert torch.equal(fc1, torch.cat(f1)) and torch.equal(fc2, torch.cat(f2))
        (fc1.sum() + 2 * fc2.sum()).backward()
        assert all(torch.equal(t.grad, torch.ones_like(t)) for t in f1)
        assert all(torch.equal(t.grad, 2 * torch.ones_like(t)) for t in f2)
    single = weight_arguments((f1[0],), (f2[0],), call)
    assert single[0] is f1[0] and single[1] is f2[0] and single[2:] == (None, None)


def test_bad_ep_group_and_meta_tensors_are_clear_errors():
    args = _args()
    with pytest.raises(MoKInputError, match=r"ep_group='world' \(str\) is not supported"):
        mok_moe(*args, ep_group="world")
    meta = [a.to("meta") for a in args]
    with pytest.raises(MoKInputError, match="meta device, which holds no data"):
        mok_moe(*meta)


def test_check_errors_without_a_gpu_does_nothing():
    from megatron_mok.functional import check_errors

    check_errors()  # no CUDA here (or none initialised): nothing to report, no driver error


def test_double_backward_through_mok_is_refused():
    """MoK's backward is once-differentiable: a second derivative that flows through it raises
    instead of silently dropping MoK's part."""
    x, ids, w, fc1, fc2 = _args(dtype=torch.float64)
    w = w.double()
    x.requires_grad_()
    y = mok_moe(x, ids, w, fc1, fc2, backend="reference")
    (g,) = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
