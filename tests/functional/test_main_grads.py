"""Gradient-accumulation fusion (``mok_moe(..., main_grads=...)``, functional/main_grad.py): the
expert weight gradients added in fp32 into per-expert buffers that lie anywhere.

CPU: bad ``main_grads`` are clear errors before any work; the reference backend adds its
gradients into the buffers exactly as DDP would (``buf += grad``) and gives placeholders.
GPU (``cuda`` tiles 64 and 128, ``megakernel``; P = 1): the buffers, scattered through one
allocation in shuffled order and non-zero before, end within the fp32 oracle's tolerance of
``before + gradient``; bitwise identical across training rings (every row replayed, a small ring,
the default) and runs, with and without a second weight segment; dx and d topk_weights bitwise
those of the call without ``main_grads``; nothing outside the buffers is written.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import MoKInputError, mok_moe

from tests.cases import make_case


def _buffers(L, H, I, dtype=torch.float32, device="cpu"):
    return ([torch.zeros(2 * I, H, dtype=dtype, device=device) for _ in range(L)],
            [torch.zeros(H, I, dtype=dtype, device=device) for _ in range(L)])


def _cpu_call(main_grads, backend="reference"):
    case = make_case(3, [40], 16, 8, 5, 3, "zipf", dtype=torch.float32)
    x, w = case.x[0].clone().requires_grad_(), case.weights[0].clone().requires_grad_()
    fc1, fc2 = case.local_fc1(0).clone().requires_grad_(), case.local_fc2(0).clone().requires_grad_()
    y = mok_moe(x, case.ids[0], w, fc1, fc2, backend=backend, main_grads=main_grads)
    return case, (x, w, fc1, fc2), y


@pytest.mark.parametrize("make, why", [
    (lambda b: b[0], "must be a pair"),
    (lambda b: (b[0][:4], b[1]), "fc1 buffers must be a sequence of one tensor per local expert \\(L = 5\\), got 4"),
    (lambda b: (b[0], torch.zeros(5, 16, 8)), "fc2 buffers must be a sequence"),
    (lambda b: (b[0][:4] + [torch.zeros(16, 8)], b[1]), "fc1 buffer 4 must be fp32 \\[16, 16\\], got torch.float32 \\(16, 8\\)"),
    (lambda b: (b[0], b[1][:4] + [torch.zeros(16, 8, dtype=torch.bfloat16)]), "fc2 buffer 4 must be fp32"),
    (lambda b: (b[0][:4] + [torch.zeros(16, 16).t()], b[1]), "contiguous"),
    (lambda b: (b[0], b[1][:4] + [b[1][0]]), "two fc2 buffers overlap"),
])
def test_bad_main_grads_are_clear_errors(make, why):
    with pytest.raises(MoKInputError, match=why):
        _cpu_call(make(_buffers(5, 16, 8)))


def test_reference_backend_adds_into_the_buffers_as_ddp_would():
    """buf[e] = before[e] + grad[e] exactly (the add DDP runs), and the weights get placeholders
    of their shape; dx and d topk_weights are those of the call without buffers."""
    case, (x0, w0, f10, f20), y0 = _cpu_call(None)
    y0.backward(case.dy[0].float())
    gen = torch.Generator().manual_seed(9)
    fc1_bufs = [torch.randn(16, 16, generator=gen) for _ in range(5)]
    fc2_bufs = [torch.randn(16, 8, generator=gen) for _ in range(5)]
    before = [t.clone() for t in fc1_bufs + fc2_bufs]
    _, (x, w, fc1, fc2), y = _cpu_call((fc1_bufs, fc2_bufs))
    y.backward(case.dy[0].float())
    assert torch.equal(y, y0) and torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)
    for e in range(5):
        assert torch.equal(fc1_bufs[e], before[e] + f10.grad[e]), e
        assert torch.equal(fc2_bufs[e], before[5 + e] + f20.grad[e]), e
    assert fc1.grad.shape == fc1.shape and fc2.grad.shape == fc2.shape


# ------------------------------------------------------------------------------------------
# GPU

BACKENDS = [("cuda", 64), ("cuda", 128), ("megakernel", 128)]


def _scattered(L, shapes, seed):
    """Per-expert fp32 buffers for fc1 and fc2, interleaved and shuffled through one allocation
    with NaN gaps between them (as a gradient buffer may lay them out), filled with random
    values. Returns (fc1 bufs, fc2 bufs, the allocation, the gap mask)."""
    rng = random.Random(seed)
    sizes = [shapes[0][0] * shapes[0][1]] * L + [shapes[1][0] * shapes[1][1]] * L
    order = list(range(2 * L))
    rng.shuffle(order)
    gap = 32
    total = sum(s + gap for s in sizes)
    buf = torch.full((total,), float("nan"), device="cuda")
    used = torch.zeros(total, dtype=torch.bool, device="cuda")
    views = [None] * (2 * L)
    pos = 0
    for i in order:
        views[i] = buf[pos:pos + sizes[i]].view(shapes[0] if i < L else shapes[1])
        used[pos:pos + sizes[i]] = True
        pos += sizes[i] + gap
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen, device="cuda"))
    return views[:L], views[L:], buf, ~used


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 2])
@pytest.mark.parametrize("backend, tile", BACKENDS, ids=[f"{b}-tile{t}" for b, t in BACKENDS])
def test_gpu_backends_accumulate_into_scattered_main_grads(backend, tile, split):
    from tests.gpu_cases import gpu_case, oracle, rel_err, TOL

    T, H, I, L, K = 3000, 1024, 512, 6, 4
    case = gpu_case(301 + split, [T], H, I, L, K, "zipf")
    _, _, _, d1_ref, d2_ref = oracle(case)

    def run(ring, with_bufs):
        config = MoKConfig(tile_rows=tile, training_ring_rows=ring, timeout_s=20.0)
        leaf = lambda t: t.detach().clone().requires_grad_()
        x, w, fc1, fc2 = leaf(case.x[0]), leaf(case.weights[0]), case.fc1_all, case.fc2_all
        if split:
            fc1, fc2 = (leaf(fc1[:-split]), leaf(fc1[-split:])), (leaf(fc2[:-split]), leaf(fc2[-split:]))
        else:
            fc1, fc2 = leaf(fc1), leaf(fc2)
        bufs = _scattered(L, ((2 * I, H), (H, I)), 77) if with_bufs else None
        before = [t.clone() for t in bufs[0] + bufs[1]] if bufs else None
        y = mok_moe(x, case.ids[0], w, fc1, fc2, config=config, backend=backend,
                    main_grads=(bufs[0], bufs[1]) if bufs else None)
        y.backward(case.dy[0])
        torch.cuda.synchronize()
        return y.detach(), x.grad, w.grad, bufs, before

    plain = run(None, False)
    results = [run(ring, True) for ring in (0, 2 * tile, None)]
    label = f"{backend} tile {tile} split {split}"
    for ring, (y, dx, dw, bufs, before) in zip((0, 2 * tile, None), results):
        assert torch.equal(y, plain[0]) and torch.equal(dx, plain[1]) and torch.equal(dw, plain[2]), \
            f"{label}, ring {ring}: y / dx / dw differ from the call without main_grads"
        fc1_bufs, fc2_bufs, alloc, gaps = bufs
        assert torch.isnan(alloc[gaps]).all(), f"{label}, ring {ring}: wrote outside the buffers"
        got1 = torch.stack([b - a for b, a in zip(fc1_bufs, before[:L])])
        got2 = torch.stack([b - a for b, a in zip(fc2_bufs, before[L:])])
        for name, got, want in (("d_fc1", got1, d1_ref), ("d_fc2", got2, d2_ref)):
            err = rel_err(got, want)
            assert err < TOL, f"{label}, ring {ring}: {name} added into main_grad, relative error {err:.3e}"
    first = results[0][3]
    for ring, (_, _, _, bufs, _) in zip((2 * tile, None), results[1:]):
        for a, b in zip(first[0] + first[1], bufs[0] + bufs[1]):
            assert torch.equal(a, b), f"{label}: main_grad differs between rings 0 and {ring}"
