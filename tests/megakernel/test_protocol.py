"""The forward megakernel's work plan and protocol, on the CPU (no GPU; the library's own plan
functions through its C ABI).

The plan: every item of the three queues exactly once, in the documented order (minibatch
interleaving, column sweeps over groups of row blocks, pair tiles, the first pulls in parts), and
the block order within each expert. The protocol (tests/megakernel/protocol.py): the queues handed
to concurrent workers in random interleavings, every item started only after what it reads is
ready and never while its ring slot holds another block, and no deadlock (a one-minibatch ring,
which can deadlock, is caught).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from megatron_mok.ops import megakernel as mk

from .protocol import first_blocks, pair_tiles, plan_queue, queue_length, segments, simulate


def _queue(queue, n_blocks, mb, slots, n1, n2, pairs=False, group=8):
    """The queue's items; the plan refuses the position past its end."""
    items = plan_queue(queue, n_blocks, mb, slots, n1, n2, pairs, group)
    with pytest.raises(mk.MegakernelArgumentError):
        mk.plan_item(queue, len(items), n_blocks, mb, slots, n1, n2, pairs, group)
    return items


# ---- the plan ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n_blocks,mb", [(1, 1), (5, 2), (16, 4), (17, 4), (9, 3), (3, 8)])
def test_plan_covers_every_item_once_in_the_documented_order(use_lib, n_blocks, mb):
    n1, n2, slots = 3, 2, 2 * mb
    parts = mk.constants().first_pull_parts
    compute = _queue("compute", n_blocks, mb, slots, n1, n2)
    assert sorted((k, b, c) for k, b, c, *_ in compute) == sorted(
        [("fc1", b, c) for b in range(n_blocks) for c in range(n1)]
        + [("fc2", b, c) for b in range(n_blocks) for c in range(n2)])
    n = -(-n_blocks // mb)
    want_compute = [("fc1", 0)] + [s for m in range(1, n) for s in (("fc1", m), ("fc2", m - 1))] + [("fc2", n - 1)]
    assert segments(compute, mb) == want_compute
    # Pulls: every block once, in block order; the first two minibatches' blocks are pulled in
    # parts, part by part, from a queue of their own. There is no push item (fc2's epilogue pushes).
    nf = first_blocks(n_blocks, mb, slots)
    assert nf == min(2 * mb, slots, n_blocks)
    first_parts = _queue("first_pull", n_blocks, mb, slots, n1, n2)
    assert [(k, b, c) for k, b, c, *_ in first_parts] == [
        ("pull_part", b, j) for b in range(nf) for j in range(parts)]
    assert all(target <= 0 for *_, target in first_parts)  # first generation: nothing to wait for
    pulls = _queue("pull", n_blocks, mb, slots, n1, n2)
    assert [(k, b, c) for k, b, c, *_ in pulls] == [("pull", b, 0) for b in range(nf, n_blocks)]
    # A pull waits until every fc2 tile (both consumer halves) of the slot's previous block is done.
    for k, b, c, counter, slot, target in pulls:
        assert (counter, slot, target) == ("fc2_done", b % slots, 2 * n2 * (b // slots)), (b, slots)
    # fc1 of a block waits for all of its x rows: every part of a first block (one arrival
    # each), then one arrival per later generation of the slot.
    for k, b, c, counter, slot, target in compute:
        if k == "fc1":
            first = parts if slot < nf else 1
            assert (counter, slot, target) == ("x_ready", b % slots, first + b // slots), (b, slots, nf)
    # Within a minibatch: column block by column block over groups of up to 8 row blocks.
    fc1_mb0 = [(b, c) for k, b, c, *_ in compute if k == "fc1" and b < mb]
    groups = [list(range(g, min(g + 8, min(mb, n_blocks)))) for g in range(0, min(mb, n_blocks), 8)]
    assert fc1_mb0 == [(b, c) for grp in groups for c in range(n1) for b in grp]


@pytest.mark.parametrize("n_blocks,mb", [(1, 1), (5, 2), (16, 4), (17, 4), (9, 3), (3, 8), (40, 16), (37, 16)])
def test_pair_plan_covers_every_tile_once_in_pairs_of_one_minibatch(use_lib, n_blocks, mb):
    n1, n2, slots = 3, 2, 2 * mb
    _queue("compute", n_blocks, mb, slots, n1, n2, pairs=True)
    pairs = pair_tiles(n_blocks, mb, slots, n1, n2)
    tiles = [t[:3] for pair in pairs for t in pair]
    assert sorted(tiles) == sorted([("fc1", b, c) for b in range(n_blocks) for c in range(n1)]
                                   + [("fc2", b, c) for b in range(n_blocks) for c in range(n2)])
    for pair in pairs:
        (k, b, c), rest = pair[0][:3], pair[1:]
        assert (b % mb) % 2 == 0  # pairs start at even positions of their minibatch
        if rest:
            assert rest[0][:3] == (k, b + 1, c) and (b + 1) // mb == b // mb
        else:  # the odd last block of its minibatch
            assert b + 1 == min((b // mb + 1) * mb, n_blocks) and min(mb, n_blocks - b // mb * mb) % 2 == 1
    # The same minibatch interleaving as the single-CTA plan; within a minibatch, column block by
    # column block over groups of up to 4 pairs (8 blocks).
    n = -(-n_blocks // mb)
    firsts = [pair[0] for pair in pairs]
    assert segments(firsts, mb) == ([("fc1", 0)] + [s for m in range(1, n) for s in (("fc1", m), ("fc2", m - 1))]
                                    + [("fc2", n - 1)])
    mb0 = list(range(0, min(mb, n_blocks), 2))
    groups = [mb0[g:g + 4] for g in range(0, len(mb0), 4)]
    assert [(b, c) for k, b, c, *_ in firsts if k == "fc1" and b < mb] == [
        (b, c) for grp in groups for c in range(n1) for b in grp]


@pytest.mark.parametrize("group", [2, 4, 12, 16])
@pytest.mark.parametrize("n_blocks,mb", [(5, 2), (17, 4), (40, 16), (37, 16), (50, 20)])
def test_other_group_sizes_sweep_columns_over_groups_of_that_many_blocks(use_lib, n_blocks, mb, group):
    """MegakernelTunables.group_blocks: every tile once, the same minibatch interleaving, and
    inside a minibatch column block by column block over groups of `group` row blocks (group / 2
    pairs); each tile waits for what it waits for with the default groups: only the order moves."""
    n1, n2, slots = 3, 2, 2 * mb
    compute = _queue("compute", n_blocks, mb, slots, n1, n2, group=group)
    assert sorted((k, b, c) for k, b, c, *_ in compute) == sorted(
        [("fc1", b, c) for b in range(n_blocks) for c in range(n1)]
        + [("fc2", b, c) for b in range(n_blocks) for c in range(n2)])
    default = _queue("compute", n_blocks, mb, slots, n1, n2)
    assert segments(compute, mb) == segments(default, mb)
    assert sorted(compute) == sorted(default)
    first_mb = min(mb, n_blocks)
    groups = [list(range(g, min(g + group, first_mb))) for g in range(0, first_mb, group)]
    assert [(b, c) for k, b, c, *_ in compute if k == "fc1" and b < mb] == [
        (b, c) for grp in groups for c in range(n1) for b in grp]
    pairs = [pair[0][:3] for pair in pair_tiles(n_blocks, mb, slots, n1, n2, group)]
    firsts = list(range(0, first_mb, 2))
    pair_groups = [firsts[g:g + group // 2] for g in range(0, len(firsts), group // 2)]
    assert [(b, c) for k, b, c in pairs if k == "fc1" and b < mb] == [
        (b, c) for grp in pair_groups for c in range(n1) for b in grp]


def test_plan_item_rejects_odd_or_out_of_range_group_sizes(use_lib):
    c = mk.constants()
    for group in (0, 1, 3, c.min_group_blocks - 2, c.max_group_blocks + 2):
        with pytest.raises(mk.MegakernelArgumentError, match="group_blocks"):
            mk.plan_item("compute", 0, 4, 2, 4, 1, 1, False, group)
    for group in (c.min_group_blocks, c.max_group_blocks):
        assert mk.plan_item("compute", 0, 4, 2, 4, 1, 1, False, group)[0] == "fc1"


def test_queue_lengths_match_the_plan(use_lib):
    # The replica's own count of each queue (protocol.queue_length) is where the plan ends.
    for n_blocks, mb, pairs in ((0, 2, False), (1, 1, True), (17, 4, False), (37, 16, True)):
        for q in ("compute", "pull", "first_pull"):
            n = queue_length(q, n_blocks, mb, 2 * mb, 3, 2, pairs)
            if n:
                mk.plan_item(q, n - 1, n_blocks, mb, 2 * mb, 3, 2, pairs)
            with pytest.raises(mk.MegakernelArgumentError):
                mk.plan_item(q, n, n_blocks, mb, 2 * mb, 3, 2, pairs)


def test_blocks_stand_for_each_experts_layout_blocks_front_and_back_in_turn(use_lib):
    """mok_megakernel_layout_blocks (the kernel's own layout_block, plan.cuh): the layout block
    each queue block stands for, each expert's blocks from the front and the back in turn."""
    assert mk.layout_blocks([300, 130]) == [0, 2, 1, 3, 4]
    assert mk.layout_blocks([300, 0, 600]) == [0, 2, 1, 3, 7, 4, 6, 5]
    assert mk.layout_blocks([0]) == []
    rng = random.Random(5)
    for _ in range(200):
        counts = [rng.choice([0, 1, 43, 128, 300, 683, 700, 5500]) for _ in range(rng.randint(1, 12))]
        starts = np.concatenate([[0], np.cumsum([(c + 127) // 128 for c in counts])]).tolist()
        out = mk.layout_blocks(counts)
        for first, end in zip(starts[:-1], starts[1:]):
            n = end - first
            assert out[first:end] == [first + (j // 2 if j % 2 == 0 else n - 1 - j // 2) for j in range(n)], counts
    with pytest.raises(mk.MegakernelArgumentError):
        mk.layout_blocks([-1])
    with pytest.raises(mk.MegakernelArgumentError):
        mk.layout_blocks([])


# ---- the protocol -----------------------------------------------------------------------------

def _random_case(rng: random.Random, long_minibatches: bool, max_blocks: int = 40) -> dict:
    mb = rng.randint(9, 20) if long_minibatches else rng.randint(1, 4)
    return dict(n_blocks=rng.randint(1, max_blocks), mb=mb, slots=mb * rng.randint(2, 4), n1=rng.randint(1, 4),
                n2=rng.randint(1, 3), comm_workers=rng.randint(1, 6), compute_workers=rng.randint(1, 5),
                lookahead=rng.randint(1, 3))


@pytest.mark.parametrize("seed", range(40))
def test_protocol_never_deadlocks_and_respects_dependencies(use_lib, seed):
    # Every fourth seed: minibatches longer than the first group (the compute workers' first
    # pulls stop at 8 blocks, the helpers pull the rest).
    args = _random_case(random.Random(1000 + seed), long_minibatches=seed % 4 == 0)
    for replay in range(3):
        for pairs in (False, True):
            assert simulate(**args, seed=seed * 10 + replay, pairs=pairs) is None, (args, pairs)


@pytest.mark.parametrize("seed", range(16))
def test_protocol_with_other_group_sizes_never_deadlocks(use_lib, seed):
    """The replay above with groups of 2 and 16 row blocks, minibatches shorter and longer than a
    group, single CTAs and pair tiles."""
    args = _random_case(random.Random(3000 + seed), long_minibatches=seed % 2 == 0, max_blocks=48)
    for group in (2, 16):
        for replay in range(2):
            for pairs in (False, True):
                assert simulate(**args, seed=seed * 10 + replay, pairs=pairs, group=group) is None, (args, group, pairs)


def test_one_hot_expert_through_a_two_slot_ring(use_lib):
    # 24 row blocks of one expert through a ring of 2 slots (minibatch of one block).
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=6, lookahead=2, seed=7) is None
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=3, lookahead=2, seed=7, pairs=True) is None
    assert simulate(24, 2, 4, 16, 28, comm_workers=2, compute_workers=3, lookahead=2, seed=8, pairs=True) is None
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=1, lookahead=1, seed=9, pairs=True) is None


def test_pull_helpers_take_every_pull_and_the_first_parts_past_the_first_group(use_lib):
    # The comm workers take no pull-queue item (they join the compute workers after their first
    # pulls): the helpers pull every block after the first ones.
    args = dict(n_blocks=30, mb=2, slots=6, n1=3, n2=2, comm_workers=1, compute_workers=4, lookahead=2)
    for pairs in (False, True):
        stats = {}
        for seed in range(5):
            assert simulate(**args, seed=seed, pairs=pairs, stats=stats) is None
        assert stats.get("help", 0) == 5 * (30 - 4), stats
    # Minibatches of 12 blocks: the first group is 8 of them, so 4 + 12 blocks' parts remain for
    # the comm workers and, once the first group has landed, the helpers.
    args = dict(n_blocks=60, mb=12, slots=24, n1=3, n2=2, comm_workers=1, compute_workers=6, lookahead=2)
    stats = {}
    for seed in range(5):
        assert simulate(**args, seed=seed, pairs=True, stats=stats) is None
    assert stats.get("help_part", 0) > 0 and stats.get("help", 0) == 5 * (60 - 24), stats


def test_a_one_minibatch_ring_deadlocks_and_the_simulator_sees_it(use_lib):
    # The config forbids it: the pull of minibatch 1 waits for the fc2 tiles of minibatch 0,
    # which the compute queue places after fc1 of minibatch 1 (which waits for that pull). With
    # fewer producers than fc1 tiles of minibatch 1 (3 against 4), they all wait on those.
    for seed in range(5):
        result = simulate(8, 2, 2, 2, 2, comm_workers=1, compute_workers=2, lookahead=1, seed=seed)
        assert result is not None and result.startswith("deadlock")
