"""The forward megakernel (``megakernel`` backend, docs/megakernel.md) on sm_90 GPUs (skipped
elsewhere): against the fp32 oracle at P = 1, virtual ranks and P = 2; bitwise equal to the
grouped GEMM kernels composed by hand; a hot expert through a ring far smaller than its rows;
bitwise identical across runs and across every tunable (comm SMs, minibatch, ring, pair mode,
group size); weight segments; CUDA graph replay; the timeout; the launch shape; the comm CTA
count a trace records; the training copies of a kept prefix of the layout only.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import time

import pytest
import torch

from megatron_mok import MoKConfig
from megatron_mok.config import MegakernelTunables
from megatron_mok.functional import LocalEPGroup, MoKTimeoutError, check_errors, mok_moe
from megatron_mok.functional import backends, megakernel_backend as mkb
from megatron_mok.functional.backend import CallSpec
from megatron_mok.functional.validate import MoEShape
from megatron_mok.ops import megakernel as mk

from tests.distributed import run_ranks


def _leaves(case, rank):
    from tests.gpu_cases import leaves

    return leaves(case, rank)


def _run(case, ep_groups, config, streams=None, backward=True, split=0):
    """Forward (and backward) of every rank with the megakernel (see gpu_cases.run_case)."""
    from tests.gpu_cases import run_case

    # A wait that never ends shows up as a MoKTimeoutError naming the site after 20 s.
    config = dataclasses.replace(config, timeout_s=min(config.timeout_s, 20.0))
    return run_case(case, ep_groups, config, "megakernel", streams, backward, split)


def _poison_workspaces_and_rings():
    """NaN into every combine slot and every ring buffer: a slot or ring row the kernel reads
    without having written it in this call shows up as NaN."""
    from megatron_mok.functional.workspace import _every_workspace

    for ws in list(_every_workspace):
        ws.slots.fill_(float("nan"))
        state = mkb._state.get(ws)
        for ring in (state.rings.values() if state is not None else ()):
            ring.x.fill_(float("nan"))
            ring.h.fill_(float("nan"))
            ring.w.fill_(float("nan"))


def _check_against_oracle(case, results, label, with_grads=True):
    from tests.gpu_cases import check_against_oracle

    check_against_oracle(case, results, label, with_grads)


def _assert_equal_runs(a, b, label):
    from tests.gpu_cases import assert_equal_runs

    assert_equal_runs(a, b, label)


# (seed, tokens per rank, H, I, experts per rank, top-k, routing, config)
SMALL_RING = MoKConfig(minibatch_rows=128, ring_rows=256)
SWEEP_P1 = [
    (1, [1], 1024, 512, 1, 1, "uniform", MoKConfig()),
    (2, [1000], 2048, 1024, 8, 2, "uniform", MoKConfig()),
    (3, [4096], 7168, 2048, 32, 8, "uniform", MoKConfig()),
    (4, [8192], 4096, 1536, 16, 8, "zipf", MoKConfig()),
    (5, [3001], 2048, 768, 12, 4, "hot", SMALL_RING),
    (6, [777], 1024, 512, 24, 6, "empty", MoKConfig(comm_sms_forward=4, minibatch_rows=256, ring_rows=512)),
    (7, [513], 1024, 256, 192, 8, "uniform", MoKConfig()),
    (8, [640], 1024, 512, 8, 3, "unused", SMALL_RING),
    (9, [2048], 7168, 2048, 6, 8, "duplicates", MoKConfig(comm_sms_forward=16)),
    # Top-k above 32 (the slot sum's mask takes two words) with unused slots, and rows of 64
    # vectors (a quarter row is 16: half the lanes of a summing warp idle).
    (10, [300], 512, 256, 48, 40, "unused", SMALL_RING),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SWEEP_P1, ids=lambda s: f"T{s[1][0]}-H{s[2]}-L{s[4]}-k{s[5]}-{s[6]}")
def test_megakernel_p1_matches_oracle(spec):
    from tests.gpu_cases import gpu_case

    seed, tokens, H, I, L, K, routing, config = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    first = _run(case, [None], config)
    _poison_workspaces_and_rings()
    second = _run(case, [None], config)
    _check_against_oracle(case, second, f"P=1 {spec[:7]}")
    _assert_equal_runs(first, second, f"two runs of {spec[:7]}")


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "hot", "unused"])
def test_megakernel_forward_is_bitwise_the_grouped_gemm_kernels_composed(routing):
    """P = 1: pull by gather, MoK's fc1 + SwiGLU and fc2 kernels (direct-store variants, the
    epilogues the megakernel runs), then the fixed-order slot sum in fp32: the same bits."""
    from megatron_mok.ops import grouped_gemm as gg
    from megatron_mok.ops.schedule import build_schedule_cuda

    from tests.gpu_cases import gpu_case

    T, H, I, L, K = 2500, 2048, 1024, 8, 4
    case = gpu_case(101, [T], H, I, L, K, routing)
    x, ids, w = case.x[0], case.ids[0], case.weights[0]
    fc1, fc2 = case.fc1_all, case.fc2_all
    with torch.no_grad():
        y = mok_moe(x, ids, w, fc1, fc2, config=SMALL_RING, backend="megakernel")
    table, counts, offsets, _ = build_schedule_cuda([ids], 0, L, 128)
    R = int(offsets[-1])
    src, route = table[:R, 0].long(), table[:R, 1].long()
    real = src >= 0
    x_disp = torch.where(real[:, None], x[(route // K).clamp(min=0)], torch.zeros((), dtype=x.dtype, device=x.device))
    w_disp = torch.where(real, w.reshape(-1)[route.clamp(min=0)], torch.zeros((), device=x.device))
    h = torch.empty(R, I, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(R, H, dtype=torch.bfloat16, device=x.device)
    direct = gg.Variant(128, 256, False, False)
    gg.launch_fc1_swiglu(x_disp.contiguous(), fc1, offsets, counts, w_disp.contiguous(), h, None, variant=direct)
    gg.launch_fc2(h, fc2, offsets, out, variant=direct)
    row_of = torch.full((T * K,), -1, dtype=torch.long, device=x.device)
    row_of[route[real]] = torch.nonzero(real).reshape(-1)
    acc = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for j in range(K):
        r = row_of.view(T, K)[:, j]
        valid = (ids[:, j] >= 0) & (r >= 0)
        acc = torch.where(valid[:, None], acc + out[r.clamp(min=0)].float(), acc)
    assert torch.equal(y, acc.bfloat16()), "the megakernel's forward differs from the composed kernels"


def _comm_ctas_of(launch):
    """The CTAs of a traced launch whose own record says they took the comm role."""
    records = launch["records"].cpu().numpy()
    meta = records[:, mk.TRACE_FIELDS.index("meta")]
    ctas = (records[:, mk.TRACE_FIELDS.index("take")] > 0) & ((meta & 0xFF) == mk.constants().trace_cta_kind)
    return int(((meta[ctas] >> 8) & 0xFF).sum())


@pytest.mark.gpu
def test_forward_without_grad_launches_two_comm_ctas_fewer():
    """4 comm CTAs without grad, 6 with (the trace's CTA records say which CTAs took the comm
    role); the same bits either way; the trace records the launch's tunables."""
    from tests.gpu_cases import gpu_case

    case = gpu_case(21, [2048], 1024, 512, 64, 8, "uniform")
    x, ids, w = case.x[0], case.ids[0], case.weights[0]
    with mkb.trace_launches() as launches:
        with torch.no_grad():
            y_no_grad = mok_moe(x, ids, w, case.fc1_all, case.fc2_all, config=MoKConfig(), backend="megakernel")
        y_grad = mok_moe(x.clone().requires_grad_(True), ids, w, case.fc1_all, case.fc2_all, config=MoKConfig(),
                         backend="megakernel")
        with torch.no_grad():
            mok_moe(x, ids, w, case.fc1_all, case.fc2_all, backend="megakernel",
                    config=MoKConfig(comm_sms_forward=10, megakernel=MegakernelTunables(pairs=False, group_blocks=16)))
    torch.cuda.synchronize()
    assert len(launches) == 3
    assert [(_comm_ctas_of(launch), launch["comm_ctas"]) for launch in launches] == [(4, 4), (6, 6), (10, 10)]
    assert [(launch["pairs"], launch["group_blocks"]) for launch in launches] == [(True, 8), (True, 8), (False, 16)]
    assert torch.equal(y_no_grad, y_grad.detach())
    with torch.no_grad():  # outside the block: not traced
        mok_moe(x, ids, w, case.fc1_all, case.fc2_all, config=MoKConfig(), backend="megakernel")
    assert len(launches) == 3


def _bits(t):
    """The bits of a bf16 or fp32 tensor as integers: bitwise comparisons that NaN cannot fool."""
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


_POISON = 0x7F  # every byte of a poisoned buffer: bf16 0x7f7f and fp32 0x7f7f7f7f, both finite


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    SMALL_RING,
    MoKConfig(comm_sms_forward=4, minibatch_rows=256, ring_rows=512, megakernel=MegakernelTunables(pairs=False)),
], ids=["small-ring", "single-ctas"])
def test_forward_saves_only_the_kept_prefix_of_the_layout(monkeypatch, config):
    """The training copies of the first N layout rows (MokMegakernelArgs::save_rows): the
    backend's training launch is run again through the op with copies of every row (R_cap, not
    a multiple of 128), then of N = 0, 2 blocks, expert 0's blocks and one more, and the whole
    layout, each N rows a view into a poisoned buffer with spare rows after it. y is bitwise the
    same every time; the kept rows are bitwise the full copies' first rows (the backend's own
    copies too); every byte at or past N is still poison (no pulled row, padding zero or gate |
    up written past the prefix)."""
    from megatron_mok.functional import check_errors

    from tests.gpu_cases import gpu_case

    case = gpu_case(171, [3000], 1024, 512, 6, 4, "zipf")
    calls = []
    real_launch = mk.launch_forward
    signature = inspect.signature(real_launch)

    def recording_launch(*a, **kw):
        calls.append(signature.bind(*a, **kw))
        return real_launch(*a, **kw)

    monkeypatch.setattr(mk, "launch_forward", recording_launch)
    x, w, fc1, fc2 = _leaves(case, 0)
    y = mok_moe(x, case.ids[0], w, fc1, fc2, config=config, backend="megakernel").detach()
    torch.cuda.synchronize()
    check_errors()
    monkeypatch.undo()
    assert len(calls) == 1, "one forward launch"
    calls[0].apply_defaults()
    args = dict(calls[0].arguments)
    backend_saves = (args["save_x"], args["save_w"], args["save_gu"])
    assert all(t is not None for t in backend_saves), "a forward with grad keeps training copies"

    table, offsets = args["table"], args["offsets"]
    R_cap, end = table.shape[0], int(offsets[-1])
    H, two_i = args["fc1_weight"].shape[2], args["fc1_weight"].shape[1]
    block = mk.constants().block_rows
    assert end % block == 0 and end <= R_cap
    blocks = end // block
    first_expert_blocks = int(offsets[1]) // block
    assert 3 <= first_expert_blocks < blocks, "zipf routing: expert 0 takes several blocks, not all"
    keeps = sorted({0, 2 * block, (first_expert_blocks + 1) * block, blocks * block})
    dev = y.device

    def saves(rows):
        return (torch.empty(rows, H, dtype=torch.bfloat16, device=dev), torch.empty(rows, device=dev),
                torch.empty(rows, two_i, dtype=torch.bfloat16, device=dev))

    def launch(copies):
        # The backend's launch again (the published rows and the schedule are unchanged), through
        # the op and its argument checks, with other training copies.
        out = mk.megakernel_forward(**dict(args, save_x=copies[0], save_w=copies[1], save_gu=copies[2]))
        torch.cuda.synchronize()
        check_errors()
        return out

    names = ("save_x", "save_w", "save_gu")
    full = saves(R_cap)
    assert torch.equal(_bits(launch(full)), _bits(y)), "y differs with every row kept"
    kept_by_backend = min(backend_saves[0].shape[0] // block * block, end)
    for name, got, want in zip(names, backend_saves, full):
        assert torch.equal(_bits(got[:kept_by_backend]), _bits(want[:kept_by_backend])), \
            f"{name}: the backend's kept rows differ from the full copy's"

    spare = 2 * block  # poisoned rows after the largest prefix: a write past N lands there
    for n in keeps:
        buffers = saves(R_cap + spare)
        for t in buffers:
            t.view(torch.uint8).fill_(_POISON)
        y_n = launch(tuple(t[:n] for t in buffers))
        assert torch.equal(_bits(y_n), _bits(y)), f"y differs with save_rows = {n}"
        for name, buf, want in zip(names, buffers, full):
            assert torch.equal(_bits(buf[:n]), _bits(want[:n])), f"{name}: the kept rows differ at save_rows = {n}"
            assert buf[n:].view(torch.uint8).eq(_POISON).all(), f"{name}: written at or past save_rows = {n}"


SWEEP_VIRTUAL = [
    (11, [3000, 1234], 2048, 1024, 4, 4, "uniform", MoKConfig()),
    (12, [4096, 4096], 7168, 2048, 6, 8, "zipf", MoKConfig()),
    (13, [1, 700], 1024, 512, 3, 2, "hot", SMALL_RING),
    (14, [513, 0, 999, 64], 1024, 512, 6, 8, "empty", MoKConfig(comm_sms_forward=2, minibatch_rows=256, ring_rows=512)),
    (15, [300, 301, 302, 303], 1024, 256, 2, 1, "uniform", MoKConfig()),
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SWEEP_VIRTUAL, ids=lambda s: f"P{len(s[1])}-H{s[2]}-L{s[4]}-k{s[5]}-{s[6]}")
def test_megakernel_virtual_ranks_match_oracle(spec):
    from tests.gpu_cases import gpu_case

    seed, tokens, H, I, L, K, routing, config = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    group = LocalEPGroup(len(tokens))
    config = dataclasses.replace(config, max_tokens_per_rank=max(max(tokens), 1), timeout_s=20.0)
    first = _run(case, group.ranks, config, group.streams)
    _poison_workspaces_and_rings()
    second = _run(case, group.ranks, config, group.streams)
    _check_against_oracle(case, second, f"virtual {spec[:7]}")
    _assert_equal_runs(first, second, f"two runs of {spec[:7]}")


def _all_to_expert_zero(case):
    """Every token of every rank sends its slot 0 to expert 0 (rank 0's first expert)."""
    for ids in case.ids:
        ids[:, 0] = 0
        if ids.shape[1] > 1:  # keep the slots distinct per token
            ids[:, 1:] = torch.where(ids[:, 1:] == 0, torch.ones_like(ids[:, 1:]), ids[:, 1:])
    return case


@pytest.mark.gpu
def test_megakernel_one_hot_expert_through_a_small_ring():
    from tests.gpu_cases import gpu_case

    # 3000 rows to expert 0 (24 row blocks) through a ring of 2 slots; then the same on 2 virtual ranks.
    case = _all_to_expert_zero(gpu_case(121, [3000], 1024, 512, 4, 2, "uniform"))
    _check_against_oracle(case, _run(case, [None], SMALL_RING), "hot expert, P=1")
    case2 = _all_to_expert_zero(gpu_case(122, [2000, 2000], 1024, 512, 2, 2, "uniform"))
    group = LocalEPGroup(2)
    config = MoKConfig(max_tokens_per_rank=2000, timeout_s=20.0, comm_sms_forward=2, minibatch_rows=128, ring_rows=256)
    _check_against_oracle(case2, _run(case2, group.ranks, config, group.streams), "hot expert, 2 virtual ranks")


@pytest.mark.gpu
def test_megakernel_runs_in_clusters_of_two_on_every_sm():
    """Pair mode, when asked for, keeps every SM of an H100/H200 (every CTA in a cluster of two);
    not with an odd comm CTA count or grid; single CTAs when not asked for."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mk.launch_shape(10, 0, pairs=True) == (sms, True)
    assert mk.launch_shape(10) == (sms, mk.default_tunables()["pairs"])
    assert mk.launch_shape(10, 0, pairs=False) == (sms, False)
    assert mk.launch_shape(2, 64, pairs=True) == (64, True)
    assert mk.launch_shape(3, 0, pairs=True) == (sms, False)
    assert mk.launch_shape(10, 65, pairs=True) == (65, False)
    with pytest.raises(mk.MegakernelArgumentError):
        mk.launch_shape(10, 10)  # no CTA left to compute


SETTINGS = [(2, 128, 256), (2, 256, 1024), (4, 512, 1024), (3, 384, 1536), (None, None, None)]
TUNABLES = [MegakernelTunables(pairs=False), MegakernelTunables(group_blocks=16),
            MegakernelTunables(pairs=False, group_blocks=2), MegakernelTunables(group_blocks=64)]


@pytest.mark.gpu
@pytest.mark.parametrize("virtual", [False, True], ids=["P1", "P2-virtual"])
def test_megakernel_is_bitwise_identical_across_settings(virtual):
    """Comm SMs, minibatch and ring (odd comm CTA counts run single CTAs), then pair mode off and
    other group sizes at one setting: the same bits as the defaults'."""
    from tests.gpu_cases import gpu_case

    tokens = [2500, 1800] if virtual else [3000]
    case = gpu_case(131, tokens, 2048, 1024, 6, 4, "zipf")
    group = LocalEPGroup(len(tokens)) if virtual else None
    groups, streams = (group.ranks, group.streams) if virtual else ([None], None)
    runs = []
    for comm, mb, ring in SETTINGS:
        config = MoKConfig(comm_sms_forward=comm, minibatch_rows=mb, ring_rows=ring, timeout_s=20.0,
                           max_tokens_per_rank=max(tokens))
        runs.append((f"comm {comm}, minibatch {mb}, ring {ring}", _run(case, groups, config, streams)))
    for tunables in TUNABLES:
        config = MoKConfig(comm_sms_forward=4, minibatch_rows=256, ring_rows=512, timeout_s=20.0,
                           max_tokens_per_rank=max(tokens), megakernel=tunables)
        runs.append((f"{tunables}", _run(case, groups, config, streams)))
    (label0, first), rest = runs[0], runs[1:]
    _check_against_oracle(case, first, label0)
    for label, res in rest:
        _assert_equal_runs(first, res, f"{label0} vs {label}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["megakernel", "cuda"])
@pytest.mark.parametrize("virtual,split", [(False, 1), (False, 5), (True, 2)], ids=["P1-last", "P1-five", "P2-two"])
def test_weight_segments_are_bitwise_the_stacked_weights(backend, virtual, split):
    """Weights passed as two segments (the last experts in tensors of their own, as the fused
    shared expert is): the megakernel's second pair of weight maps and the cuda backend's
    launches per segment give the same bits as the stacked weights, gradients included."""
    from tests.gpu_cases import gpu_case, run_case

    tokens = [2500, 1800] if virtual else [3000]
    case = gpu_case(161, tokens, 2048, 1024, 6, 4, "zipf")
    group = LocalEPGroup(len(tokens)) if virtual else None
    groups = group.ranks if virtual else [None]
    streams = group.streams if virtual else None
    config = MoKConfig(minibatch_rows=256, ring_rows=1024, timeout_s=20.0, max_tokens_per_rank=max(tokens))
    stacked = run_case(case, groups, config, backend, streams)
    _poison_workspaces_and_rings()
    segmented = run_case(case, groups, config, backend, streams, split=split)
    _check_against_oracle(case, segmented, f"{backend} segments, split {split}")
    _assert_equal_runs(stacked, segmented, f"{backend}: stacked vs two segments (split {split})")


@pytest.mark.gpu
def test_megakernel_cuda_graph_replays_with_new_inputs():
    from tests.gpu_cases import check_graph_replay

    check_graph_replay("megakernel", MoKConfig(minibatch_rows=256, ring_rows=512), seeds=(141, 142, 143))


@pytest.mark.gpu
def test_megakernel_timeout_names_the_missing_rank_and_returns_nan():
    from tests.gpu_cases import gpu_case

    group = LocalEPGroup(2)
    case = gpu_case(151, [256, 256], 1024, 512, 2, 2)
    config = MoKConfig(max_tokens_per_rank=256, timeout_s=1.0)
    x, w, fc1, fc2 = _leaves(case, 0)
    start = time.monotonic()
    with torch.cuda.stream(group.streams[0]):  # rank 1 never makes the call
        y = mok_moe(x, case.ids[0], w, fc1, fc2, ep_group=group[0], config=config, backend="megakernel")
    with pytest.raises(MoKTimeoutError, match=r"EP rank 0 waited more than 1 s for EP rank 1"):
        check_errors()
    assert time.monotonic() - start < 1.0 + 10, "the timeout took too long to surface"
    assert torch.isnan(y.float()).all(), "a call that timed out must not return numbers"
    del y, group
    gc.collect()


@pytest.mark.gpu
def test_auto_picks_the_megakernel_on_this_gpu():
    def spec(shape, config):
        return CallSpec(shape=shape, config=config, ep_group=None, ep_size=1, device=torch.device("cuda", 0),
                        dtype=torch.bfloat16)
    for shape in (MoEShape(4096, 1024, 2, 4, 512), MoEShape(8, 1024, 2, 4, 512)):
        assert backends.select_backend("auto", spec(shape, MoKConfig())).name == "megakernel"
    assert backends.select_backend("auto", spec(MoEShape(8, 1024, 2, 4, 512), MoKConfig(tile_rows=64))).name == "cuda"


# ------------------------------------------------------------------------------------------
# Two processes on two GPUs: the real peer-memory path.

SWEEP_P2 = [
    (161, [4096, 4096], 7168, 2048, 6, 8, "uniform"),
    (162, [3000, 1234], 2048, 1024, 16, 4, "zipf"),
    (163, [777, 1], 1024, 512, 3, 1, "hot"),
    (164, [512, 513], 1024, 512, 12, 8, "empty"),
]
P2_SETTINGS = [MoKConfig(), MoKConfig(comm_sms_forward=2, minibatch_rows=128, ring_rows=256),
               MoKConfig(comm_sms_forward=12, minibatch_rows=512, ring_rows=1536),
               MoKConfig(megakernel=MegakernelTunables(pairs=False, group_blocks=16)),
               MoKConfig(comm_sms_forward=2, minibatch_rows=128, ring_rows=256,
                         megakernel=MegakernelTunables(group_blocks=2))]


def _p2_worker(rank, world, specs):
    import torch.distributed as dist

    from tests.gpu_cases import check_rank_runs, gpu_case

    group = dist.group.WORLD
    for spec in specs:
        seed, tokens, H, I, L, K, routing = spec
        case = gpu_case(seed, tokens, H, I, L, K, routing)
        leaves = _leaves(case, rank)
        runs = []
        for config in P2_SETTINGS:
            config = dataclasses.replace(config, max_tokens_per_rank=4096, timeout_s=20.0)
            x, w, fc1, fc2 = (t.detach().clone().requires_grad_() for t in leaves)
            y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=group, config=config, backend="megakernel")
            y.backward(case.dy[rank])
            torch.cuda.synchronize()
            check_errors()
            runs.append((y.detach(), x.grad, w.grad, fc1.grad, fc2.grad))
        check_rank_runs(case, rank, runs, f"P=2 {spec}")


@pytest.mark.gpu2
def test_megakernel_two_gpus_match_oracle_and_are_bitwise_stable():
    run_ranks(_p2_worker, 2, SWEEP_P2, backend="nccl")
