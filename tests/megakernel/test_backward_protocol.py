"""The backward megakernel's work plan and protocol, on the CPU (no GPU; the library's own plan
functions, csrc/include/mok/megakernel/bwd_plan.cuh, through its C ABI).

The plan: every item of the three queues exactly once, the compute queue in the order of
docs/training.md 2.4 (R(0), then D1(k-1), W(k-1), R(k+1), D2(k)), every wait and signal as the
table of 2.5 gives it, all computed here from the doc rather than from the library. The protocol
(tests/megakernel/protocol.py, simulate_backward): the queues handed to concurrent workers in
random interleavings over random expert sizes, minibatches, unit sizes (scaled down from 32) and
kept prefixes; no item before its inputs, no slot reused early, carries in unit order, and no
deadlock with S_b = unit + 2 * minibatch (nor with one slot fewer, the doc's bound); a ring
shorter than a unit deadlocks, and the replica sees it. Pair mode: the pair plan's queue from the
doc, every pair item's waits and signals its two tiles', and the protocol with clusters of two.
The training ring's compact rows (64-row halves in queue order, the kept prefix) against a
computation here, and the backward's timeout sites against SITE_NAMES.
"""

from __future__ import annotations

import ctypes
import random

import pytest

from megatron_mok.ops import megakernel as mk

import re

from megatron_mok import _build
from megatron_mok.functional.faults import SITE_NAMES

from .protocol import (BWD_COUNTERS, BWD_ITEM_WORDS, QUEUE_NAMES, backward_counter_layout, backward_expected_items,
                       backward_exports, backward_item, backward_pair_partner, backward_pair_tiles, backward_plan,
                       backward_queue, backward_strips, backward_units, simulate_backward, training_ring_rows_of)



# ---- the plan, from the doc -------------------------------------------------------------------

def _minibatch(n_blocks, mb, m):
    """Blocks of minibatch m (none outside 0 .. n_mb - 1)."""
    n_mb = -(-n_blocks // mb)
    return list(range(m * mb, min((m + 1) * mb, n_blocks))) if 0 <= m < n_mb else []


def _sweep(kind, blocks, cols, group):
    """Tiles of `blocks` with `cols` columns: groups of `group` blocks, column by column inside."""
    return [(kind, b, c) for g in range(0, len(blocks), group) for c in range(cols) for b in blocks[g:g + group]]


def expected_compute_queue(expert_blocks, mb, unit, n_keep, h, i, strip, group):
    """The compute queue of docs/training.md 2.4 as item keys: R(0), then for k = 0 .. n_mb:
    D1(k-1), W(k-1), R(k+1), D2(k); W(m) the strips of the units whose last block is in m."""
    n = sum(expert_blocks)
    n_mb = -(-n // mb)
    units = backward_units(expert_blocks, unit)
    strips = len(backward_strips(h, i, strip))

    def R(m):
        return _sweep("R", [b for b in _minibatch(n, mb, m) if b >= n_keep], 2 * i, group)

    def W(m):
        return [("W", u, j) for u, r in enumerate(units) if r[-1] // mb == m for j in range(strips)]

    q = R(0)
    for k in range(n_mb + 1):
        q += (_sweep("D1", _minibatch(n, mb, k - 1), h, group) + W(k - 1) + R(k + 1)
              + _sweep("D2", _minibatch(n, mb, k), i, group))
    return q


def expected_waits_and_signals(item, expert_blocks, slots, unit, n_keep, h, i, strip, mb):
    """(waits, signals) of an item by the table of docs/training.md 2.5."""
    n = sum(expert_blocks)
    units = backward_units(expert_blocks, unit)
    unit_of = {b: u for u, r in enumerate(units) for b in r}
    tiles = 6 * h * i
    nf = min(2 * mb, slots, n)
    parts = mk.constants().first_pull_parts
    # Carrying units: those of experts with more than one unit, in order.
    experts = [_expert_of(expert_blocks, r[0]) for r in units]
    carrying = [u for u, e in enumerate(experts) if experts.count(e) > 1]
    b, s = item.block, item.block % slots
    g = b // slots + 1
    dy = ("dy_ready", s, (parts if s < nf else 1) + g - 1)
    if item.kind in ("pull", "pull_part"):
        waits = [] if g == 1 else [("d1_done", s, 2 * h * (g - 1)), ("w_done", unit_of[b - slots], 2 * tiles)]
        return waits, [("dy_ready", s, 1)]
    if item.kind == "R":
        return [dy], [("gu_ready", s, 2)]
    if item.kind == "D2":
        r = sum(1 for gg in range(1, g + 1) if s + (gg - 1) * slots >= n_keep)
        return [dy] + ([("gu_ready", s, 2 * 2 * i * r)] if b >= n_keep else []), [
            ("dgu_ready", s, 1), ("unit_ready", unit_of[b], 1)]
    if item.kind == "D1":
        return [("dgu_ready", s, i * g)], [("d1_done", s, 2)]
    u = item.unit
    strip_tiles = list(backward_strips(h, i, strip)[item.col])
    waits, signals = [("unit_ready", u, i * len(units[u]))], [("w_done", u, 2 * len(strip_tiles))]
    if u in carrying:
        c = carrying.index(u)
        waits += [("carry_done", t, 2 * c) for t in strip_tiles] if c > 0 else []
        signals += [("carry_done", t, 2) for t in strip_tiles]
    return waits, signals


def _expert_of(expert_blocks, b):
    """The expert whose blocks hold queue block b."""
    first = 0
    for e, n in enumerate(expert_blocks):
        if b < first + n:
            return e
        first += n
    return None


PLAN_CASES = [
    # expert_blocks, mb, unit, n_keep, h, i, strip, group
    ([5], 2, 2, 0, 2, 1, 4, 2),
    ([3, 0, 5], 2, 2, 3, 2, 1, 4, 2),
    ([0], 1, 1, 0, 1, 1, 1, 2),
    ([1, 1, 1], 3, 4, 2, 3, 2, 3, 2),
    ([17, 2, 9], 4, 3, 11, 2, 2, 4, 4),
    ([30], 8, 8, 30, 1, 1, 2, 8),
    ([6, 0, 0, 13, 1], 5, 5, 7, 3, 1, 8, 2),
]


@pytest.mark.parametrize("case", PLAN_CASES)
def test_backward_plan_enumerates_every_item_once_in_the_documented_order(use_lib, case):
    eb, mb, unit, n_keep, h, i, strip, group = case
    n = sum(eb)
    slots = unit + 2 * mb
    plan = backward_plan(eb, mb, slots, unit, n_keep, h, i, strip, group)
    assert plan.sizes["units"] == len(backward_units(eb, unit))
    assert plan.sizes["tiles_per_unit"] == 6 * h * i
    assert plan.sizes["strips_per_unit"] == len(backward_strips(h, i, strip))
    compute = backward_queue(plan, "compute")
    keys = [it.key for it in compute]
    assert keys == expected_compute_queue(eb, mb, unit, n_keep, h, i, strip, group)
    assert len(set(keys)) == len(keys) and set(keys) == backward_expected_items(eb, unit, n_keep, h, i, strip)
    nf = min(2 * mb, slots, n)
    assert [it.key for it in backward_queue(plan, "first_pull")] == [
        ("pull_part", b, j) for b in range(nf) for j in range(mk.constants().first_pull_parts)]
    assert [it.key for it in backward_queue(plan, "pull")] == [("pull", b, 0) for b in range(nf, n)]
    # W strips cover every weight-gradient tile of the unit once.
    for it in compute:
        if it.kind == "W":
            assert range(it.first_tile, it.first_tile + it.tiles) == backward_strips(h, i, strip)[it.col]
            assert it.block == backward_units(eb, unit)[it.unit][-1]
    # Past the end of each queue: refused.
    for q in QUEUE_NAMES:
        with pytest.raises(mk.MegakernelArgumentError):
            backward_item(plan, q, plan.sizes[q])
        with pytest.raises(mk.MegakernelArgumentError):
            backward_item(plan, q, -1)


@pytest.mark.parametrize("case", PLAN_CASES)
@pytest.mark.parametrize("shrink", [0, 1])
def test_backward_waits_and_signals_are_the_documented_ones(use_lib, case, shrink):
    eb, mb, unit, n_keep, h, i, strip, group = case
    slots = unit + 2 * mb - shrink
    plan = backward_plan(eb, mb, slots, unit, n_keep, h, i, strip, group)
    for q in QUEUE_NAMES:
        for it in backward_queue(plan, q):
            want = expected_waits_and_signals(it, eb, slots, unit, n_keep, h, i, strip, mb)
            assert (list(it.waits), list(it.signals)) == want, (q, it)


def test_phase_tables_at_the_ep64_worst_case(use_lib):
    """EP = 64, T = 4096, top-8: 2^21 routed rows, 16384 row blocks (+ one partial block per
    expert), minibatches of 16 blocks: 1025 minibatches, a phase table of ~4 KB. The Kimi-K2 item
    counts (h_cols 28, i_cols 8, units of 32 blocks, strips of 4 tiles, S_b = 64). Positions
    sampled across the queue match the doc's order."""
    eb = [2731] * 5 + [2730]  # 6 experts per GPU at EP 64
    mb, unit, h, i, strip, group = 16, 32, 28, 8, 4, 8
    n_keep = 35072 // 128
    plan = backward_plan(eb, mb, unit + 2 * mb, unit, n_keep, h, i, strip, group)
    n_mb = plan.sizes["minibatches"]
    assert n_mb == -(-sum(eb) // mb) == 1025
    assert (n_mb + 3) * 4 < 4200  # the phase starts' bytes
    assert plan.sizes["strips_per_unit"] == 336 and plan.sizes["tiles_per_unit"] == 1344
    want = expected_compute_queue(eb, mb, unit, n_keep, h, i, strip, group)
    assert plan.sizes["compute"] == len(want)
    rng = random.Random(0)
    positions = {0, len(want) - 1} | {rng.randrange(len(want)) for _ in range(3000)}
    for p in sorted(positions):
        assert backward_item(plan, "compute", p).key == want[p], p


# ---- the C ABI --------------------------------------------------------------------------------

def _tables_code(eb, mb=2, slots=6, unit=2, n_keep=0, h=1, i=1, strip=4, group=2, L=None, words=None,
                 null_blocks=False, null_need=False, pairs=0):
    """Return code of mok_megakernel_backward_tables (sizing call, and building when words given)."""
    _, fns = backward_exports()
    blocks = (ctypes.c_int32 * max(len(eb), 1))(*eb)
    need = ctypes.c_int64()
    tables = (ctypes.c_int32 * 4096)() if words is not None else None
    return fns["tables"](None if null_blocks else blocks, len(eb) if L is None else L, mb, slots, unit, n_keep, h, i,
                         strip, group, pairs, tables, words or 0, None if null_need else ctypes.byref(need))


def test_backward_c_abi_rejects_bad_arguments(use_lib):
    assert _tables_code([3, 2]) == 0 and _tables_code([3, 2], words=4096) == 0
    bad = [dict(eb=[-1]), dict(eb=[3], L=0), dict(eb=[3], null_blocks=True), dict(eb=[3], null_need=True),
           dict(eb=[3], mb=0), dict(eb=[3], slots=0), dict(eb=[3], unit=0), dict(eb=[3], n_keep=-1),
           dict(eb=[3], h=0), dict(eb=[3], i=0), dict(eb=[3], strip=0), dict(eb=[3], strip=9),
           dict(eb=[3], group=3), dict(eb=[3], group=0), dict(eb=[3], group=66), dict(eb=[3], words=5),
           dict(eb=[1 << 20], h=1 << 10, i=1 << 10)]
    for kw in bad:
        assert _tables_code(**kw) == -1, kw
    _, fns = backward_exports()
    plan = backward_plan([3, 2], 2, 6, 2, 1, 1, 1, 4, 2)
    out = (ctypes.c_int32 * BWD_ITEM_WORDS)()
    assert fns["item"](0, 0, plan.tables, plan.words, out, BWD_ITEM_WORDS) == 0
    assert fns["item"](3, 0, plan.tables, plan.words, out, BWD_ITEM_WORDS) == -1  # no such queue
    assert fns["item"](0, 0, plan.tables, plan.words, out, BWD_ITEM_WORDS - 1) == -1  # short record
    assert fns["item"](0, 0, plan.tables, plan.words - 1, out, BWD_ITEM_WORDS) == -1  # tables cut short
    assert fns["item"](0, 0, None, plan.words, out, BWD_ITEM_WORDS) == -1
    assert fns["item"](0, 0, plan.tables, plan.words, None, BWD_ITEM_WORDS) == -1
    assert fns["sizes"](plan.tables, plan.words, None) == -1
    assert fns["sizes"](None, plan.words, (ctypes.c_int64 * 8)()) == -1
    bad_header = (ctypes.c_int32 * plan.words)(*plan.tables)
    bad_header[1] = 0  # mb_blocks
    assert fns["sizes"](bad_header, plan.words, (ctypes.c_int64 * 8)()) == -1
    assert fns["item"](0, 0, bad_header, plan.words, out, BWD_ITEM_WORDS) == -1
    with pytest.raises(mk.MegakernelArgumentError, match="backward tables"):
        backward_plan([3], 0, 6, 2, 0, 1, 1)


# ---- the protocol -----------------------------------------------------------------------------

def _random_experts(rng: random.Random, unit: int):
    """Expert sizes in blocks: empty, tiny, a few units, more than four units."""
    choices = [0, 1, 2, unit, unit + 1, 3 * unit - 1, 4 * unit + 1, 5 * unit + 3]
    return [rng.choice(choices) for _ in range(rng.randint(1, 5))]


def _random_case(rng: random.Random) -> dict:
    unit = rng.randint(1, 8)
    eb = _random_experts(rng, unit)
    n = sum(eb)
    n_keep = rng.choice([0, n, rng.randint(0, n), rng.randint(0, n)])
    return dict(expert_blocks=eb, mb=rng.randint(1, 8), unit=unit, n_keep=n_keep, h_cols=rng.randint(1, 3),
                i_cols=rng.randint(1, 2), strip=rng.randint(1, 4), group=rng.choice([2, 4, 8]),
                comm_workers=rng.randint(1, 4), compute_workers=rng.randint(1, 6), lookahead=rng.randint(1, 3))


@pytest.mark.parametrize("seed", range(120))
def test_backward_protocol_never_deadlocks_and_respects_dependencies(use_lib, seed):
    """S_b = unit + 2 * minibatch (the kernel's) and one slot fewer (the doc's bound,
    docs/training.md 2.7), each over a few interleavings."""
    args = _random_case(random.Random(5000 + seed))
    for shrink in (0, 1):
        slots = args["unit"] + 2 * args["mb"] - shrink
        for replay in range(2):
            assert simulate_backward(**args, slots=slots, seed=seed * 10 + replay) is None, (args, slots)


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("weaken", ["w_done", "carry_done", "gu_ready", "unit_ready"])
def test_the_replica_catches_a_plan_without_a_wait(use_lib, monkeypatch, weaken, pairs):
    """The replica's own checks (not the plan's counters) see an item run early when the plan
    drops one kind of wait: a slot pulled before its unit's W tiles, a carry touched out of unit
    order, D2 before its R tiles, W before its unit's D2 tiles."""
    from . import protocol

    real = protocol.backward_item

    def weakened(plan, queue, index):
        it = real(plan, queue, index)
        return it._replace(waits=tuple(w for w in it.waits if w[0] != weaken))

    monkeypatch.setattr(protocol, "backward_item", weakened)
    caught = 0
    for seed in range(40):
        args = _random_case(random.Random(5000 + seed))
        try:
            simulate_backward(**args, slots=args["unit"] + 2 * args["mb"], seed=seed, pairs=pairs)
        except AssertionError:
            caught += 1
    assert caught > 0


def test_backward_protocol_hot_expert_every_row_replayed(use_lib):
    # One expert of 7 units through the smallest safe ring, nothing kept, one compute worker.
    for workers, seed in ((1, 0), (2, 1), (5, 2)):
        assert simulate_backward([27], 2, 4 + 4 - 1, 4, 0, 2, 1, comm_workers=1, compute_workers=workers,
                                 lookahead=2, seed=seed, strip=3, group=2) is None


def test_backward_helpers_take_every_pull(use_lib):
    stats = {}
    eb = [9, 0, 14]
    for seed in range(3):
        assert simulate_backward(eb, 2, 7, 3, 10, 2, 1, comm_workers=2, compute_workers=3, lookahead=2,
                                 seed=seed, stats=stats) is None
    # The helpers run every pull and the first-pull parts the comm workers left.
    assert stats["help"] >= 3 * (sum(eb) - 4)


@pytest.mark.parametrize("unit", [2, 3, 5, 8])
def test_a_ring_shorter_than_a_unit_deadlocks_and_the_replica_sees_it(use_lib, unit):
    """S_b = unit - 1 with an expert of at least a whole unit: the unit's W tiles wait for D2 of
    its last block, which waits for that block's pull, which waits for the unit's W tiles (the
    block is the first occupant's successor in its slot). The config forbids it."""
    for seed in range(4):
        mb = 1 + seed % 2
        result = simulate_backward([unit + seed, 1], mb, unit - 1, unit, seed % 3, 1, 1, comm_workers=1,
                                   compute_workers=2 + seed, lookahead=1 + seed % 3, seed=seed)
        assert result is not None and result.startswith("deadlock"), (unit, seed)


# ---- pair mode --------------------------------------------------------------------------------

def _pair_sweep(kind, blocks, cols, group):
    """Pair tiles of `blocks` (first + 2j, first + 2j + 1) with `cols` columns: groups of group / 2
    pairs, column by column inside; each keyed by the pair's first block."""
    firsts = blocks[::2]
    g = group // 2
    return [(kind, b, c) for k in range(0, len(firsts), g) for c in range(cols) for b in firsts[k:k + g]]


def expected_pair_compute_queue(expert_blocks, mb, unit, n_keep, h, i, strip, group):
    """The pair-mode compute queue of docs/training.md 2.4 and 2.6: the single queue's phases, R, D2
    and D1 swept in pair tiles, W strips unchanged."""
    n = sum(expert_blocks)
    n_mb = -(-n // mb)
    units = backward_units(expert_blocks, unit)
    strips = len(backward_strips(h, i, strip))

    def R(m):
        return _pair_sweep("R", [b for b in _minibatch(n, mb, m) if b >= n_keep], 2 * i, group)

    def W(m):
        return [("W", u, j) for u, r in enumerate(units) if r[-1] // mb == m for j in range(strips)]

    q = R(0)
    for k in range(n_mb + 1):
        q += (_pair_sweep("D1", _minibatch(n, mb, k - 1), h, group) + W(k - 1) + R(k + 1)
              + _pair_sweep("D2", _minibatch(n, mb, k), i, group))
    return q


@pytest.mark.parametrize("case", PLAN_CASES)
@pytest.mark.parametrize("shrink", [0, 1])
def test_pair_plan_is_the_single_plan_in_pair_tiles(use_lib, case, shrink):
    """Every item of the single plan exactly once (a pair counts as its two tiles), in the doc's
    order of pair tiles; each pair item waits for both tiles' waits and signals both tiles'
    signals (backward_pair_tiles asserts it against the single plan, whose waits the test above
    checks against the doc); the pulls are the single plan's."""
    eb, mb, unit, n_keep, h, i, strip, group = case
    slots = unit + 2 * mb - shrink
    plan = backward_plan(eb, mb, slots, unit, n_keep, h, i, strip, group, pairs=True)
    single = backward_plan(eb, mb, slots, unit, n_keep, h, i, strip, group)
    compute = backward_queue(plan, "compute")
    assert [it.key for it in compute] == expected_pair_compute_queue(eb, mb, unit, n_keep, h, i, strip, group)
    tiles = backward_pair_tiles(eb, mb, slots, unit, n_keep, h, i, strip, group)
    keys = [t.key for pair in tiles for t in pair]
    assert len(keys) == len(set(keys)) and set(keys) == backward_expected_items(eb, unit, n_keep, h, i, strip)
    for pair in tiles:
        if len(pair) == 2:
            assert pair[1].block == pair[0].block + 1 and pair[1].block // mb == pair[0].block // mb
        elif pair[0].kind != "W":
            assert backward_pair_partner(pair[0].block, sum(eb), mb) is None
    for q in ("pull", "first_pull"):
        assert backward_queue(plan, q) == backward_queue(single, q)
    assert {k: v for k, v in plan.sizes.items() if k != "compute"} == {
        k: v for k, v in single.sizes.items() if k != "compute"}
    with pytest.raises(mk.MegakernelArgumentError):
        backward_item(plan, "compute", plan.sizes["compute"])


def test_pair_tables_export(use_lib):
    """pairs outside 0, 1 are refused; pair mode has fewer compute positions; a header whose pairs
    word is not 0 or 1 is refused."""
    _, fns = backward_exports()
    eb = (ctypes.c_int32 * 3)(5, 0, 7)
    args = (eb, 3, 2, 6, 2, 4, 2, 1, 4, 2)
    need = ctypes.c_int64()
    b = (ctypes.c_int32 * 256)()
    for pairs in (0, 1):
        assert fns["tables"](*args, pairs, b, 256, ctypes.byref(need)) == 0
    for pairs in (-1, 2):
        assert fns["tables"](*args, pairs, b, 256, ctypes.byref(need)) == -1
    plan = backward_plan([5, 0, 7], 2, 6, 2, 4, 2, 1, 4, 2, pairs=True)
    assert plan.sizes["compute"] < backward_plan([5, 0, 7], 2, 6, 2, 4, 2, 1, 4, 2).sizes["compute"]
    bad = (ctypes.c_int32 * plan.words)(*plan.tables)
    bad[11] = 2  # the pairs word follows the sizes
    assert fns["sizes"](bad, plan.words, (ctypes.c_int64 * 8)()) == -1


@pytest.mark.parametrize("seed", range(120))
def test_pair_protocol_never_deadlocks_and_respects_dependencies(use_lib, seed):
    """Clusters of two at S_b = unit + 2 * minibatch and one slot fewer, over random layouts."""
    args = _random_case(random.Random(7000 + seed))
    args["group"] = max(args["group"], 2)
    for shrink in (0, 1):
        slots = args["unit"] + 2 * args["mb"] - shrink
        for replay in range(2):
            assert simulate_backward(**args, slots=slots, seed=seed * 10 + replay, pairs=True) is None, (args, slots)


def test_pair_protocol_hot_expert_every_row_replayed(use_lib):
    for workers, seed in ((1, 0), (2, 1), (5, 2)):
        assert simulate_backward([27], 2, 4 + 4 - 1, 4, 0, 2, 1, comm_workers=1, compute_workers=workers,
                                 lookahead=2, seed=seed, strip=3, group=2, pairs=True) is None


@pytest.mark.parametrize("unit", [2, 3, 5])
def test_a_ring_shorter_than_a_unit_deadlocks_in_pairs_too(use_lib, unit):
    for seed in range(3):
        result = simulate_backward([unit + seed, 1], 1 + seed % 2, unit - 1, unit, seed % 3, 1, 1, comm_workers=1,
                                   compute_workers=2 + seed, lookahead=1 + seed % 3, seed=seed, pairs=True)
        assert result is not None and result.startswith("deadlock"), (unit, seed)


# ---- the training ring's compact rows ---------------------------------------------------------

def expected_ring_rows(counts, ring_rows):
    """(N_keep, [(first ring row, halves)] per queue block), computed here: each expert's queue
    blocks stand for its layout blocks front, back, front, ... (plan.cuh's zigzag); a layout block
    holds min(128, rows left) real rows and takes ceil(real / 64) halves; blocks take ring rows in
    queue order; N_keep is the longest prefix whose rows fit."""
    out, row = [], 0
    for c in counts:
        n = -(-c // 128)
        for j in range(n):
            layout = j // 2 if j % 2 == 0 else n - 1 - j // 2
            halves = -(-min(128, c - 128 * layout) // 64)
            out.append((row, halves))
            row += 64 * halves
    keep = 0
    while keep < len(out) and out[keep][0] + 64 * out[keep][1] <= ring_rows:
        keep += 1
    return keep, out


EDGE_ROWS = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 385]


@pytest.mark.parametrize("seed", range(60))
def test_training_ring_rows_are_compact_halves_in_queue_order(use_lib, seed):
    rng = random.Random(9000 + seed)
    counts = [rng.choice(EDGE_ROWS + [rng.randint(0, 2000)]) for _ in range(rng.randint(1, 9))]
    total = sum(-(-c // 64) * 64 for c in counts)
    rings = {0, 63, 64, 127, 128, total, total - 64, total + 64, rng.randint(0, total + 1)} | {
        rng.randint(0, total) for _ in range(6)}
    for ring in sorted(r for r in rings if r >= 0):
        keep, rows = training_ring_rows_of(counts, ring)
        assert (keep, rows) == expected_ring_rows(counts, ring), (counts, ring)
    # An expert of n rows takes ceil(n / 64) * 64 ring rows, from its compact offset.
    _, rows = training_ring_rows_of(counts, total)
    b = offset = 0
    for c in counts:
        n = -(-c // 128)
        if n:
            assert rows[b][0] == offset and sum(64 * h for _, h in rows[b:b + n]) == -(-c // 64) * 64
        b, offset = b + n, offset + -(-c // 64) * 64


def test_training_ring_rows_of_each_edge_size(use_lib):
    for c in EDGE_ROWS:
        for ring in range(0, -(-c // 64) * 64 + 129, 32):
            assert training_ring_rows_of([c, 1, c], ring) == expected_ring_rows([c, 1, c], ring), (c, ring)
    # The partial block sits at queue position 1: 129 rows = blocks of 2 and 1 halves, 192 ring rows.
    assert training_ring_rows_of([129], 1000) == (2, [(0, 2), (128, 1)])
    assert training_ring_rows_of([300], 1000) == (3, [(0, 2), (128, 1), (192, 2)])
    assert training_ring_rows_of([300], 191) == (1, [(0, 2), (128, 1), (192, 2)])
    assert training_ring_rows_of([300], 192)[0] == 2


def test_training_ring_rows_of_rejects_bad_arguments(use_lib):
    _, fns = backward_exports()
    counts = (ctypes.c_int32 * 2)(130, 5)
    keep, out = ctypes.c_int32(), (ctypes.c_int32 * 6)()
    assert fns["ring_rows"](counts, 2, 100, ctypes.byref(keep), out, 6) == 0 and keep.value == 0
    assert fns["ring_rows"](counts, 2, 100, ctypes.byref(keep), out, 5) == -1  # out too short
    assert fns["ring_rows"](counts, 2, -1, ctypes.byref(keep), out, 6) == -1
    assert fns["ring_rows"](counts, 0, 100, ctypes.byref(keep), out, 6) == -1
    assert fns["ring_rows"](None, 2, 100, ctypes.byref(keep), out, 6) == -1
    assert fns["ring_rows"](counts, 2, 100, None, out, 6) == -1
    assert fns["ring_rows"](counts, 2, 100, ctypes.byref(keep), None, 6) == -1
    assert fns["ring_rows"]((ctypes.c_int32 * 1)(-1), 1, 100, ctypes.byref(keep), out, 6) == -1


# ---- timeout sites ----------------------------------------------------------------------------

def test_megakernel_sites_have_names_and_the_backward_takes_12_to_18():
    """Every MOK_SITE_MK_* of csrc/include/mok/megakernel.h has a SITE_NAMES entry; 12-18 are the
    backward megakernel's (docs/training.md 2.5)."""
    text = (_build.CSRC_DIR / "include" / "mok" / "megakernel.h").read_text()
    body = re.search(r"enum MokMegakernelSite \{(.*?)\};", text, re.S).group(1)
    sites = {name: int(v) for name, v in re.findall(r"(MOK_SITE_MK_\w+)\s*=\s*(\d+)", body)}
    assert sites and all(v in SITE_NAMES for v in sites.values()), sites
    assert len(set(sites.values())) == len(sites)
    assert sorted(v for v in sites.values() if v >= 12) == list(range(12, 19))
    assert all("backward megakernel" in SITE_NAMES[v] for v in range(12, 19))


# ---- the counter buffer -----------------------------------------------------------------------

HEADER_WORDS = 8  # the forward's header (plan.cuh, HeaderWord), shared by the backward


def test_counter_buffer_layout_at_the_kimi_k2_shape(use_lib):
    """S_b = 64 slots, 192 experts of at most R_cap / 128 blocks (EP 2), units of 32, minibatches
    of 16, H = 7168, I = 2048: the forward's header, four slot arrays, two unit arrays sized for
    max_blocks / 32 + L units, 1344 carry_done words (one per weight-gradient tile), then the
    tables, back to back."""
    max_blocks = -(-(2 * 4096 * 8 + 192 * 127) // 128) + 192
    lay = backward_counter_layout(64, max_blocks, 192, 32, 16, 7168 // 256, 2048 // 256)
    units = max_blocks // 32 + 192
    want_len = dict(dy_ready=64, gu_ready=64, dgu_ready=64, d1_done=64, unit_ready=units, w_done=units,
                    carry_done=1344)
    assert lay.length == want_len
    at = HEADER_WORDS
    for c in BWD_COUNTERS:
        assert lay.base[c] == at, (c, lay.base)
        at += want_len[c]
    assert lay.tables == at
    n_mb = -(-max_blocks // 16)
    assert lay.words == lay.tables + 12 + (units + 1) + units + (n_mb + 3) + (n_mb + 1)
    assert lay.words * 4 < 64 * 1024, "a few tens of KB per workspace"


@pytest.mark.parametrize("seed", range(40))
def test_every_wait_and_signal_indexes_inside_its_counter_array(use_lib, seed):
    """For random layouts within the buffer's sizes (max_blocks and L as the buffer was laid out
    for): the plan's tables fit after the counters, and every wait and signal of every item of
    the three queues names an index inside its counter's array."""
    rng = random.Random(9000 + seed)
    args = _random_case(rng)
    eb, unit, mb = args["expert_blocks"], args["unit"], args["mb"]
    slots = unit + 2 * mb
    max_blocks = sum(eb) + rng.randint(0, 5)
    lay = backward_counter_layout(slots, max_blocks, len(eb), unit, mb, args["h_cols"], args["i_cols"])
    for pairs in (False, True):
        plan = backward_plan(eb, mb, slots, unit, args["n_keep"], args["h_cols"], args["i_cols"], args["strip"],
                             args["group"], pairs=pairs)
        assert plan.words <= lay.words - lay.tables, (plan.words, lay)
        assert plan.sizes["units"] <= lay.length["unit_ready"]
        for queue in QUEUE_NAMES:
            for it in backward_queue(plan, queue):
                for name, index, _ in it.waits + it.signals:
                    assert 0 <= index < lay.length[name], (queue, it, name, index, lay.length)


def test_counter_layout_rejects_bad_sizes(use_lib):
    lib, fns = backward_exports()
    out = (ctypes.c_int64 * 16)()
    good = (64, 1000, 8, 32, 16, 28, 8)
    assert fns["counters"](*good, out, 16) == 0
    for i, bad in ((0, 0), (1, -1), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0)):
        args = list(good)
        args[i] = bad
        assert fns["counters"](*args, out, 16) != 0, args
    assert fns["counters"](*good, out, 15) != 0
    assert fns["counters"](*good, None, 16) != 0
    assert fns["counters"](64, 2 ** 31 - 2, 8, 1, 1, 28, 8, out, 16) != 0  # past int32 words
