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
