"""The forward dispatch prologue (``mok::dispatch_prologue``): its C argument layout and checks
without a GPU; on a GPU, that one call publishes every rank's tokens, ids and router weights
(tokens 16-byte aligned or not), meets the other ranks and builds the same schedule as the
reference, for P = 1 and for virtual ranks (one of them with no tokens)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.ops import prologue as prologue_ops
from megatron_mok.reference import build_schedule

from tests.c_abi import struct_fields
from tests.cases import make_case

MOK_ERR_INVALID_ARGUMENT = -1


def test_args_struct_matches_the_header(use_lib):
    names = struct_fields("prologue.h", "MokPrologueArgs")
    assert names == [f[0] for f in prologue_ops.PrologueArgs._fields_]
    assert prologue_ops.args_bytes() == ctypes.sizeof(prologue_ops.PrologueArgs) == 8 * len(names)


@pytest.mark.parametrize("P,T,K,L", [(1, 300, 4, 6), (2, 257, 8, 48), (1, 5, 1, 1), (3, 129, 2, 7)])
def test_schedule_outputs_share_one_allocation_each_part_16_byte_aligned(use_lib, P, T, K, L):
    # Workspace._schedule_outputs carves the table, counts and offsets out of one buffer; each
    # part must start on a 16-byte boundary (the table's int2 reads need 8) and none overlap.
    from types import SimpleNamespace

    from megatron_mok.functional.workspace import Workspace

    fake = SimpleNamespace(experts_per_rank=L, P=P, device=torch.device("cpu"), _table_rows={},
                           layout=SimpleNamespace(max_tokens=T, topk=K))
    table, counts, offsets, capacity = Workspace._schedule_outputs(fake, 128)
    assert capacity == P * T * K + L * 127 and table.shape == (capacity, 2)
    assert counts.shape == (L,) and offsets.shape == (L + 1,)
    spans = []
    for t in (table, counts, offsets):
        assert t.is_contiguous() and t.dtype == torch.int32 and t.data_ptr() % 16 == 0
        spans.append((t.data_ptr(), t.data_ptr() + 4 * t.numel()))
    assert table.untyped_storage().data_ptr() == counts.untyped_storage().data_ptr() == \
        offsets.untyped_storage().data_ptr()
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def _valid_args(**over):
    p = 0x10000  # never dereferenced: the argument checks fail before any CUDA call
    a = dict(x=p, topk_ids=p, topk_weights=p, T=64, H=1024, K=2, region=p, rows_offset=4096, ids_offset=256,
             scalars_offset=2048, ntok_offset=16, signal_bases=p, counter=p, timeout_ns=10 ** 9, site=1, status=p,
             ids_ptrs=p, ntok_ptrs=p, P=2, rank=0, max_tokens=64, L=4, tile_rows=128, table=p, counts=p,
             offsets=p, scratch=p)
    a.update(over)
    return prologue_ops.PrologueArgs(**a)


@pytest.mark.parametrize("over", [
    dict(region=0), dict(T=65), dict(T=-1), dict(H=0), dict(K=0), dict(x=0), dict(topk_ids=0),
    dict(topk_weights=0), dict(ntok_offset=18), dict(ids_offset=260), dict(rows_offset=-4), dict(P=0),
    dict(rank=2), dict(signal_bases=0), dict(counter=0), dict(timeout_ns=0), dict(ids_ptrs=0), dict(table=0),
    dict(counts=0), dict(offsets=0), dict(scratch=0), dict(L=0), dict(L=20000), dict(tile_rows=0),
    dict(max_tokens=2 ** 31, T=0),
])
def test_c_abi_rejects_bad_arguments_before_any_cuda_call(use_lib, over):
    fn = use_lib.function("mok_dispatch_prologue", ctypes.c_int,
                          [ctypes.POINTER(prologue_ops.PrologueArgs), ctypes.c_void_p])
    assert fn(ctypes.byref(_valid_args(**over)), None) == MOK_ERR_INVALID_ARGUMENT


@pytest.mark.gpu
@pytest.mark.parametrize("x_offset", [0, 1], ids=["x-aligned", "x-off-16B"])
@pytest.mark.parametrize("tokens,routing", [([300], "uniform"), ([257, 0], "hot"), ([129, 200, 64], "empty")],
                         ids=["P1", "P2-one-empty", "P3"])
def test_dispatch_publishes_and_builds_the_reference_schedule(tokens, routing, x_offset):
    # x_offset 1: x starts 2 bytes past a 16-byte boundary, so the copy engine publishes it
    # instead of the publish kernel's 16-byte vectors.
    from megatron_mok.functional import LocalEPGroup
    from megatron_mok.functional.workspace import get_workspace

    P, H, L, K = len(tokens), 256, 6, 4
    case = make_case(11, tokens, H, 8, L, K, routing)
    config = MoKConfig(max_tokens_per_rank=max(tokens), timeout_s=20.0)
    group = LocalEPGroup(P) if P > 1 else None
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for r in range(P):  # queued rank by rank on the ranks' streams; they meet on the device
        ep = group[r] if group is not None else None
        ws = get_workspace(ep, dev, tokens=tokens[r], hidden=H, topk=K, experts_per_rank=L, config=config)
        for buf, bad in ((ws.rows, float("nan")), (ws.ids, -7), (ws.scalars, float("nan")), (ws.ntok, -1)):
            buf.fill_(bad)  # poison: every published value must be written
        x_host = case.x[r].to(torch.bfloat16)
        x = torch.empty(x_host.numel() + x_offset, dtype=torch.bfloat16, device=dev)[x_offset:].view(x_host.shape)
        x.copy_(x_host)
        assert x.numel() == 0 or (x.data_ptr() % 16 == 0) == (x_offset == 0)
        ids, w = case.ids[r].to(dev), case.weights[r].to(dev, torch.float32)
        stream = group.streams[r] if group is not None else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            results.append((ws, x, ids, w, ws.dispatch(x, ids, w, 1, config.timeout_s, 128)))
    torch.cuda.synchronize()
    for r, (ws, x, ids, w, (table, counts, offsets, capacity)) in enumerate(results):
        T = tokens[r]
        assert int(ws.status[0]) == 0, f"rank {r}: status {ws.status.tolist()}"
        assert int(ws.ntok[0]) == T
        assert torch.equal(ws.rows[:T], x) and torch.equal(ws.ids[:T], ids) and torch.equal(ws.scalars[:T], w)
        ref = build_schedule(case.ids, r, L, 128)
        assert torch.equal(counts.cpu(), ref.expert_counts)
        assert torch.equal(offsets.cpu(), ref.expert_offsets)
        assert torch.equal(table[:int(offsets[-1])].cpu(), ref.table), f"rank {r}: table differs"
        assert table.shape == (capacity, 2)
