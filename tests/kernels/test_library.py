"""The CUDA library: it compiles with nvcc for sm_90a (CI compiles it), loads without a GPU, and
on a GPU its schedule kernel matches the reference schedule bit for bit."""

from __future__ import annotations

import ctypes

import pytest
import torch

from megatron_mok import _build
from megatron_mok.ops import library
from megatron_mok.reference import build_schedule

from tests.cases import make_case


@pytest.fixture(scope="module")
def built_library(tmp_path_factory):
    if _build.find_nvcc() is None:
        pytest.skip("nvcc not found: the CUDA library cannot be compiled on this machine")
    out = tmp_path_factory.mktemp("moklib")
    return _build.build_library(out)


def test_library_compiles_for_sm90a_and_loads(built_library):
    lib = library.MokLibrary(built_library)
    fn = lib.function("mok_schedule_table_rows", ctypes.c_int64, [ctypes.c_int] * 5)
    assert fn(2, 4096, 8, 192, 128) == 2 * 4096 * 8 + 192 * 127
    info = (built_library.parent / _build.BUILD_INFO_NAME).read_text()
    assert "compute_90a" in info and "schedule.cu" in info


def test_error_codes_have_messages(built_library):
    lib = library.MokLibrary(built_library)
    with pytest.raises(library.MokKernelError, match="invalid argument"):
        lib.check(-1, "a call")
    lib.check(0, "a call")  # MOK_OK raises nothing


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    with pytest.raises(_build.BuildError, match="nvcc was not found"):
        _build.build_library(tmp_path)


def test_bad_library_override_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MOK_LIBRARY", str(tmp_path / "nope.so"))
    with pytest.raises(library.LibraryUnavailable, match="does not exist"):
        library.library_path()


# (seed, tokens per virtual rank, experts per rank, top-k, routing, tile)
SCHEDULE_SWEEP = [
    (1, [4096], 192, 8, "uniform", 128),
    (2, [1000], 8, 1, "hot", 128),
    (3, [333, 4096], 96, 8, "zipf", 128),
    (4, [77, 0, 513, 64], 6, 4, "unused", 64),
    (5, [8192, 8192], 3, 8, "duplicates", 128),
    (6, [129, 1], 48, 2, "empty", 64),
    (7, [8192, 8192, 4100], 5, 8, "uniform", 128),  # 387 units, 25 of the scan's chunks of 16 per expert
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SCHEDULE_SWEEP, ids=lambda s: f"seed{s[0]}-{s[4]}-P{len(s[1])}")
def test_schedule_kernel_matches_reference(spec):
    from megatron_mok.ops.schedule import build_schedule_cuda

    seed, tokens, experts, topk, routing, tile = spec
    case = make_case(seed, tokens, 8, 8, experts, topk, routing)
    ids_gpu = [ids.cuda() for ids in case.ids]
    for rank in range(len(tokens)):
        ref = build_schedule(case.ids, rank, experts, tile)
        table, counts, offsets, status = build_schedule_cuda(ids_gpu, rank, experts, tile)
        torch.cuda.synchronize()
        assert int(status[0]) == 0, f"status flags {status.tolist()}"
        assert torch.equal(counts.cpu(), ref.expert_counts)
        assert torch.equal(offsets.cpu(), ref.expert_offsets)
        rows = int(offsets[-1])
        assert torch.equal(table[:rows].cpu(), ref.table), f"table differs for rank {rank}"


@pytest.mark.gpu
def test_schedule_kernel_flags_bad_ids():
    from megatron_mok.ops.schedule import build_schedule_cuda

    ids = torch.tensor([[0, 1], [7, 2], [1, -1]], device="cuda")
    table, counts, offsets, status = build_schedule_cuda([ids], 0, 4, 64)
    torch.cuda.synchronize()
    assert int(status[0]) & 1, "an id >= E must set MOK_STATUS_BAD_EXPERT_ID"
    assert int(status[1]) == 7
    assert counts.tolist() == [1, 2, 1, 0]  # the bad route is left out, the rest placed


@pytest.mark.gpu
def test_schedule_kernel_names_the_rank_that_held_the_bad_id():
    """Every rank's schedule reads every rank's ids: rank 0's records rank 1's bad id, naming the
    source rank (MOK_STATUS_SOURCE) as well as itself (MOK_STATUS_RANK)."""
    from megatron_mok.ops.schedule import build_schedule_cuda

    ids0 = torch.tensor([[0, 1], [2, 3]], device="cuda")
    ids1 = torch.tensor([[1, 0], [-1, 2 ** 40]], device="cuda")  # an id beyond int32 is recorded saturated
    status = build_schedule_cuda([ids0, ids1], 0, 2, 64)[3]
    torch.cuda.synchronize()
    words = status.tolist()
    assert words[0] == 1 and words[1] == 2 ** 31 - 1 and words[4] == 0 and words[6] == 1, words


MOK_STATUS_TIMEOUT, MOK_STATUS_PEER_FAILED = 4, 8


def test_signal_failure_rejects_bad_arguments_before_any_cuda_call(use_lib):
    fn = use_lib.function("mok_signal_failure", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                                ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                                ctypes.c_void_p])
    p = 0x10000  # never dereferenced: the argument checks fail first
    good = dict(signal_bases=p, rank=0, P=2, code=1, failed_rank=0, status=p)
    for over in (dict(signal_bases=None), dict(status=None), dict(P=0), dict(rank=2), dict(rank=-1), dict(code=0),
                 dict(failed_rank=2), dict(P=1025)):
        a = dict(good, **over)
        assert fn(a["signal_bases"], a["rank"], a["P"], a["code"], a["failed_rank"], a["status"], None) == -1, over


def _virtual_workspaces(P, timeout_s):
    from megatron_mok import MoKConfig
    from megatron_mok.functional import LocalEPGroup
    from megatron_mok.functional.workspace import get_workspace

    group = LocalEPGroup(P)
    dev = torch.device("cuda", torch.cuda.current_device())
    config = MoKConfig(max_tokens_per_rank=8, timeout_s=timeout_s)
    return group, [get_workspace(group[r], dev, tokens=8, hidden=256, topk=2, experts_per_rank=2, config=config)
                   for r in range(P)]


@pytest.mark.gpu
def test_barrier_stops_at_a_peers_failure_word():
    """A rank that stops before queueing a call (mok_signal_failure) records it in its own status
    and sets its failure word in the peers' signal arrays; a peer's barrier stops at it at once
    (PEER_FAILED with TIMEOUT, naming the rank and the code) instead of waiting out its timeout;
    later barriers return at once."""
    import gc

    group, ws = _virtual_workspaces(2, timeout_s=30.0)
    ws[1].signal_failure(1, 1)  # MOK_FAILURE_INPUT, rank 1
    with torch.cuda.stream(group.streams[0]):
        ws[0].barrier(1, 30.0)
        ws[0].barrier(2, 30.0)
    torch.cuda.synchronize()
    flags, value, peer, where, rank, failure, source = ws[0].status.tolist()[:7]
    assert (flags, peer, where, rank, failure) == (MOK_STATUS_TIMEOUT | MOK_STATUS_PEER_FAILED, 1, 1, 0, 1)
    flags, _, peer, where, rank, failure, _ = ws[1].status.tolist()[:7]
    assert (flags, peer, where, rank, failure) == (MOK_STATUS_TIMEOUT | MOK_STATUS_PEER_FAILED, 1, 0, 1, 1)
    del ws, group
    gc.collect()


@pytest.mark.gpu
def test_barrier_timeout_sets_the_ranks_failure_word_in_its_peers():
    import gc

    group, ws = _virtual_workspaces(3, timeout_s=0.2)
    with torch.cuda.stream(group.streams[0]):
        ws[0].barrier(2, 0.2)  # ranks 1 and 2 never arrive
    torch.cuda.synchronize()
    flags, _, peer, where, rank = ws[0].status.tolist()[:5]
    assert flags == MOK_STATUS_TIMEOUT and peer in (1, 2) and (where, rank) == (2, 0)
    P, word = 3, (1 << 63) | (5 << 32) | 0  # MOK_FAILURE_WORD(MOK_FAILURE_TIMEOUT, rank 0)
    for r in (1, 2):
        at = ws[r].layout.signals + 8 * (P + 0)
        got = int(ws[r].region[at:at + 8].view(torch.int64)[0]) & (2 ** 64 - 1)
        assert got == word, f"rank {r}: failure word of rank 0 is {got:#x}"
    del ws, group
    gc.collect()


def test_mok_op_calls_eager_plain_tensors_directly_and_fakes_through_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_mok.ops.custom_op import MokOp, mok_op

    direct_calls = []

    @mok_op("mok_test::scale_rows", mutates_args=())
    def scale_rows(x: torch.Tensor, factor: float) -> torch.Tensor:
        direct_calls.append(type(x))
        return x * factor

    @scale_rows.register_fake
    def _(x, factor):
        return torch.empty_like(x)

    assert isinstance(scale_rows, MokOp) and scale_rows.__name__ == "scale_rows"
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(scale_rows(x, 2.0), x * 2)
    assert torch.equal(scale_rows(x=x, factor=3.0), x * 3)
    assert direct_calls == [torch.Tensor, torch.Tensor]
    # Through the dispatcher, as torch.compile sees it: the same numbers.
    assert torch.equal(torch.ops.mok_test.scale_rows(x, 2.0), x * 2)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        out = scale_rows(fake, 2.0)  # a fake tensor goes to the registered fake
    assert out.shape == (2, 3) and type(out) is not torch.Tensor
    assert len(direct_calls) == 3  # only the dispatcher call above ran the implementation


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["kernel", "copy"])
def test_status_reaches_the_pinned_host_copy(mode, monkeypatch):
    # The status word is mirrored to pinned host memory at the end of every call: by a kernel's
    # stores where the memory is mapped (it is on the H200 machines: asserted, so the kernel
    # path cannot go untested), else (unmapped memory, torch.compile) by a copy.
    from megatron_mok import MoKConfig
    from megatron_mok.functional.workspace import get_workspace

    dev = torch.device("cuda", torch.cuda.current_device())
    ws = get_workspace(None, dev, tokens=8, hidden=256, topk=2, experts_per_rank=4, config=MoKConfig(timeout_s=5.0))
    assert ws._status_host_mapped != 0, "pinned memory is not mapped for the device"
    if mode == "copy":  # as where the memory is not mapped
        monkeypatch.setattr(ws, "_status_host_mapped", 0)
    for words in ([0, 7, 1, 2, 3, 0, 0, 0], [0] * 8):
        ws.status_host.fill_(-5)  # poison: every word must be written
        ws.status.copy_(torch.tensor(words, dtype=torch.int32))
        ws.mirror_status()
        torch.cuda.synchronize()
        assert ws.status_host.tolist() == words


def test_mirror_status_rejects_null_pointers(use_lib):
    fn = use_lib.function("mok_mirror_status", ctypes.c_int, [ctypes.c_void_p] * 3)
    assert fn(None, 0x10000, None) == -1 and fn(0x10000, None, None) == -1
