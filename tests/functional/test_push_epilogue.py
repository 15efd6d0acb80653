"""The GPU backends' unfused training path with the row GEMMs pushing their rows home from the
epilogue (fc2 in the ``cuda`` forward, the fc1 data gradient and the router-weight gradient in
both backends' backward; ``functional/training.py``), against the same path with the GEMM
writing [n, H] and the push kernel copying the rows home (what ran before, put back by
monkeypatching ``training._push_rows_from_gemm``): every output and gradient bitwise equal, on
P = 1 and virtual ranks P = 2, 4, with chunks (small training rings replay rows), weight
segments, empty experts and dropped slots. The fused launches are counted, so the comparison
cannot pass with both runs unfused. GPU only (skipped with the reason on the CPU).
"""

from __future__ import annotations

import gc

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.functional import training
from megatron_mok.functional.expert_ffn import plain_gemm_segments
from megatron_mok.ops import comm as comm_ops
from megatron_mok.ops import grouped_gemm as gg

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _collect_groups():
    yield
    gc.collect()


def _gemm_then_push(ws, call, fc2, a, weights, offsets, counts, table, row_scalars=None):
    """The path before the fused push: the GEMM into [n, H] rows, then the push kernel."""
    K = ws.layout.topk
    if fc2:
        rows = plain_gemm_segments(call, a, weights, offsets, counts, weights[0].shape[1], gg.check_fc2,
                                   gg.launch_fc2)
        comm_ops.push_rows(ws.bases, ws.layout.slots, 0, table, offsets, K, rows, None, 0)
    else:
        rows = plain_gemm_segments(call, a, weights, offsets, counts, weights[0].shape[2], gg.check_fc1_dgrad,
                                   gg.launch_fc1_dgrad)
        comm_ops.push_rows(ws.bases, ws.layout.slots, ws.layout.scalars, table, offsets, K, rows, row_scalars, 0)


def _group(P: int):
    from megatron_mok.functional import LocalEPGroup

    if P == 1:
        return [None], None, None
    group = LocalEPGroup(P)
    return group.ranks, group.streams, group


# (seed, tokens per rank, H, I, experts per rank, top-k, routing, weight split)
CASES = [
    (301, [1500], 1024, 512, 12, 4, "empty", 0),
    (302, [1200], 1024, 512, 6, 2, "unused", 2),
    (303, [1100, 700], 1024, 512, 4, 4, "zipf", 1),
    (304, [600, 0, 900, 333], 1024, 512, 3, 8, "hot", 0),
]
BACKENDS = [("cuda", 128), ("cuda", 64), ("megakernel", 128)]


def _case_id(c):
    seed, tokens, H, I, L, K, routing, split = c
    return f"P{len(tokens)}-L{L}-k{K}-{routing}" + (f"-split{split}" if split else "")


@pytest.mark.parametrize("spec", CASES, ids=_case_id)
@pytest.mark.parametrize("backend, tile", BACKENDS, ids=[f"{b}-tile{t}" for b, t in BACKENDS])
@pytest.mark.parametrize("ring", [0, None], ids=["ring0", "default-ring"])
def test_fused_push_is_bitwise_the_gemm_then_push_path(backend, tile, ring, spec, monkeypatch):
    from tests.gpu_cases import assert_equal_runs, check_against_oracle, gpu_case, run_case

    seed, tokens, H, I, L, K, routing, split = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    config = MoKConfig(tile_rows=tile, training_ring_rows=ring, max_tokens_per_rank=max(tokens), timeout_s=20.0)
    groups, streams, group = _group(len(tokens))

    fused_calls = {"fc2": 0, "dgrad": 0}
    fc2_op, dgrad_op = gg.gemm_fc2_push_op, gg.gemm_fc1_dgrad_push_op

    def count_fc2(*args):
        fused_calls["fc2"] += 1
        return fc2_op(*args)

    def count_dgrad(*args):
        fused_calls["dgrad"] += 1
        return dgrad_op(*args)

    monkeypatch.setattr(gg, "gemm_fc2_push_op", count_fc2)
    monkeypatch.setattr(gg, "gemm_fc1_dgrad_push_op", count_dgrad)
    fused = run_case(case, groups, config, backend, streams, split=split)
    assert fused_calls["dgrad"] > 0, "the backward did not run the fused fc1 data gradient"
    assert (fused_calls["fc2"] > 0) == (backend == "cuda"), fused_calls  # the megakernel pushes in its own launch
    check_against_oracle(case, fused, f"{backend} tile {tile} ring {ring}, fused push, {_case_id(spec)}")

    monkeypatch.setattr(training, "_push_rows_from_gemm", _gemm_then_push)
    before = dict(fused_calls)
    unfused = run_case(case, groups, config, backend, streams, split=split)
    assert fused_calls == before, "the unfused run reached a fused kernel"
    assert_equal_runs(fused, unfused, f"{backend} tile {tile} ring {ring}: fused push vs GEMM then push")
    del group
