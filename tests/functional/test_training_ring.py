"""The training ring (``MoKConfig.training_ring_rows``): a forward with grad keeps the activations
of the first N = min(ring, R_cap) rows of the expert-grouped layout; the backward walks the layout
in chunks and replays the rows past N. Nothing may depend on the ring:

* CPU: the setting's validation, its default and the chunk size by their documented rules, the
  reference backend taking it, and the chunk helpers of ``megatron_mok.functional.training``
  (``chunk_plan``, ``chunk_layout``; ``-k "chunk_plan or chunk_layout"`` runs just those);
* GPU (``cuda`` with 64- and 128-row tiles, ``megakernel``; P = 1 and virtual ranks P = 2, 4):
  outputs and every gradient bitwise identical for any ring and across runs, within the fp32
  oracle's tolerance, over uniform, skewed, one-hot-expert, empty-expert and dropped-slot
  routings, top-k 1 to 8 and uneven tokens per rank; a backward replays its own call's rows after
  later calls rewrote the shared workspace; CUDA graph replay with a small ring; memory with one
  hot expert bounded by uniform routing's.

R_cap = P*T*K + L*(tile_rows - 1) is the worst-case row count of a rank's layout
(``megatron_mok/functional/workspace.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch

from megatron_mok import MoKConfig, MoKConfigError
from megatron_mok.config import (MIN_TRAINING_CHUNK_ROWS, default_training_ring_rows, training_chunk_rows,
                                 training_ring_bytes)
from megatron_mok.functional import mok_moe

from tests.cases import make_case


def r_cap(P: int, max_tokens: int, K: int, L: int, tile_rows: int) -> int:
    """Worst-case rows of one rank's expert-grouped layout."""
    return P * max_tokens * K + L * (tile_rows - 1)


# ------------------------------------------------------------------------------------------
# The setting and its default (CPU).

@pytest.mark.parametrize("kwargs, message", [
    (dict(training_ring_rows=-128), r"MoKConfig\.training_ring_rows=-128 must be None .* >= 0"),
    (dict(training_ring_rows=-1), r"MoKConfig\.training_ring_rows=-1 "),
    (dict(training_ring_rows=100), r"MoKConfig\.training_ring_rows=100 must be a multiple of tile_rows=128"),
    (dict(training_ring_rows=64), r"MoKConfig\.training_ring_rows=64 must be a multiple of tile_rows=128"),
    (dict(tile_rows=64, training_ring_rows=96), r"MoKConfig\.training_ring_rows=96 .* tile_rows=64"),
    (dict(training_ring_rows=True), r"MoKConfig\.training_ring_rows=True "),
    (dict(training_ring_rows=False), r"MoKConfig\.training_ring_rows=False "),
    (dict(training_ring_rows=256.0), r"MoKConfig\.training_ring_rows=256\.0 "),
    (dict(training_ring_rows="256"), r"MoKConfig\.training_ring_rows='256' "),
])
def test_bad_training_ring_rows_are_clear_errors(kwargs, message):
    with pytest.raises(MoKConfigError, match=message):
        MoKConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(training_ring_rows=0), dict(training_ring_rows=128), dict(training_ring_rows=1 << 20),
    dict(tile_rows=64, training_ring_rows=64), dict(tile_rows=64, training_ring_rows=192),
    dict(tile_rows=4, training_ring_rows=12), dict(training_ring_rows=None)])
def test_good_training_ring_rows_are_taken_as_given(kwargs):
    config = MoKConfig(**kwargs)
    want = kwargs["training_ring_rows"]
    assert config.training_ring_rows == want
    if want is not None:  # a given ring is used whatever the shape
        assert config.training_ring(tokens=4096, topk=8, experts_per_rank=6) == want
        assert config.training_ring(tokens=1, topk=1, experts_per_rank=1) == want


def _default_ring_by_rule(T: int, K: int, L: int, tile: int) -> int:
    """max(ceil(1.25 T K) + L half tiles, T K + L (tile - 1)), rounded up to a tile (integer
    arithmetic: no float rounding)."""
    rows = max(-(-5 * T * K // 4) + L * tile // 2, T * K + L * (tile - 1))
    return -(-rows // tile) * tile


@pytest.mark.parametrize("T, K, L, tile", [
    (4096, 8, 6, 128),   # Kimi-K2 at EP 64: 1.25 x 32768 + 6 half tiles = 41344
    (4096, 8, 192, 128),  # Kimi-K2 at EP 2: one rank's worst case 32768 + 192 x 127 = 57152 -> 57216
    (1000, 2, 8, 64),    # 2500 + 256 = 2756 -> 2816
    (1, 1, 1, 128),      # max(2 + 64, 1 + 127) = 128
    (777, 3, 5, 128),    # max(2914 + 320, 2331 + 635) = 3234 -> 3328
    (0, 8, 4, 128),      # no tokens: max(256, 508) -> 512
])
def test_default_training_ring_rows_follows_its_rule(T, K, L, tile):
    want = _default_ring_by_rule(T, K, L, tile)
    assert default_training_ring_rows(tokens=T, topk=K, experts_per_rank=L, tile_rows=tile) == want
    assert MoKConfig(tile_rows=tile).training_ring(tokens=T, topk=K, experts_per_rank=L) == want
    assert want % tile == 0
    # At P = 1 every routing fits: the layout holds at most T K rows plus L partial tiles.
    assert want >= r_cap(1, T, K, L, tile)


def test_default_training_ring_rows_examples():
    assert default_training_ring_rows(tokens=4096, topk=8, experts_per_rank=6, tile_rows=128) == 41344
    assert default_training_ring_rows(tokens=4096, topk=8, experts_per_rank=192, tile_rows=128) == 57216
    assert default_training_ring_rows(tokens=1000, topk=2, experts_per_rank=8, tile_rows=64) == 2816
    assert default_training_ring_rows(tokens=1, topk=1, experts_per_rank=1, tile_rows=128) == 128
    assert training_ring_bytes(1, 7168, 2048) == 2 * 7168 + 4 + 4 * 2048
    assert training_ring_bytes(1000, 1024, 512) == 1000 * (2048 + 4 + 2048)


@pytest.mark.parametrize("ring, tile", [(0, 128), (128, 128), (4096, 128), (4096 + 64, 128), (4096 + 64, 64),
                                        (41728, 128), (100, 64), (1 << 20, 128)])
def test_training_chunk_rows_is_the_ring_at_least_the_minimum_in_whole_tiles(ring, tile):
    got = training_chunk_rows(ring, tile)
    floor = max(ring, MIN_TRAINING_CHUNK_ROWS)
    assert got % tile == 0 and got >= floor and got - tile < floor, (ring, tile, got)


def test_training_chunk_rows_examples():
    assert MIN_TRAINING_CHUNK_ROWS % 128 == 0
    assert training_chunk_rows(0, 128) == MIN_TRAINING_CHUNK_ROWS
    assert training_chunk_rows(4096 + 64, 128) == 4096 + 128
    assert training_chunk_rows(4096 + 64, 64) == 4096 + 64
    assert training_chunk_rows(41728, 128) == 41728


@pytest.mark.parametrize("tile, ring", [(4, 0), (4, 4), (4, 12), (8, 1 << 20), (1, 3)])
def test_reference_backend_takes_the_training_ring_and_ignores_it(tile, ring):
    """The reference backend keeps everything: the setting is accepted and changes no bit."""
    case = make_case(3, [40], 16, 8, 5, 3, "zipf")

    def run(config):
        x, w = case.x[0].clone().requires_grad_(), case.weights[0].clone().requires_grad_()
        fc1, fc2 = case.local_fc1(0).clone().requires_grad_(), case.local_fc2(0).clone().requires_grad_()
        y = mok_moe(x, case.ids[0], w, fc1, fc2, config=config, backend="reference")
        y.backward(case.dy[0])
        return y.detach(), x.grad, w.grad, fc1.grad, fc2.grad

    plain = run(MoKConfig(tile_rows=tile))
    ringed = run(MoKConfig(tile_rows=tile, training_ring_rows=ring))
    for name, a, b in zip(("y", "dx", "dw", "d_fc1", "d_fc2"), plain, ringed):
        assert torch.equal(a, b), f"reference backend: {name} changed with training_ring_rows={ring}"


# ------------------------------------------------------------------------------------------
# The chunk helpers of megatron_mok/functional/training.py (CPU).

@pytest.fixture
def training():
    from megatron_mok.functional import training as module

    return module


def _plan_by_rule(capacity: int, kept: int, chunk: int):
    out = []
    split = min(kept, capacity)
    for lo, hi, flag in ((0, split, True), (split, capacity, False)):
        row = lo
        while row < hi:
            out.append((row, min(row + chunk, hi), flag))
            row = min(row + chunk, hi)
    return out


def _as_tuples(plan):
    return [(c.row0, c.row1, c.kept) for c in plan]


@pytest.mark.parametrize("capacity, kept, chunk, want", [
    (1000, 256, 128, [(0, 128, True), (128, 256, True)] + [(r, min(r + 128, 1000), False)
                                                           for r in range(256, 1000, 128)]),
    (1000, 0, 4096, [(0, 1000, False)]),
    (1000, 4096, 4096, [(0, 1000, True)]),
    (9208, 384, 4096, [(0, 384, True), (384, 4480, False), (4480, 8576, False), (8576, 9208, False)]),
    (9208, 5120, 4096, [(0, 4096, True), (4096, 5120, True), (5120, 9208, False)]),
    (8192, 8192, 4096, [(0, 4096, True), (4096, 8192, True)]),
    (8192, 1 << 20, 1 << 20, [(0, 8192, True)]),
    (127, 0, 128, [(0, 127, False)]),
    (0, 128, 128, []),
])
def test_chunk_plan_examples(training, capacity, kept, chunk, want):
    plan = training.chunk_plan(capacity, kept, chunk)
    assert isinstance(plan, tuple)
    assert _as_tuples(plan) == want


def test_chunk_plan_covers_the_capacity_in_order(training):
    rng = random.Random(5)
    for _ in range(500):
        tile = rng.choice([64, 128])
        capacity = rng.randrange(0, 40000)
        kept = tile * rng.randrange(0, 400)
        chunk = tile * rng.randrange(1, 100)
        plan = _as_tuples(training.chunk_plan(capacity, kept, chunk))
        assert plan == _plan_by_rule(capacity, kept, chunk), (capacity, kept, chunk)
        assert all(r0 < r1 and r1 - r0 <= chunk for r0, r1, _ in plan)
        assert [r0 for r0, _, _ in plan] == [0] + [r1 for _, r1, _ in plan[:-1]]
        assert (plan[-1][1] if plan else 0) == capacity
        assert sum(r1 - r0 for r0, r1, k in plan if k) == min(kept, capacity)


def test_chunk_plan_chunks_are_frozen_dataclasses(training):
    chunk = training.chunk_plan(256, 128, 128)[0]
    assert isinstance(chunk, training.Chunk) and dataclasses.is_dataclass(chunk)
    assert [f.name for f in dataclasses.fields(chunk)] == ["row0", "row1", "kept"]
    assert chunk == training.Chunk(0, 128, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.row0 = 1


def _random_layout(rng: random.Random, L: int, tile: int, max_count: int):
    """(offsets [L+1], counts [L]) as Python lists: each expert's segment padded to the tile."""
    counts = [rng.choice([0, 0, 1, tile - 1, tile, tile + 1, rng.randrange(0, max_count + 1)]) for _ in range(L)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + -(-c // tile) * tile)
    return offsets, counts


def _layout_by_rule(offsets, counts, row0: int, row1: int):
    n = row1 - row0
    clamp = lambda v: min(max(v, 0), n)
    offs = [clamp(o - row0) for o in offsets]
    cnts = [max(clamp(offsets[e] + counts[e] - row0) - offs[e], 0) for e in range(len(counts))]
    return offs, cnts


@pytest.mark.parametrize("L, tile", [(1, 128), (6, 128), (48, 64), (192, 128)])
def test_chunk_layout_follows_its_rule_and_the_chunks_add_up(training, L, tile):
    rng = random.Random(L * 1000 + tile)
    for trial in range(40):
        offsets, counts = _random_layout(rng, L, tile, 3000)
        capacity = offsets[-1] + rng.randrange(0, 4 * tile)  # R_cap may exceed the rows in use
        kept = tile * rng.randrange(0, capacity // tile + 2)
        chunk_rows = tile * rng.randrange(1, 40)
        off_t = torch.tensor(offsets, dtype=torch.int32)
        cnt_t = torch.tensor(counts, dtype=torch.int32)
        total_counts = [0] * L
        total_rows = [0] * L
        for chunk in training.chunk_plan(capacity, kept, chunk_rows):
            offs_c, cnts_c = training.chunk_layout(off_t, cnt_t, chunk.row0, chunk.row1)
            where = f"trial {trial}, chunk [{chunk.row0}, {chunk.row1})"
            assert offs_c.dtype == torch.int32 and cnts_c.dtype == torch.int32, where
            assert offs_c.shape == (L + 1,) and cnts_c.shape == (L,), where
            assert offs_c.device == off_t.device and cnts_c.device == off_t.device, where
            want_offs, want_cnts = _layout_by_rule(offsets, counts, chunk.row0, chunk.row1)
            assert offs_c.tolist() == want_offs, where
            assert cnts_c.tolist() == want_cnts, where
            seg = [want_offs[e + 1] - want_offs[e] for e in range(L)]
            assert all(0 <= c <= s for c, s in zip(want_cnts, seg)), where
            total_counts = [a + b for a, b in zip(total_counts, want_cnts)]
            total_rows = [a + b for a, b in zip(total_rows, seg)]
        assert total_counts == counts, f"trial {trial}: the chunks' real rows do not add up to the counts"
        assert total_rows == [offsets[e + 1] - offsets[e] for e in range(L)]
        assert off_t.tolist() == offsets and cnt_t.tolist() == counts, "chunk_layout changed its inputs"


def test_chunk_layout_examples(training):
    # Two experts: 300 routes (rows 0..383, 300 real), 0 routes, 129 routes (rows 384..639, 129 real).
    offsets = torch.tensor([0, 384, 384, 640], dtype=torch.int32)
    counts = torch.tensor([300, 0, 129], dtype=torch.int32)
    cases = [
        ((0, 256), [0, 256, 256, 256], [256, 0, 0]),
        ((256, 512), [0, 128, 128, 256], [44, 0, 128]),
        ((512, 640), [0, 0, 0, 128], [0, 0, 1]),
        ((640, 1024), [0, 0, 0, 0], [0, 0, 0]),
        ((0, 4096), [0, 384, 384, 640], [300, 0, 129]),
    ]
    for (row0, row1), want_offs, want_cnts in cases:
        offs_c, cnts_c = training.chunk_layout(offsets, counts, row0, row1)
        assert offs_c.tolist() == want_offs and cnts_c.tolist() == want_cnts, (row0, row1)


def test_a_context_gives_its_kept_activations_to_one_backward_only(training):
    """With MoK's Hopper GEMMs the backward writes d gate|up over the kept gate|up, so a second
    backward of the same context raises; with torch's GEMMs it does not overwrite, and repeats."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(call=SimpleNamespace(hopper_gemms=True))
    training.consume_kept(ctx)
    with pytest.raises(RuntimeError, match="second backward through the same forward.*run the forward again"):
        training.consume_kept(ctx)
    ctx = SimpleNamespace(call=SimpleNamespace(hopper_gemms=False))
    training.consume_kept(ctx)
    training.consume_kept(ctx)


# ------------------------------------------------------------------------------------------
# GPU: the backends, any ring.

BACKENDS = [("cuda", 64), ("cuda", 128), ("megakernel", 128)]
HUGE_RING = 1 << 20  # above R_cap of every case here


def _rings(tile: int):
    """0 (replay every row), one tile, 128 rows, a few blocks, the default, more than R_cap."""
    return [0] + sorted({tile, 128, 5 * tile}) + [None, HUGE_RING]


def _config(tile: int, ring, tokens, **extra) -> MoKConfig:
    # A wait that never ends shows up as a MoKTimeoutError after 20 s, not a hung test.
    return MoKConfig(tile_rows=tile, training_ring_rows=ring, max_tokens_per_rank=max(max(tokens), 1),
                     timeout_s=20.0, **extra)


def _group(P: int):
    """(ep_groups, streams, the group object or None) for P virtual ranks (P = 1: no group)."""
    from megatron_mok.functional import LocalEPGroup

    if P == 1:
        return [None], None, None
    group = LocalEPGroup(P)
    return group.ranks, group.streams, group


@pytest.fixture(autouse=True)
def _collect_groups(request):
    """A GPU test's virtual group and its workspaces go away with it."""
    yield
    if request.node.get_closest_marker("gpu") is not None:
        gc.collect()


# (seed, tokens per rank, H, I, experts per rank, top-k, routing, weight split)
# "hot": expert 0 in every token's slot 0 (with top-k 1 it takes every route and the other
# experts get none); "empty": only every third expert is chosen; "unused": about a quarter of the
# slots are -1. With tile 128, R_cap at P = 1 and T K = 8192 spans three 4096-row chunks.
SWEEP = [
    (201, [1024], 1024, 512, 8, 8, "uniform", 0),
    (202, [5000], 1024, 256, 4, 1, "hot", 0),
    (203, [1500], 1024, 512, 6, 2, "hot", 1),
    (204, [777], 512, 256, 16, 8, "zipf", 0),
    (205, [2000], 1024, 512, 8, 4, "unused", 0),
    (206, [1200], 1024, 512, 12, 2, "empty", 0),
    (211, [3000, 1234], 1024, 512, 4, 4, "zipf", 2),
    # Rank 0 receives all 8000 routes (past its default ring), rank 1 none.
    (212, [4000, 4000], 1024, 256, 2, 1, "hot", 0),
    (213, [1, 700], 1024, 512, 3, 2, "unused", 0),
    (221, [513, 0, 999, 64], 1024, 512, 6, 8, "empty", 0),
    (222, [300, 301, 302, 303], 1024, 256, 2, 1, "uniform", 0),
    (223, [1024, 512, 2048, 256], 1024, 512, 4, 8, "hot", 1),
]


def _spec_id(s):
    seed, tokens, H, I, L, K, routing, split = s
    return f"P{len(tokens)}-T{max(tokens)}-L{L}-k{K}-{routing}" + (f"-split{split}" if split else "")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SWEEP, ids=_spec_id)
@pytest.mark.parametrize("backend, tile", BACKENDS, ids=[f"{b}-tile{t}" for b, t in BACKENDS])
def test_results_are_bitwise_the_same_for_every_training_ring(backend, tile, spec):
    """Every ring gives bitwise the same y, dx, d topk_weights, d fc1 and d fc2 (both weight
    segments' with ``split``), and the same as a repeated run; the ring-0 run (every row replayed)
    is within the fp32 oracle's tolerance. A second input of the same shape runs after each call,
    so that a row read from a buffer the call did not write this time carries the other input's
    values and shows."""
    from tests.gpu_cases import assert_equal_runs, check_against_oracle, gpu_case, run_case

    seed, tokens, H, I, L, K, routing, split = spec
    P = len(tokens)
    assert HUGE_RING >= r_cap(P, max(tokens), K, L, tile)
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    other = gpu_case(seed + 1000, tokens, H, I, L, K, routing)
    groups, streams, group = _group(P)
    runs, other_runs = [], []
    for ring in _rings(tile):
        config = _config(tile, ring, tokens)
        runs.append((ring, run_case(case, groups, config, backend, streams, split=split)))
        other_runs.append((ring, run_case(other, groups, config, backend, streams, split=split)))
    again = run_case(case, groups, _config(tile, 0, tokens), backend, streams, split=split)
    ring0, first = runs[0]
    check_against_oracle(case, first, f"{backend} tile {tile}, ring {ring0}, {_spec_id(spec)}")
    assert_equal_runs(first, again, f"{backend} tile {tile}: ring {ring0}, run again")
    for (ring, res), (_, other_res) in zip(runs[1:], other_runs[1:]):
        assert_equal_runs(first, res, f"{backend} tile {tile}: ring {ring0} vs ring {ring}")
        assert_equal_runs(other_runs[0][1], other_res, f"{backend} tile {tile}, second input: ring {ring0} vs {ring}")
    del group


# P = 1 only: with virtual ranks one host thread enqueues every rank's work, and the launches of
# hundreds of chunks queued behind a rank that waits for its peer can fill the CUDA launch queue
# before the peer's work is enqueued (the forward dispatch then times out).
SMALL_CHUNK_SPECS = [SWEEP[0], SWEEP[1], SWEEP[3]]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SMALL_CHUNK_SPECS, ids=_spec_id)
@pytest.mark.parametrize("backend, tile", BACKENDS, ids=[f"{b}-tile{t}" for b, t in BACKENDS])
def test_results_are_bitwise_the_same_for_chunks_of_one_and_three_tiles(backend, tile, spec, monkeypatch):
    """Chunks far below MIN_TRAINING_CHUNK_ROWS (one tile, three tiles: every expert's weight
    gradient carried across many chunk bounds, chunks of padding only) give bitwise the default
    chunks' y and gradients, with every row kept and with every row replayed."""
    from megatron_mok.functional import training
    from tests.gpu_cases import assert_equal_runs, gpu_case, run_case

    seed, tokens, H, I, L, K, routing, split = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    groups, streams, group = _group(len(tokens))
    for ring in (HUGE_RING, 0):
        config = _config(tile, ring, tokens)
        default = run_case(case, groups, config, backend, streams, split=split)
        for rows in (tile, 3 * tile):
            monkeypatch.setattr(training, "training_chunk_rows", lambda ring_rows, tile_rows, rows=rows: rows)
            got = run_case(case, groups, config, backend, streams, split=split)
            monkeypatch.undo()
            assert_equal_runs(default, got, f"{backend} tile {tile}, ring {ring}: chunks of {rows} rows vs default")
    del group


@pytest.mark.gpu
@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("backend, tile", BACKENDS, ids=[f"{b}-tile{t}" for b, t in BACKENDS])
def test_backward_replays_its_own_call_after_later_calls(backend, tile, P):
    """Three layers' forwards, then their backwards in reverse order (the shared workspace and
    any ring rewritten by the later calls before each backward): bitwise each layer run alone,
    with a ring that replays every row, a small one and the default."""
    from tests.gpu_cases import assert_equal_runs, gpu_case, run_case, run_layers

    tokens = [1536] if P == 1 else [1536, 900]
    cases = [gpu_case(231 + i, tokens, 1024, 512, 4, 4, routing)
             for i, routing in enumerate(("uniform", "hot", "zipf"))]
    groups, streams, group = _group(P)
    for ring in (0, 2 * tile, None):
        config = _config(tile, ring, tokens)
        alone = [run_case(case, groups, config, backend, streams) for case in cases]
        layered = run_layers(cases, groups, config, backend, streams)
        for i, (a, b) in enumerate(zip(alone, layered)):
            assert_equal_runs(a, b, f"{backend} tile {tile}, ring {ring}: layer {i} alone vs between others")
    del group


@pytest.mark.gpu
@pytest.mark.parametrize("backend, tile", BACKENDS, ids=[f"{b}-tile{t}" for b, t in BACKENDS])
def test_cuda_graph_with_a_small_training_ring_replays_with_new_inputs(backend, tile):
    """Forward + backward captured with a 256-row ring (check_graph_replay's shape: R_cap about
    7000 rows, so a kept chunk and two replayed ones), replayed on new inputs and a new (Zipf)
    routing: bitwise eager."""
    from tests.gpu_cases import check_graph_replay

    extra = dict(minibatch_rows=256, ring_rows=512) if backend == "megakernel" else {}
    check_graph_replay(backend, MoKConfig(tile_rows=tile, training_ring_rows=256, **extra), seeds=(241, 242, 243))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "megakernel"])
def test_memory_with_one_hot_expert_is_that_of_uniform_routing(backend):
    """4 virtual ranks, default ring: the peak memory growth of a forward + backward where
    every token's first slot goes to expert 0 (rank 0 receives about twice its ring) is within
    5% + 64 MiB of uniform routing's. R_cap (4 T K) is about three times the default ring here,
    so activations sized for the worst case would be visibly larger (printed)."""
    from tests.gpu_cases import gpu_case, run_case

    P, T, H, I, L, K, tile = 4, 4096, 1024, 512, 4, 2, 128
    groups, streams, group = _group(P)
    config = _config(tile, None, [T])
    uniform = gpu_case(251, [T] * P, H, I, L, K, "uniform")
    hot = gpu_case(252, [T] * P, H, I, L, K, "hot")
    run_case(uniform, groups, config, backend, streams)  # the workspace, library and rings

    def growth(case) -> int:
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = run_case(case, groups, config, backend, streams)
        peak = torch.cuda.max_memory_allocated() - base
        del result
        return peak

    hot_growth = growth(hot)  # first, so a buffer it alone would grow is counted against it
    uniform_growth = growth(uniform)
    ring = config.training_ring(tokens=T, topk=K, experts_per_rank=L)
    cap = r_cap(P, T, K, L, tile)
    mib = lambda b: f"{b / 2 ** 20:.1f} MiB"
    print(f"\n{backend}: peak growth uniform {mib(uniform_growth)}, one hot expert {mib(hot_growth)}; "
          f"per rank R_cap {cap} rows, default ring {ring} rows; kept activations of {P} ranks: "
          f"{mib(P * training_ring_bytes(min(ring, cap), H, I))} now, "
          f"{mib(P * training_ring_bytes(cap, H, I))} sized for R_cap")
    assert ring < cap
    slack = 0.05 * uniform_growth + 64 * 2 ** 20
    assert hot_growth <= uniform_growth + slack, (
        f"{backend}: one hot expert grew memory by {mib(hot_growth)}, uniform routing by {mib(uniform_growth)}")
    del group


@pytest.mark.gpu
def test_chunk_layout_on_the_gpu_matches_the_cpu_and_never_syncs(training):
    """The backends call chunk_layout on device tensors inside captured graphs: same values as on
    the CPU, and no host synchronisation."""
    rng = random.Random(7)
    offsets, counts = _random_layout(rng, 24, 128, 2000)
    off_cpu = torch.tensor(offsets, dtype=torch.int32)
    cnt_cpu = torch.tensor(counts, dtype=torch.int32)
    off_gpu, cnt_gpu = off_cpu.cuda(), cnt_cpu.cuda()
    plan = training.chunk_plan(offsets[-1] + 300, 1024, 4096)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_gpu = [training.chunk_layout(off_gpu, cnt_gpu, c.row0, c.row1) for c in plan]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for c, (offs_g, cnts_g) in zip(plan, on_gpu):
        offs_c, cnts_c = training.chunk_layout(off_cpu, cnt_cpu, c.row0, c.row1)
        assert offs_g.is_cuda and cnts_g.is_cuda
        assert torch.equal(offs_g.cpu(), offs_c) and torch.equal(cnts_g.cpu(), cnts_c), (c.row0, c.row1)
