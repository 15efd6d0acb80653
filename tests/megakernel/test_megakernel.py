"""The forward megakernel (``megakernel`` backend, docs/megakernel.md).

CPU: auto's choice and the shape rules, the tunables' checks, the custom op's fake
implementation and argument checks, the C ABI (struct layout, argument checks before any CUDA
call), and the kernel's work plan replayed by a simulator that hands the three queues to
concurrent workers in random interleavings: every item exactly once, in the documented order,
each started only after what it reads is ready and never while its ring slot holds another
block, and no deadlock (a one-minibatch ring, which can deadlock, is caught).

GPU (skipped without an sm_90 GPU): against the fp32
oracle at P = 1, virtual ranks and P = 2; bitwise equal to the grouped GEMM kernels composed
by hand; a hot expert through a ring far smaller than its rows; bitwise identical across runs
and across (comm SMs, minibatch, ring) settings; CUDA graph replay; the timeout.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_mok import MoKConfig, MoKConfigError
from megatron_mok.functional import (BackendUnavailable, LocalEPGroup, MoKInputError, MoKTimeoutError, check_errors,
                                     mok_moe)
from megatron_mok.functional import backends, megakernel_backend as mkb
from megatron_mok.functional.validate import MoEShape
from megatron_mok.ops import megakernel as mk

from tests.c_abi import struct_fields
from tests.distributed import run_ranks

KIMI = MoEShape(tokens=4096, hidden=7168, topk=8, experts_per_rank=192, ffn_hidden=2048)
MOK_ERR_INVALID_ARGUMENT = -1


# ---- CPU: gate, shape rules, tunables --------------------------------------------------------

@pytest.mark.parametrize("shape,config,message", [
    (KIMI, MoKConfig(), None),
    (MoEShape(1, 1024, 1, 1, 128), MoKConfig(), None),
    (KIMI, MoKConfig(tile_rows=64), "tile_rows=64; the megakernel's row blocks are 128 rows"),
    (MoEShape(64, 1000, 2, 4, 512), MoKConfig(), "hidden size 1000 is not a multiple of 256"),
    (MoEShape(64, 1024, 2, 4, 192), MoKConfig(), "expert FFN size 192 is not a multiple of 128"),
    (MoEShape(64, 1024, 2, 2000, 512), MoKConfig(), "2000 experts per rank exceed the megakernel's 1024"),
    (MoEShape(64, 1024, 1025, 4, 512), MoKConfig(), "top-k 1025 exceeds the megakernel's 1024"),
])
def test_shape_rules(shape, config, message):
    reason = mkb.unsupported_reason(shape, config, 1)
    if message is None:
        assert reason is None
    else:
        assert reason is not None and message in reason


def test_explicit_megakernel_on_cpu_says_why(monkeypatch):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    ids = torch.zeros(4, 1, dtype=torch.int64)
    w = torch.ones(4, 1)
    fc1 = torch.zeros(1, 256, 256, dtype=torch.bfloat16)
    fc2 = torch.zeros(1, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="backend='megakernel' cannot run: the tensors are on cpu"):
        mok_moe(x, ids, w, fc1, fc2, backend="megakernel")


def test_selection_auto_takes_the_megakernel_and_logs_one_line_when_it_cannot(monkeypatch, caplog):
    # Stand-ins for a CUDA tensor and a working GPU stack: only the megakernel's own rules decide.
    monkeypatch.setattr(backends, "gpu_backend_blocker", lambda x: None)
    monkeypatch.setattr(backends, "cuda_blocker", lambda x, shape, config: None)
    x = SimpleNamespace(is_cuda=True)
    many = MoEShape(4096, 7168, 8, 6, 2048)  # ~5,500 rows per local expert
    for shape in (KIMI, many):  # training and inference alike: there is no grad argument
        assert backends.select_backend("auto", x, shape, MoKConfig(), 2) == "megakernel"
    assert backends.select_backend("megakernel", x, KIMI, MoKConfig(), 2) == "megakernel"
    with pytest.raises(BackendUnavailable, match="tile_rows=64"):
        backends.select_backend("megakernel", x, KIMI, MoKConfig(tile_rows=64), 2)
    backends._log_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="megatron_mok"):
        for _ in range(3):
            assert backends.select_backend("auto", x, KIMI, MoKConfig(tile_rows=64), 2) == "cuda"
    lines = [r.getMessage() for r in caplog.records if "auto uses the cuda backend" in r.getMessage()]
    assert len(lines) == 1 and "tile_rows=64" in lines[0], lines


def test_pair_mode_is_asked_for_unless_the_config_says_otherwise():
    # Faster at every measured load in steady-state (block) timings: asked for by default;
    # MoKConfig.megakernel_pairs (--mok-megakernel-pairs on / off) overrides it.
    assert mkb.use_pairs() and mkb.use_pairs(MoKConfig())
    assert mkb.use_pairs(MoKConfig(megakernel_pairs=True))
    assert not mkb.use_pairs(MoKConfig(megakernel_pairs=False))


def test_forward_comm_sms_default_follows_the_regime():
    # Weight-bound (at most 256 rows per local expert): 6 comm SMs; otherwise 8. Always at most
    # a quarter of the SMs; an explicit value wins; the backward's default stays 10.
    def resolved(experts, config=MoKConfig(), sms=132):
        return mkb.resolve_tunables(config, dataclasses.replace(KIMI, experts_per_rank=experts), 2, sms)
    assert [resolved(e).comm_sms_forward for e in (192, 128, 129, 48, 6)] == [6, 6, 6, 8, 8]
    assert [resolved(e).comm_sms_backward for e in (192, 6)] == [10, 10]
    assert mkb.rows_per_expert(dataclasses.replace(KIMI, experts_per_rank=128)) == 256.0
    assert resolved(192, MoKConfig(comm_sms_forward=12)).comm_sms_forward == 12
    assert resolved(192, sms=20).comm_sms_forward == 5 and resolved(6, sms=20).comm_sms_forward == 5
    # The minibatch heuristic sees the compute SMs left: two waves at 126 as at 124.
    assert resolved(192).minibatch_rows == resolved(6).minibatch_rows == 2048


def test_forward_without_grad_takes_two_comm_sms_fewer_unless_given():
    # No training copies: the pulls write each row once, so a forward without grad takes two comm
    # SMs fewer (4 weight-bound, 6 otherwise); with grad the resolved count; an explicit count
    # serves both; never below 2.
    def counts(experts, config=MoKConfig(), sms=132):
        res = mkb.resolve_tunables(config, dataclasses.replace(KIMI, experts_per_rank=experts), 2, sms)
        return (config.forward_comm_sms(res, saves_activations=True),
                config.forward_comm_sms(res, saves_activations=False))
    assert [counts(e) for e in (192, 128, 48, 6)] == [(6, 4), (6, 4), (8, 6), (8, 6)]
    assert counts(192, MoKConfig(comm_sms_forward=12)) == (12, 12)
    assert counts(6, MoKConfig(comm_sms_forward=3)) == (3, 3)
    assert counts(192, sms=12) == (3, 2) and counts(192, sms=8) == (2, 2)
    with pytest.raises(MoKConfigError, match="needs the resolved config"):
        MoKConfig().forward_comm_sms(MoKConfig(), saves_activations=False)


def test_tunables_resolve_within_the_rules():
    cfg = mkb.resolve_tunables(MoKConfig(), KIMI, 2, 132)
    assert cfg.comm_sms_forward == 6 and cfg.minibatch_rows % 128 == 0 and cfg.ring_rows == 4 * cfg.minibatch_rows
    one = mkb.resolve_tunables(MoKConfig(), KIMI, 1, 132)
    assert one.comm_sms_forward == 6  # the same rows move at P = 1 (local copies)
    # A virtual rank's share of the SMs (LocalEPGroup of 4 on 132 SMs).
    share = mkb.resolve_tunables(MoKConfig(), KIMI, 4, 33)
    assert share.comm_sms_forward == 6 and share.minibatch_rows >= 128
    given = mkb.resolve_tunables(MoKConfig(comm_sms_forward=3, minibatch_rows=256, ring_rows=768), KIMI, 2, 132)
    assert (given.comm_sms_forward, given.minibatch_rows, given.ring_rows) == (3, 256, 768)


@pytest.mark.parametrize("kwargs,num_sms,message", [
    (dict(comm_sms_forward=33), 33, r"comm_sms_forward=33 leaves no compute SM on a device with 33 SMs"),
    (dict(minibatch_rows=256, ring_rows=256), 132, r"ring_rows=256 must be a multiple of minibatch_rows=256 and at least two"),
    (dict(minibatch_rows=256, ring_rows=640), 132, r"ring_rows=640 must be a multiple of minibatch_rows=256"),
    (dict(minibatch_rows=200), 132, r"minibatch_rows=200 must be a multiple of tile_rows=128"),
    (dict(), 2, r"needs at least 3 SMs"),
    (dict(comm_sms_forward=1), 132, r"comm_sms_forward=1 must be None \(chosen automatically\) or an integer >= 2"),
])
def test_bad_tunables_are_clear_errors(kwargs, num_sms, message):
    with pytest.raises(MoKConfigError, match=message):
        mkb.resolve_tunables(MoKConfig(**kwargs), KIMI, 2, num_sms)


def test_ring_to_minibatch_rule_applies_to_defaults_too():
    # ring_rows given, minibatch_rows chosen: the combination is still checked after resolution.
    with pytest.raises(MoKConfigError, match="ring_rows=1024 must be a multiple of minibatch_rows"):
        mkb.resolve_tunables(MoKConfig(ring_rows=1024), KIMI, 2, 132)  # default minibatch is 2048 rows here


def test_ring_memory_is_fixed_by_the_config():
    # Kimi-K2 defaults: a ring of 8192 rows, whatever the routing.
    assert mkb.ring_bytes(8192, 7168, 2048) == 8192 * (7168 + 2048) * 2 + 8192 * 4
    assert mkb.ring_bytes(8192, 7168, 2048) < 160 * 2 ** 20


# ---- CPU: the library's ABI and the work plan ------------------------------------------------

def test_args_struct_matches_the_header(use_lib):
    names = struct_fields("megakernel.h", "MokMegakernelArgs")
    assert names == [f[0] for f in mk.MegakernelArgs._fields_]
    _, fns = mk._lib()
    assert fns["args_bytes"]() == ctypes.sizeof(mk.MegakernelArgs) == 8 * len(names)
    assert mk.counter_words(8192) == 10 + 3 * 64  # header words (plan.cuh), three counters per slot


def _valid_args(**over):
    p = 0x10000  # never dereferenced: the argument checks fail before any CUDA call
    a = dict(bases=p, signal_bases=p, rows_offset=0, scalars_offset=1024, slots_offset=4096, table=p,
             offsets=p, counts=p, topk_ids=p, fc1_weight=p, fc2_weight=p, ring_x=p, ring_h=p, ring_w=p,
             counters=p, y=p, epoch_counter=p, status=p, timeout_ns=10 ** 9, P=2, rank=0, L=4, H=1024,
             I=512, K=2, T=64, ring_rows=512, minibatch_rows=256, comm_ctas=2, num_ctas=0, L1=4, pairs=0)
    a.update(over)
    return mk.MegakernelArgs(**a)


@pytest.mark.parametrize("over", [
    dict(H=1000), dict(I=192), dict(L=0), dict(L=2000), dict(rank=2), dict(P=0),
    dict(minibatch_rows=200), dict(ring_rows=256), dict(ring_rows=640), dict(comm_ctas=1),
    dict(num_ctas=2), dict(timeout_ns=0), dict(table=0), dict(y=0), dict(rows_offset=8),
    dict(ring_x=0x10008), dict(trace=0x10000, trace_capacity=0), dict(save_x=0x10000),
    dict(save_x=0x10000, save_w=0x10000), dict(save_x=0x10000, save_w=0x10000, save_gu=0x10008),
    dict(L1=3), dict(fc1_weight2=0x10000, L1=3), dict(fc1_weight2=0x10000, fc2_weight2=0x10000),
    dict(fc1_weight2=0x10000, fc2_weight2=0x10000, L1=0), dict(fc1_weight2=0x10008, fc2_weight2=0x10000, L1=3),
    dict(pairs=2), dict(pairs=-1),
])
def test_c_abi_rejects_bad_arguments_before_any_cuda_call(use_lib, over):
    _, fns = mk._lib()
    args = _valid_args(**over)
    assert fns["forward"](ctypes.byref(args), None) == MOK_ERR_INVALID_ARGUMENT


def _first_blocks(n_blocks, mb, slots):
    """Blocks the kernel pulls in parts when it starts: those of the first two minibatches (a
    valid ring holds them)."""
    return min(2 * mb, slots, n_blocks)


def _units(n_blocks, mb, pairs):
    """Tile units of the layout: blocks, or in pair mode pairs of blocks within a minibatch."""
    if not pairs:
        return n_blocks
    return sum((min(mb, n_blocks - m) + 1) // 2 for m in range(0, n_blocks, mb))


def _queue(queue, n_blocks, mb, slots, n1, n2, pairs=False, group=mk.GROUP_BLOCKS):
    nf = _first_blocks(n_blocks, mb, slots)
    total = {"compute": _units(n_blocks, mb, pairs) * (n1 + n2), "first_pull": nf * mk.FIRST_PULL_PARTS,
             "pull": n_blocks - nf}[queue]
    items = [mk.plan_item(queue, i, n_blocks, mb, slots, n1, n2, pairs, group) for i in range(total)]
    with pytest.raises(mk.MegakernelArgumentError):
        mk.plan_item(queue, total, n_blocks, mb, slots, n1, n2, pairs, group)
    return items


def _pair_tiles(n_blocks, mb, slots, n1, n2, group=mk.GROUP_BLOCKS):
    """The pair-mode compute queue as [[tile of the first CTA, tile of the second (if any)]], each
    tile with the wait the single-CTA plan gives its block (the kernel's CTA of rank r waits for
    block + r exactly so)."""
    single = {item[:3]: item for item in _queue("compute", n_blocks, mb, slots, n1, n2, group=group)}
    out = []
    for kind, block, col, *wait in _queue("compute", n_blocks, mb, slots, n1, n2, pairs=True, group=group):
        assert tuple(wait) == single[(kind, block, col)][3:]
        second = mk.pair_partner(block, n_blocks, mb)
        out.append([single[(kind, block, col)]] + ([single[(kind, second, col)]] if second is not None else []))
    return out


def _segments(items, mb):
    """[(kind, minibatch)] of consecutive runs."""
    out = []
    for kind, block, *_ in items:
        key = (kind, block // mb)
        if not out or out[-1] != key:
            out.append(key)
    return out


@pytest.mark.parametrize("n_blocks,mb", [(1, 1), (5, 2), (16, 4), (17, 4), (9, 3), (3, 8), (40, 16), (37, 16)])
def test_pair_plan_covers_every_tile_once_in_pairs_of_one_minibatch(use_lib, n_blocks, mb):
    n1, n2, slots = 3, 2, 2 * mb
    pairs = _pair_tiles(n_blocks, mb, slots, n1, n2)
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
    assert _segments(firsts, mb) == ([("fc1", 0)] + [s for m in range(1, n) for s in (("fc1", m), ("fc2", m - 1))]
                                     + [("fc2", n - 1)])
    mb0 = list(range(0, min(mb, n_blocks), 2))
    groups = [mb0[g:g + 4] for g in range(0, len(mb0), 4)]
    assert [(b, c) for k, b, c, *_ in firsts if k == "fc1" and b < mb] == [
        (b, c) for grp in groups for c in range(n1) for b in grp]


@pytest.mark.parametrize("pairs", [False, True], ids=["single", "pairs"])
@pytest.mark.parametrize("late", [1, 2, 3])
@pytest.mark.parametrize("n_blocks,mb", [(0, 4), (1, 1), (5, 2), (16, 4), (17, 4), (9, 3), (3, 8), (40, 16), (37, 16)])
def test_early_position_comes_after_every_early_fc2_tile(use_lib, n_blocks, mb, late, pairs):
    """What the early slot sum relies on (push.cuh, report_early): in queue order every fc2 tile
    of an early block (before the last `late` minibatches) lies before early_position and every
    other tile at or past it holds no early fc2 work, so a consumer warpgroup that reaches that
    position has counted all of its early halves; early_arrivals counts exactly those halves."""
    n1, n2 = 3, 2
    first_late, position, arrivals = mk.early_plan(n_blocks, mb, n1, n2, pairs, late)
    n_mb = -(-n_blocks // mb)
    assert first_late == max(n_mb - late, 0) * mb
    assert arrivals == first_late * n2 * 2
    items = _queue("compute", n_blocks, mb, 2 * mb, n1, n2, pairs) if n_blocks else []
    assert 0 <= position <= len(items)
    early_fc2 = [i for i, (kind, block, *_) in enumerate(items) if kind == "fc2" and block < first_late]
    assert all(i < position for i in early_fc2)
    # Nothing before the position is late fc2 work (so the halves counted there are all early),
    # and the position is the first after the last early fc2 tile (no later report than needed).
    assert all(not (kind == "fc2" and block >= first_late) for kind, block, *_ in items[:position])
    assert position == (early_fc2[-1] + 1 if early_fc2 else 0)


@pytest.mark.parametrize("n_blocks,mb", [(1, 1), (5, 2), (16, 4), (17, 4), (9, 3), (3, 8)])
def test_plan_covers_every_item_once_in_the_documented_order(use_lib, n_blocks, mb):
    n1, n2, slots = 3, 2, 2 * mb
    compute = _queue("compute", n_blocks, mb, slots, n1, n2)
    assert sorted((k, b, c) for k, b, c, *_ in compute) == sorted(
        [("fc1", b, c) for b in range(n_blocks) for c in range(n1)]
        + [("fc2", b, c) for b in range(n_blocks) for c in range(n2)])
    n = -(-n_blocks // mb)
    want_compute = [("fc1", 0)] + [s for m in range(1, n) for s in (("fc1", m), ("fc2", m - 1))] + [("fc2", n - 1)]
    assert _segments(compute, mb) == want_compute
    # Pulls: every block once, in block order; the first two minibatches' blocks are pulled in
    # parts, part by part, from a queue of their own. There is no push item (fc2's epilogue pushes).
    nf = _first_blocks(n_blocks, mb, slots)
    parts = _queue("first_pull", n_blocks, mb, slots, n1, n2)
    assert [(k, b, c) for k, b, c, *_ in parts] == [
        ("pull_part", b, j) for b in range(nf) for j in range(mk.FIRST_PULL_PARTS)]
    assert all(target <= 0 for *_, target in parts)  # first generation: nothing to wait for
    pulls = _queue("pull", n_blocks, mb, slots, n1, n2)
    assert [(k, b, c) for k, b, c, *_ in pulls] == [("pull", b, 0) for b in range(nf, n_blocks)]
    # A pull waits until every fc2 tile (both consumer halves) of the slot's previous block is done.
    for k, b, c, counter, slot, target in pulls:
        assert (counter, slot, target) == ("fc2_done", b % slots, 2 * n2 * (b // slots)), (b, slots)
    # fc1 of a block waits for all of its x rows: every part of a first block (one arrival
    # each), then one arrival per later generation of the slot.
    for k, b, c, counter, slot, target in compute:
        if k == "fc1":
            first = mk.FIRST_PULL_PARTS if slot < nf else 1
            assert (counter, slot, target) == ("x_ready", b % slots, first + b // slots), (b, slots, nf)
    # Within a minibatch: column block by column block over groups of up to 8 row blocks.
    fc1_mb0 = [(b, c) for k, b, c, *_ in compute if k == "fc1" and b < mb]
    groups = [list(range(g, min(g + 8, min(mb, n_blocks)))) for g in range(0, min(mb, n_blocks), 8)]
    assert fc1_mb0 == [(b, c) for grp in groups for c in range(n1) for b in grp]


def simulate(n_blocks, mb, slots, n1, n2, comm_workers, compute_workers, lookahead, seed, pairs=False,
             comm_joins=False, helpers=False, stats=None, late=None, comm_pull_limit=None, group=mk.GROUP_BLOCKS):
    """Replay the kernel's protocol: workers take queue items in order, wait for the counter
    targets the plan gives, and bump the counters the kernel bumps. Returns None when every
    item ran, else a description of the deadlock. Asserts the dependencies and the slot
    ownership the targets are meant to enforce. Every worker first serves the first-pull queue
    (parts of the first blocks), as every CTA of the kernel does: a comm worker until it is
    empty, a compute worker until the first group's parts are taken; then its role: comm
    workers pull, compute workers run tiles (an fc2 tile pushes its rows home itself; a slot is
    free once its block's fc2 tiles are done). With pairs, a compute worker is a cluster of two
    CTAs that takes pair tiles: its loads go out once both blocks' inputs are in (each CTA's
    consumers wait for the weight box the other multicasts), and both tiles finish together.
    With comm_joins, a comm worker whose pull queue is empty (and who holds no pull) becomes a
    compute worker, as a comm CTA of the kernel does (MOK_MEGAKERNEL_COMM_JOINS). With helpers,
    every compute worker also serves pulls from the time it leaves the first-pull queue, next to
    its tiles, as a compute CTA's idle producer warps do (MOK_MEGAKERNEL_PULL_HELPERS): the
    first-pull parts left once the first group's blocks have landed, then the pull queue. With
    comm_pull_limit (only with helpers and comm_joins, as in the kernel), comm workers take pull-
    queue positions below it only, then join (MOK_MEGAKERNEL_COMM_PULL_LIMIT). `stats`, a dict, gets the number of pulls each kind of server ran ("comm", "help"), and of
    first-pull parts the helpers ran ("help_part").
    With `late` (minibatches the early slot sum waits out), every compute worker counts the fc2
    tiles it ran as early delivered when it consumes its first item at or past early_position,
    or when it has nothing left, as a consumer warpgroup of the kernel does (push.cuh,
    report_early); once the count reaches the early blocks' fc2 tiles the "early delivered" flag
    goes up, and the replay asserts that every early fc2 tile is done by then and that no worker
    counts a late one. `stats` then also gets "early_flag_at": fc2 tiles done when it went up.
    `group`: row blocks of a group, the column sweep of the compute queue and the first pulls of
    the compute workers (MOK_MEGAKERNEL_GROUP_BLOCKS)."""
    assert comm_pull_limit is None or (helpers and comm_joins), "the kernel limits the comm CTAs only then"
    rng = random.Random(seed)
    queues = {q: _queue(q, n_blocks, mb, slots, n1, n2, group=group) for q in ("compute", "pull", "first_pull")}
    comm_pulls = len(queues["pull"]) if comm_pull_limit is None else min(comm_pull_limit, len(queues["pull"]))
    # Compute items as lists of tiles: one tile, or the one or two tiles of a pair.
    queues["compute"] = (_pair_tiles(n_blocks, mb, slots, n1, n2, group) if pairs else [[t] for t in queues["compute"]])
    nxt = {"compute": 0, "pull": 0, "first_pull": 0}
    nf = _first_blocks(n_blocks, mb, slots)
    counters = {}
    done = set()
    owner = {}  # slot -> block in flight
    bump = {"pull": ("x_ready", 1), "pull_part": ("x_ready", 1), "fc1": ("h_ready", 2), "fc2": ("fc2_done", 2)}

    def ready(item):
        _, _, _, counter, slot, target = item
        return counters.get((counter, slot), 0) >= target

    def start(item):
        kind, b, c = item[:3]
        s = b % slots
        if kind == "pull":
            assert b < slots or all(("fc2", b - slots, j) in done for j in range(n2)), (
                f"pull {b} before the fc2 tiles of {b - slots}")
            assert s not in owner, f"pull {b} into slot {s} still holding block {owner.get(s)}"
            owner[s] = b
        elif kind == "pull_part":
            assert b < slots and owner.get(s, b) == b, f"part of {b} into slot {s} holding {owner.get(s)}"
            owner[s] = b
        else:
            assert owner.get(s) == b, f"{kind} of block {b} while slot {s} holds {owner.get(s)}"
            pulled = ([("pull_part", b, j) for j in range(mk.FIRST_PULL_PARTS)] if b < nf else [("pull", b, 0)])
            need = {"fc1": pulled, "fc2": [("fc1", b, j) for j in range(n1)]}[kind]
            assert all(d in done for d in need), f"{kind} {b},{c} started before its inputs"

    def finish(item):
        kind, b, c = item[:3]
        done.add((kind, b, c))
        name, amount = bump[kind]
        counters[(name, b % slots)] = counters.get((name, b % slots), 0) + amount
        if kind == "fc2" and all(("fc2", b, j) in done for j in range(n2)):
            del owner[b % slots]

    pull_servers = [("comm", w) for w in range(comm_workers)]
    if helpers:
        pull_servers += [("help", w) for w in range(compute_workers)]
    comm = {srv: None for srv in pull_servers}          # pull a server holds (waits on)
    producers = [None] * (compute_workers + comm_workers)   # item the TMA thread waits on
    issued = [[] for _ in range(compute_workers + comm_workers)]  # tiles whose loads are issued, in order
    joined = []                                         # comm workers now computing
    workers = [("comm", w) for w in range(comm_workers)] + [("compute", w) for w in range(compute_workers)]
    first = {wk: None for wk in workers}                # first-pull part a worker holds
    in_first = {wk: True for wk in workers}             # still serving the first-pull queue
    total = sum(len(q) for name, q in queues.items() if name != "compute") + n_blocks * (n1 + n2)
    if late is not None:
        first_late, early_pos, _ = mk.early_plan(n_blocks, mb, n1, n2, pairs, late)
        early = {"count": 0, "up": False}
        ran_fc2 = {}        # worker -> fc2 tiles it ran, not yet counted
        reported = set()    # workers that have counted theirs
        positions = {}      # id(compute item) -> its queue position

        def report(w):
            reported.add(w)
            tiles = ran_fc2.pop(w, [])
            assert all(b < first_late for b in tiles), f"worker {w} counts late fc2 tiles {tiles}"
            early["count"] += len(tiles)
            if early["count"] == first_late * n2 and not early["up"]:
                early["up"] = True
                missing = [(b, c) for b in range(first_late) for c in range(n2) if ("fc2", b, c) not in done]
                assert not missing, f"early flag up before fc2 tiles {missing[:4]}"
                if stats is not None:
                    stats["early_flag_at"] = sum(1 for d in done if d[0] == "fc2")
    while len(done) < total:
        if late is not None:  # a worker with nothing left counts what it ran
            for w in list(range(compute_workers)) + [compute_workers + j for j in joined]:
                if (w not in reported and producers[w] is None and not issued[w]
                        and nxt["compute"] >= len(queues["compute"])):
                    report(w)
        actions = []
        for wk in workers:
            if not in_first[wk]:
                continue
            # Compute workers take parts of the first group's blocks only.
            limit = (min(nf, mb, group) * mk.FIRST_PULL_PARTS if wk[0] == "compute"
                     else len(queues["first_pull"]))
            if first[wk] is not None:
                if ready(first[wk]):
                    actions.append(("run_first", wk))
            elif nxt["first_pull"] < limit:
                actions.append(("take_first", wk))
            else:
                actions.append(("leave_first", wk))
        group_in = all(("pull_part", b, j) in done for b in range(min(nf, mb, group))
                       for j in range(mk.FIRST_PULL_PARTS))
        for srv in pull_servers:
            role, w = srv
            if (role == "comm" and (in_first[srv] or w in joined)) or (role == "help" and in_first[("compute", w)]):
                continue
            if role == "help" and nxt["first_pull"] < len(queues["first_pull"]):
                if comm[srv] is None and group_in:
                    actions.append(("take_first_help", srv))
                elif comm[srv] is not None and ready(comm[srv]):
                    actions.append(("run_comm", srv))
                continue
            if comm[srv] is None and nxt["pull"] < (comm_pulls if role == "comm" else len(queues["pull"])):
                actions.append(("take_comm", srv))
            elif comm[srv] is not None and ready(comm[srv]):
                actions.append(("run_comm", srv))
            elif comm[srv] is None and comm_joins and role == "comm":
                actions.append(("join", w))
        for w in list(range(compute_workers)) + [compute_workers + j for j in joined]:
            if w < compute_workers and in_first[("compute", w)]:
                continue
            if producers[w] is None and nxt["compute"] < len(queues["compute"]) and len(issued[w]) < lookahead:
                actions.append(("take_compute", w))
            elif producers[w] is not None and all(ready(t) for t in producers[w]):
                actions.append(("issue", w))
            if issued[w]:
                actions.append(("consume", w))
        if not actions:
            return (f"deadlock with {len(done)} of {total} items done: comm holds {comm}, producers hold "
                    f"{producers}, counters {counters}")
        act, w = rng.choice(actions)
        if act == "take_first":
            first[w] = queues["first_pull"][nxt["first_pull"]]
            nxt["first_pull"] += 1
        elif act == "run_first":
            start(first[w])
            finish(first[w])
            first[w] = None
        elif act == "leave_first":
            in_first[w] = False
        elif act == "join":
            joined.append(w)
        elif act == "take_comm":
            comm[w] = queues["pull"][nxt["pull"]]
            nxt["pull"] += 1
        elif act == "take_first_help":
            comm[w] = queues["first_pull"][nxt["first_pull"]]
            nxt["first_pull"] += 1
        elif act == "run_comm":
            if stats is not None:
                key = w[0] + ("_part" if comm[w][0] == "pull_part" else "")
                stats[key] = stats.get(key, 0) + 1
            start(comm[w])
            finish(comm[w])
            comm[w] = None
        elif act == "take_compute":
            producers[w] = queues["compute"][nxt["compute"]]
            if late is not None:
                positions[id(producers[w])] = nxt["compute"]
            nxt["compute"] += 1
        elif act == "issue":
            for t in producers[w]:
                start(t)
            issued[w].append(producers[w])
            producers[w] = None
        else:
            item = issued[w].pop(0)
            if late is not None and w not in reported and positions[id(item)] >= early_pos:
                report(w)
            for t in item:
                finish(t)
                if late is not None and t[0] == "fc2":
                    assert w not in reported or t[1] >= first_late, f"worker {w} ran early fc2 {t[:3]} after counting"
                    ran_fc2.setdefault(w, []).append(t[1])
    assert not owner, f"slots still held at the end: {owner}"
    if late is not None:
        for w in list(range(compute_workers)) + [compute_workers + j for j in joined]:
            if w not in reported:
                report(w)
        assert early["count"] == first_late * n2 and (early["up"] or first_late == 0), early
    return None


@pytest.mark.parametrize("seed", range(40))
def test_protocol_never_deadlocks_and_respects_dependencies(use_lib, seed):
    rng = random.Random(1000 + seed)
    # Every fourth seed: minibatches longer than the first group (the compute workers' first
    # pulls stop at 8 blocks).
    mb = rng.randint(1, 4) if seed % 4 else rng.randint(9, 12)
    ring_minibatches = rng.randint(2, 4)
    n_blocks = rng.randint(1, 40)
    args = dict(n_blocks=n_blocks, mb=mb, slots=mb * ring_minibatches, n1=rng.randint(1, 4), n2=rng.randint(1, 3),
                comm_workers=rng.randint(1, 6), compute_workers=rng.randint(1, 5), lookahead=rng.randint(1, 3))
    for replay in range(3):
        for pairs in (False, True):
            for joins, helpers in ((False, False), (True, False), (False, True), (True, True)):
                assert simulate(**args, seed=seed * 10 + replay, pairs=pairs, comm_joins=joins,
                                helpers=helpers) is None, (args, pairs, joins, helpers)
            # The comm workers join right after the first pulls, or after a few pulls (the
            # kernel's default without training copies, and the switch).
            for limit in (0, 3):
                assert simulate(**args, seed=seed * 10 + replay, pairs=pairs, comm_joins=True, helpers=True,
                                comm_pull_limit=limit) is None, (args, pairs, limit)


@pytest.mark.parametrize("group", [2, 4, 12, 16])
@pytest.mark.parametrize("n_blocks,mb", [(5, 2), (17, 4), (40, 16), (37, 16), (50, 20)])
def test_other_group_sizes_sweep_columns_over_groups_of_that_many_blocks(use_lib, n_blocks, mb, group):
    """MOK_MEGAKERNEL_GROUP_BLOCKS: every tile once, the same minibatch interleaving, and inside a
    minibatch column block by column block over groups of `group` row blocks (group / 2 pairs)."""
    n1, n2, slots = 3, 2, 2 * mb
    compute = _queue("compute", n_blocks, mb, slots, n1, n2, group=group)
    assert sorted((k, b, c) for k, b, c, *_ in compute) == sorted(
        [("fc1", b, c) for b in range(n_blocks) for c in range(n1)]
        + [("fc2", b, c) for b in range(n_blocks) for c in range(n2)])
    default = _queue("compute", n_blocks, mb, slots, n1, n2)
    assert _segments(compute, mb) == _segments(default, mb)
    # Each tile waits for what it waits for with the default groups: only the order moves.
    assert sorted(compute) == sorted(default)
    first_mb = min(mb, n_blocks)
    groups = [list(range(g, min(g + group, first_mb))) for g in range(0, first_mb, group)]
    assert [(b, c) for k, b, c, *_ in compute if k == "fc1" and b < mb] == [
        (b, c) for grp in groups for c in range(n1) for b in grp]
    pairs = [pair[0][:3] for pair in _pair_tiles(n_blocks, mb, slots, n1, n2, group)]
    firsts = list(range(0, first_mb, 2))
    pair_groups = [firsts[g:g + group // 2] for g in range(0, len(firsts), group // 2)]
    assert [(b, c) for k, b, c in pairs if k == "fc1" and b < mb] == [
        (b, c) for grp in pair_groups for c in range(n1) for b in grp]


def test_plan_item_rejects_odd_or_out_of_range_group_sizes(use_lib):
    for group in (0, 1, 3, 66):
        with pytest.raises(mk.MegakernelArgumentError, match="group_blocks"):
            mk.plan_item("compute", 0, 4, 2, 4, 1, 1, False, group)


@pytest.mark.parametrize("seed", range(16))
def test_protocol_with_other_group_sizes_never_deadlocks(use_lib, seed):
    """The protocol replay of test_protocol_never_deadlocks_and_respects_dependencies with groups
    of 2 and 16 row blocks (MOK_MEGAKERNEL_GROUP_BLOCKS), minibatches shorter and longer than a
    group, pair tiles, comm workers joining, pull helpers and the comm pull limit."""
    rng = random.Random(3000 + seed)
    mb = rng.randint(1, 4) if seed % 2 else rng.randint(9, 20)
    n_blocks = rng.randint(1, 48)
    args = dict(n_blocks=n_blocks, mb=mb, slots=mb * rng.randint(2, 4), n1=rng.randint(1, 4), n2=rng.randint(1, 3),
                comm_workers=rng.randint(1, 6), compute_workers=rng.randint(1, 5), lookahead=rng.randint(1, 3))
    for group in (2, 16):
        for replay in range(2):
            for pairs in (False, True):
                for joins, helpers, limit in ((False, False, None), (True, True, None), (True, True, 0)):
                    assert simulate(**args, seed=seed * 10 + replay, pairs=pairs, comm_joins=joins, helpers=helpers,
                                    comm_pull_limit=limit, group=group) is None, (args, group, pairs, joins, helpers)


def _early_sweep_case(seed: int) -> dict:
    """The simulate() sizes of the early-delivery sweeps' case `seed`."""
    rng = random.Random(2000 + seed)
    mb = rng.randint(1, 4)
    return dict(n_blocks=rng.randint(1, 40), mb=mb, slots=mb * rng.randint(2, 4), n1=rng.randint(1, 4),
                n2=rng.randint(1, 3), comm_workers=rng.randint(1, 6), compute_workers=rng.randint(1, 5),
                lookahead=rng.randint(1, 3))


@pytest.mark.parametrize("seed", range(20))
def test_early_delivery_counts_every_early_fc2_tile_and_no_other(use_lib, seed):
    """The early slot sum's counts (push.cuh) replayed: whatever the interleaving, the producers
    running ahead, pair tiles, comm workers joining or pull helpers, the workers count exactly the
    fc2 tiles of the early blocks, each after it ran, and the early flag goes up with all of them
    done."""
    args = _early_sweep_case(seed)
    for late in (1, 2, 3):
        for pairs in (False, True):
            for joins, helpers, limit in ((False, False, None), (True, True, None), (True, True, 0)):
                assert simulate(**args, seed=seed * 10 + late, pairs=pairs, comm_joins=joins, helpers=helpers,
                                late=late, comm_pull_limit=limit) is None, (args, late, pairs, joins, helpers, limit)


def test_early_flag_usually_goes_up_before_the_last_fc2_tile(use_lib):
    """With two or more late minibatches the early flag goes up while fc2 tiles are still left,
    in nearly every random interleaving. Not in all: the replay may starve a worker that holds a
    tile before early_position until the end, and the flag waits for its count (the protocol's
    guarantee is only that the count is exact, tested above)."""
    before = runs = 0
    for seed in range(20):
        args = _early_sweep_case(seed)
        n_blocks = args["n_blocks"]
        for late in (2, 3):
            if -(-n_blocks // args["mb"]) <= late:
                continue
            for pairs in (False, True):
                for joins, helpers in ((False, False), (True, True)):
                    stats = {}
                    assert simulate(**args, seed=seed * 10 + late, pairs=pairs, comm_joins=joins, helpers=helpers,
                                    stats=stats, late=late) is None
                    runs += 1
                    before += stats["early_flag_at"] < n_blocks * args["n2"]
    assert runs >= 80 and before >= 0.9 * runs, (before, runs)


def test_one_hot_expert_through_a_two_slot_ring(use_lib):
    # 24 row blocks of one expert through a ring of 2 slots (minibatch of one block).
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=6, lookahead=2, seed=7) is None
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=3, lookahead=2, seed=7, pairs=True) is None
    assert simulate(24, 2, 4, 16, 28, comm_workers=2, compute_workers=3, lookahead=2, seed=8, pairs=True) is None
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=3, lookahead=2, seed=9, pairs=True,
                    comm_joins=True) is None
    assert simulate(24, 1, 2, 16, 28, comm_workers=2, compute_workers=3, lookahead=2, seed=10, pairs=True,
                    comm_joins=True, helpers=True) is None


def test_pull_helpers_take_pulls(use_lib):
    # The helpers really serve the pull queue next to one comm worker (which, as the kernel's
    # comm CTAs do, also drains the first-pull queue past the first group), and the first-pull
    # parts past the first group once it has landed.
    args = dict(n_blocks=30, mb=2, slots=6, n1=3, n2=2, comm_workers=1, compute_workers=4, lookahead=2)
    for pairs in (False, True):
        stats = {}
        for seed in range(5):
            assert simulate(**args, seed=seed, pairs=pairs, helpers=True, stats=stats) is None
        assert stats.get("help", 0) > 0 and stats.get("comm", 0) > 0, stats
    # Minibatches of 12 blocks: the first group is 8 of them, so 4 + 12 blocks' parts remain.
    args = dict(n_blocks=60, mb=12, slots=24, n1=3, n2=2, comm_workers=1, compute_workers=6, lookahead=2)
    stats = {}
    for seed in range(5):
        assert simulate(**args, seed=seed, pairs=True, helpers=True, stats=stats) is None
    assert stats.get("help_part", 0) > 0, stats
    # With the comm workers' pull limit at 0 they take no pull at all: the helpers take every one.
    stats = {}
    for seed in range(5):
        assert simulate(**args, seed=seed, pairs=True, helpers=True, comm_joins=True, comm_pull_limit=0,
                        stats=stats) is None
    assert stats.get("comm", 0) == 0 and stats.get("help", 0) == 5 * (60 - 24), stats


def test_a_one_minibatch_ring_deadlocks_and_the_simulator_sees_it(use_lib):
    # The config forbids it: the pull of minibatch 1 waits for the fc2 tiles of minibatch 0,
    # which the compute queue places after fc1 of minibatch 1 (which waits for that pull).
    result = simulate(8, 2, 2, 2, 2, comm_workers=2, compute_workers=3, lookahead=1, seed=0)
    assert result is not None and result.startswith("deadlock")


# ---- CPU: the op's fake and its argument checks ----------------------------------------------

def _op_args(R=512, L=4, H=1024, I=512, T=6, K=2, P=2, words=None):
    z = lambda *s, dtype=torch.bfloat16: torch.zeros(*s, dtype=dtype)
    return dict(
        bases=z(P, dtype=torch.int64), signal_bases=z(P, dtype=torch.int64), rows_offset=0, scalars_offset=0,
        slots_offset=0, table=z(100, 2, dtype=torch.int32), offsets=z(L + 1, dtype=torch.int32),
        counts=z(L, dtype=torch.int32), topk_ids=z(T, K, dtype=torch.int64), fc1_weight=z(L, 2 * I, H),
        fc2_weight=z(L, H, I), ring_x=z(R, H), ring_h=z(R, I), ring_w=z(R, dtype=torch.float32),
        counters=z(words if words is not None else mk.counter_words(R), dtype=torch.int32),
        epoch_counter=z(1, dtype=torch.int64), status=z(8, dtype=torch.int32), rank=0, minibatch_rows=256,
        comm_ctas=2, num_ctas=0, timeout_ns=10 ** 9, trace=None, save_x=None, save_w=None, save_gu=None,
        fc1_weight2=None, fc2_weight2=None)


def test_fake_impl_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = _op_args(T=37, H=1024)
        y = torch.ops.mok.megakernel_forward(**a)
        assert y.shape == (37, 1024) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("over,message", [
    (dict(ring_h=torch.zeros(512, 256, dtype=torch.bfloat16)), r"ring_h must have shape \(512, 512\)"),
    (dict(ring_x=torch.zeros(640, 1024, dtype=torch.bfloat16), ring_h=torch.zeros(640, 512, dtype=torch.bfloat16),
          ring_w=torch.zeros(640)), r"ring_rows = 640 must be a multiple of minibatch_rows = 256"),
    (dict(minibatch_rows=100), r"minibatch_rows = 100 must be a positive multiple of 128"),
    (dict(counters=torch.zeros(7, dtype=torch.int32)), r"counters must have 22 elements"),
    (dict(comm_ctas=1), r"comm_ctas = 1 must be at least 2"),
    (dict(num_ctas=2), r"num_ctas = 2 must be 0 \(every SM\) or above comm_ctas = 2"),
    (dict(rank=2), r"rank = 2 is outside \[0, P = 2\)"),
    (dict(status=torch.zeros(4, dtype=torch.int32)), r"status must have 8 elements"),
    (dict(fc1_weight=torch.zeros(4, 1024, 1000, dtype=torch.bfloat16),
          fc2_weight=torch.zeros(4, 1000, 512, dtype=torch.bfloat16)), r"H = 1000 must be a multiple of 256"),
    (dict(topk_ids=torch.zeros(6, 2, dtype=torch.int32)), r"topk_ids must be torch.int64"),
    (dict(topk_ids=torch.zeros(6, 1025, dtype=torch.int64)), r"top-k = 1025 is outside \[1, 1024\]"),
])
def test_op_checks_name_the_bad_value(use_lib, over, message):
    a = _op_args()
    a.update(over)
    keys = ("bases", "signal_bases", "table", "offsets", "counts", "topk_ids", "fc1_weight", "fc2_weight", "ring_x",
            "ring_h", "ring_w", "counters", "epoch_counter", "status")
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        mk.check_forward_args(*(a[k] for k in keys), rank=a["rank"], minibatch_rows=a["minibatch_rows"],
                              comm_ctas=a["comm_ctas"], num_ctas=a["num_ctas"], timeout_ns=a["timeout_ns"])


@pytest.mark.parametrize("over,message", [
    (dict(save_x=torch.zeros(100, 1024, dtype=torch.bfloat16)), r"save_x, save_w and save_gu go together.*save_x only"),
    (dict(save_x=torch.zeros(100, 1024, dtype=torch.bfloat16), save_w=torch.zeros(100),
          save_gu=torch.zeros(100, 512, dtype=torch.bfloat16)), r"save_gu must have shape \(100, 1024\)"),
    (dict(save_x=torch.zeros(99, 1024, dtype=torch.bfloat16), save_w=torch.zeros(100),
          save_gu=torch.zeros(100, 1024, dtype=torch.bfloat16)), r"save_x must have shape \(100, 1024\)"),
    (dict(save_x=torch.zeros(100, 1024, dtype=torch.bfloat16), save_w=torch.zeros(100, dtype=torch.float64),
          save_gu=torch.zeros(100, 1024, dtype=torch.bfloat16)), r"save_w must be torch.float32"),
])
def test_training_copies_are_checked(use_lib, over, message):
    a = _op_args()
    a.update(over)
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        mk.check_save_args(a["save_x"], a["save_w"], a["save_gu"], a["table"], a["fc1_weight"])
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        torch.ops.mok.megakernel_forward(**a)


_SEG = dict(fc1_weight2=torch.zeros(1, 1024, 1024, dtype=torch.bfloat16),
            fc2_weight2=torch.zeros(1, 1024, 512, dtype=torch.bfloat16),
            offsets=torch.zeros(6, dtype=torch.int32), counts=torch.zeros(5, dtype=torch.int32))


@pytest.mark.parametrize("over,message", [
    (dict(_SEG, fc2_weight2=None), r"fc1_weight2 and fc2_weight2 go together.*only fc1_weight2"),
    (dict(_SEG, fc2_weight2=torch.zeros(1, 1024, 256, dtype=torch.bfloat16)),
     r"fc2_weight2 must have shape \(1, 1024, 512\)"),
    (dict(_SEG, fc1_weight2=torch.zeros(2, 1024, 512, dtype=torch.bfloat16)),
     r"fc1_weight2 must have shape \(2, 1024, 1024\)"),
    (dict(_SEG, offsets=torch.zeros(5, dtype=torch.int32)), r"offsets must have 6 elements"),
    (dict(_SEG, counts=torch.zeros(4, dtype=torch.int32)), r"counts must have 5 elements"),
])
def test_second_weight_segment_is_checked(use_lib, over, message):
    a = _op_args()
    a.update(over)
    with pytest.raises(mk.MegakernelArgumentError, match=message):
        torch.ops.mok.megakernel_forward(**a)


def test_fake_impl_takes_a_second_weight_segment():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = _op_args(T=37, H=1024)
        a.update(fc1_weight2=torch.zeros(1, 1024, 1024, dtype=torch.bfloat16),
                 fc2_weight2=torch.zeros(1, 1024, 512, dtype=torch.bfloat16))
        y = torch.ops.mok.megakernel_forward(**a)
        assert y.shape == (37, 1024) and y.dtype == torch.bfloat16


# ---- CPU: the backend's host path, with the GPU steps recorded instead of queued --------------

class _RecordingWorkspace:
    """The parts of a Workspace the megakernel backend's host path touches, on the CPU; dispatch
    returns a schedule of the call's shape instead of queueing the prologue."""

    def __init__(self, P, rank, shape):
        self.P, self.rank, self.device = P, rank, torch.device("cpu")
        self.layout = SimpleNamespace(hidden=shape.hidden, rows=1024, scalars=512, slots=4096)
        self.bases = torch.zeros(P, dtype=torch.int64)
        self.signal_bases = torch.zeros(P, dtype=torch.int64)
        self.counter = torch.zeros(1, dtype=torch.int64)
        self.status = torch.zeros(8, dtype=torch.int32)
        self.prepared_calls = {}
        self.timeout_s = float("nan")
        self.capacity = P * shape.tokens * shape.topk + shape.experts_per_rank * 127
        self.dispatched = []

    def raise_if_failed(self, timeout_s):
        pass

    def dispatch(self, x, ids, scalars, site, timeout_s, tile_rows):
        self.dispatched.append((x.shape, ids.shape, scalars.shape, site, timeout_s, tile_rows))
        L = self.prepared_L
        return (torch.zeros((self.capacity, 2), dtype=torch.int32), torch.zeros(L, dtype=torch.int32),
                torch.zeros(L + 1, dtype=torch.int32), self.capacity)

    def mirror_status(self):
        pass


class _TwoRankGroup:
    """Stands for rank 1 of a two-rank process group (size() and rank(), hashable)."""

    def size(self):
        return 2

    def rank(self):
        return 1


@pytest.mark.parametrize("grad", [False, True])
def test_backend_host_path_prepares_once_and_passes_the_launch_settings(use_lib, monkeypatch, grad):
    shape = MoEShape(tokens=64, hidden=1024, topk=2, experts_per_rank=4, ffn_hidden=512)
    ws = _RecordingWorkspace(2, 1, shape)
    ws.prepared_L = shape.experts_per_rank
    group = _TwoRankGroup()
    monkeypatch.setattr(mkb, "get_workspace", lambda *a, **kw: ws)
    monkeypatch.setattr(mkb, "sm_share", lambda device, ep_group: 132)
    prepared, kernel_calls = [], []
    real_prepare = mkb._prepare_launch
    monkeypatch.setattr(mkb, "_prepare_launch", lambda *a: prepared.append(a) or real_prepare(*a))
    monkeypatch.setattr(mk, "launch_forward",
                        lambda *a, **kw: kernel_calls.append((a, kw)) or torch.zeros(shape.tokens, shape.hidden))
    config = MoKConfig(timeout_s=7.0)
    x = torch.zeros(shape.tokens, shape.hidden, dtype=torch.bfloat16, requires_grad=grad)
    ids = torch.zeros(shape.tokens, shape.topk, dtype=torch.int64)
    w = torch.zeros(shape.tokens, shape.topk)
    fc1 = (torch.zeros(4, 1024, 1024, dtype=torch.bfloat16),)
    fc2 = (torch.zeros(4, 1024, 512, dtype=torch.bfloat16),)
    for _ in range(3):
        y = mkb.megakernel_moe(x, ids, w, fc1, fc2, ep_group=group, config=config, shape=shape)
        assert y.shape == (shape.tokens, shape.hidden)
    assert len(prepared) == 1, "a (config, shape) is prepared and checked at its first call only"
    assert len(ws.dispatched) == 3 and ws.dispatched[0] == ((64, 1024), (64, 2), (64, 2), 1, 7.0, mkb.BLOCK_ROWS)
    resolved = mkb.resolve_tunables(config, shape, 2, 132)
    assert len(kernel_calls) == 3
    args, kw = kernel_calls[-1]
    names = ["bases", "signal_bases", "rows_offset", "scalars_offset", "slots_offset", "table", "offsets", "counts",
             "topk_ids", "fc1", "fc2", "ring_x", "ring_h", "ring_w", "counters", "epoch_counter", "status", "rank",
             "minibatch_rows", "comm_ctas", "num_ctas", "timeout_ns", "trace", "save_x", "save_w", "save_gu",
             "fc1_2", "fc2_2"]
    a = dict(zip(names, args))
    assert (a["rows_offset"], a["scalars_offset"], a["slots_offset"], a["rank"]) == (1024, 512, 4096, 1)
    assert a["minibatch_rows"] == resolved.minibatch_rows and a["ring_x"].shape == (resolved.ring_rows, 1024)
    want_comm = resolved.comm_sms_forward if grad else config.forward_comm_sms(resolved, saves_activations=False)
    assert a["comm_ctas"] == want_comm and a["num_ctas"] == 0 and a["timeout_ns"] == 7 * 10 ** 9
    assert a["table"].shape == (ws.capacity, 2) and a["offsets"].shape == (5,) and a["trace"] is None
    assert (a["save_x"] is not None) == grad and (grad or a["save_gu"] is None)
    if grad:
        assert a["save_x"].shape == (ws.capacity, 1024) and a["save_gu"].shape == (ws.capacity, 1024)
    assert kw == {"pairs": mkb.use_pairs(resolved)}
    assert ws.timeout_s == 7.0


# ---- GPU -------------------------------------------------------------------------------------

def _leaves(case, rank):
    from .gpu_cases import leaves

    return leaves(case, rank)


def _run(case, ep_groups, config, streams=None, backward=True, split=0):
    """Forward (and backward) of every rank with the megakernel (see gpu_cases.run_case)."""
    from .gpu_cases import run_case

    # A wait that never ends shows up as a MoKTimeoutError naming the site after 20 s.
    config = dataclasses.replace(config, timeout_s=min(config.timeout_s, 20.0))
    return run_case(case, ep_groups, config, "megakernel", streams, backward, split)


def _poison_workspaces_and_rings():
    """NaN into every combine slot and every ring buffer: a slot or ring row the kernel reads
    without having written it in this call shows up as NaN."""
    from megatron_mok.functional.workspace import _every_workspace

    for ws in list(_every_workspace):
        ws.slots.fill_(float("nan"))
        for ring in mkb._rings.get(ws, {}).values():
            ring.x.fill_(float("nan"))
            ring.h.fill_(float("nan"))
            ring.w.fill_(float("nan"))


def _check_against_oracle(case, results, label, with_grads=True):
    from .gpu_cases import check_against_oracle

    check_against_oracle(case, results, label, with_grads)


def _assert_equal_runs(a, b, label):
    from .gpu_cases import assert_equal_runs

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
    from .gpu_cases import gpu_case

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

    from .gpu_cases import gpu_case

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


@pytest.mark.gpu
def test_forward_without_grad_launches_two_comm_ctas_fewer(monkeypatch):
    """4 comm CTAs without grad, 6 with (the trace's CTA records say which CTAs took the comm
    role); the same bits either way."""
    from .gpu_cases import gpu_case

    case = gpu_case(21, [2048], 1024, 512, 64, 8, "uniform")
    x, ids, w = case.x[0], case.ids[0], case.weights[0]
    monkeypatch.setenv(mkb.TRACE_ENV, "1")

    def comm_ctas_of_last_launch():
        torch.cuda.synchronize()
        trace = mkb.last_trace()
        records = trace["records"].cpu().numpy()
        meta = records[:, 4]
        ctas = (records[:, 0] > 0) & ((meta & 0xFF) == 5)
        return int(((meta[ctas] >> 8) & 0xFF).sum()), trace["comm_ctas"]

    with torch.no_grad():
        y_no_grad = mok_moe(x, ids, w, case.fc1_all, case.fc2_all, config=MoKConfig(), backend="megakernel")
    assert comm_ctas_of_last_launch() == (4, 4)
    y_grad = mok_moe(x.clone().requires_grad_(True), ids, w, case.fc1_all, case.fc2_all, config=MoKConfig(),
                     backend="megakernel")
    assert comm_ctas_of_last_launch() == (6, 6)
    assert torch.equal(y_no_grad, y_grad.detach())
    with torch.no_grad():
        mok_moe(x, ids, w, case.fc1_all, case.fc2_all, config=MoKConfig(comm_sms_forward=10), backend="megakernel")
    assert comm_ctas_of_last_launch() == (10, 10)


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
    from .gpu_cases import gpu_case

    seed, tokens, H, I, L, K, routing, config = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    group = LocalEPGroup(len(tokens))
    config = MoKConfig(max_tokens_per_rank=max(max(tokens), 1), timeout_s=20.0, comm_sms_forward=config.comm_sms_forward,
                       minibatch_rows=config.minibatch_rows, ring_rows=config.ring_rows)
    first = _run(case, group.ranks, config, group.streams)
    _poison_workspaces_and_rings()
    second = _run(case, group.ranks, config, group.streams)
    _check_against_oracle(case, second, f"virtual {spec[:7]}")
    _assert_equal_runs(first, second, f"two runs of {spec[:7]}")


def _every_ring():
    from megatron_mok.functional.workspace import _every_workspace

    return [ring for ws in list(_every_workspace) for ring in mkb._rings.get(ws, {}).values()]


def _early_units_taken():
    """The largest count of units the early slot sum took in a launch since
    _forget_early_units (each launch resets its ring's counters first)."""
    return max(int(ring.counters[mk.EARLY_NEXT_WORD]) for ring in _every_ring())


def _forget_early_units():
    for ring in _every_ring():
        ring.counters[mk.EARLY_NEXT_WORD] = -1


EARLY_CASES = [(141, [3000], 2048, 1024, 12, 8, "zipf", SMALL_RING),
               (142, [2500, 1700], 1024, 512, 6, 4, "uniform", MoKConfig(minibatch_rows=256, ring_rows=512)),
               (143, [640], 1024, 512, 8, 3, "unused", SMALL_RING)]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", EARLY_CASES, ids=lambda s: f"P{len(s[1])}-L{s[4]}-k{s[5]}-{s[6]}")
def test_megakernel_early_sum_matches_the_final_sum(spec, monkeypatch):
    """The early slot sum (tokens whose rows are all home before the last minibatches run) made
    to take every unit it may (MOK_MEGAKERNEL_EARLY_SUM=2), waiting out the last three, two or one
    minibatches, with NaN in every slot and ring row before the call: the oracle's numbers and the
    default launch's bits (the early sum is off by default); and it did take units. Then the early
    sum as it runs when turned on (=1: early warps stop at the combine-done flags, the final sum
    skips what they took) and off: the oracle's numbers, the same bits."""
    from .gpu_cases import gpu_case

    seed, tokens, H, I, L, K, routing, config = spec
    case = gpu_case(seed, tokens, H, I, L, K, routing)
    group = LocalEPGroup(len(tokens)) if len(tokens) > 1 else None
    config = MoKConfig(max_tokens_per_rank=max(tokens), timeout_s=20.0, minibatch_rows=config.minibatch_rows,
                       ring_rows=config.ring_rows)
    ranks, streams = (group.ranks, group.streams) if group else ([None], None)
    default = _run(case, ranks, config, streams)
    results = {}
    for mode, late in (("2", "3"), ("2", "2"), ("2", "1"), ("1", "3"), ("0", "3")):
        monkeypatch.setenv("MOK_MEGAKERNEL_EARLY_SUM", mode)
        monkeypatch.setenv("MOK_MEGAKERNEL_LATE_MINIBATCHES", late)
        _poison_workspaces_and_rings()
        _forget_early_units()
        results[f"{mode}, {late} late minibatches"] = res = _run(case, ranks, config, streams, backward=False)
        if mode == "2":
            assert _early_units_taken() >= max(tokens) * mk.SUM_PARTS, "the early sum took no units"
        if mode != "0":
            _check_against_oracle(case, res, f"early sum mode {mode}, {late} late: {spec[:7]}", with_grads=False)
    for mode, res in results.items():
        for r, (got, want) in enumerate(zip(res, default)):
            assert torch.equal(got[0], want[0]), f"early sum {mode}: rank {r} y differs from the default's"


def _all_to_expert_zero(case):
    """Every token of every rank sends its slot 0 to expert 0 (rank 0's first expert)."""
    for ids in case.ids:
        ids[:, 0] = 0
        if ids.shape[1] > 1:  # keep the slots distinct per token
            ids[:, 1:] = torch.where(ids[:, 1:] == 0, torch.ones_like(ids[:, 1:]), ids[:, 1:])
    return case


@pytest.mark.gpu
def test_megakernel_one_hot_expert_through_a_small_ring():
    from .gpu_cases import gpu_case

    # 3000 rows to expert 0 (24 row blocks) through a ring of 2 slots; then the same on 2 virtual ranks.
    case = _all_to_expert_zero(gpu_case(121, [3000], 1024, 512, 4, 2, "uniform"))
    _check_against_oracle(case, _run(case, [None], SMALL_RING), "hot expert, P=1")
    case2 = _all_to_expert_zero(gpu_case(122, [2000, 2000], 1024, 512, 2, 2, "uniform"))
    group = LocalEPGroup(2)
    config = MoKConfig(max_tokens_per_rank=2000, timeout_s=20.0, comm_sms_forward=2, minibatch_rows=128, ring_rows=256)
    _check_against_oracle(case2, _run(case2, group.ranks, config, group.streams), "hot expert, 2 virtual ranks")


COPIES_ENV = "MOK_MEGAKERNEL_COPIES"
"""Set to "registers", the comm CTAs copy rows through registers instead of TMA bulk copies."""
SWITCHES_OFF = {"MOK_MEGAKERNEL_HALF_A": "0", "MOK_MEGAKERNEL_FIRST_PULL": "0", "MOK_MEGAKERNEL_PAIRS": "0",
                "MOK_MEGAKERNEL_BLOCK_ORDER": "0", "MOK_MEGAKERNEL_COMM_JOINS": "0",
                "MOK_MEGAKERNEL_PULL_HELPERS": "0",
                "MOK_MEGAKERNEL_FIRST_GROUP": "0", "MOK_MEGAKERNEL_COMM_PULL_LIMIT": "2147483647",
                "MOK_MEGAKERNEL_RELAXED_POLLS": "0", "MOK_MEGAKERNEL_GROUP_BLOCKS": "16"}
"""The launch's other comparison switches, off (and the group size off its default): every tile
loads all 128 rows of A; no first
pulls in parts (the comm CTAs pull every block); single CTAs instead of clusters of two sharing
the weight tiles; every expert's blocks in layout order instead of zigzag; the comm CTAs stay
off the compute queue; the compute CTAs' idle producer warps do not pull; compute CTAs pull
parts of the whole first minibatch and the helpers none; the comm CTAs serve the whole pull queue before they join the compute queue; every try of a
wait acquires (instead of relaxed tries and one acquire); groups of 16 row blocks instead of 8."""
SETTINGS = [(2, 128, 256), (2, 256, 1024), (4, 512, 1024), (3, 384, 1536), (None, None, None)]


@pytest.mark.gpu
def test_megakernel_runs_in_clusters_of_two_on_every_sm(monkeypatch):
    """Pair mode, when asked for, keeps every SM of an H100/H200 (every CTA in a cluster of two);
    not with an odd comm CTA count or grid; the environment switch overrides the request."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mk.launch_shape(10, 0, pairs=True) == (sms, True)
    assert mk.launch_shape(10, 0, pairs=False) == (sms, False)
    assert mk.launch_shape(2, 64, pairs=True) == (64, True)
    assert mk.launch_shape(3, 0, pairs=True) == (sms, False)
    assert mk.launch_shape(10, 65, pairs=True) == (65, False)
    monkeypatch.setenv("MOK_MEGAKERNEL_PAIRS", "0")
    assert mk.launch_shape(10, 0, pairs=True) == (sms, False)
    monkeypatch.setenv("MOK_MEGAKERNEL_PAIRS", "1")
    assert mk.launch_shape(10, 0, pairs=False) == (sms, True)
    with pytest.raises(mk.MegakernelArgumentError):
        mk.launch_shape(10, 10)  # no CTA left to compute


@pytest.mark.gpu
@pytest.mark.parametrize("virtual", [False, True], ids=["P1", "P2-virtual"])
def test_megakernel_is_bitwise_identical_across_settings(virtual, monkeypatch):
    from .gpu_cases import gpu_case

    tokens = [2500, 1800] if virtual else [3000]
    case = gpu_case(131, tokens, 2048, 1024, 6, 4, "zipf")
    group = LocalEPGroup(len(tokens)) if virtual else None
    results = []
    # Pair mode forced on (the default, but not the environment's choice here); odd comm CTA
    # counts (3) still run single CTAs, so the settings compare both.
    monkeypatch.setenv("MOK_MEGAKERNEL_PAIRS", "1")
    for comm, mb, ring in SETTINGS:
        config = MoKConfig(comm_sms_forward=comm, minibatch_rows=mb, ring_rows=ring, timeout_s=20.0,
                           max_tokens_per_rank=max(tokens))
        groups = group.ranks if virtual else [None]
        results.append(_run(case, groups, config, group.streams if virtual else None))
    # The comm CTAs' register copies instead of TMA bulk copies: the same bits.
    monkeypatch.setenv(COPIES_ENV, "registers")
    config = MoKConfig(comm_sms_forward=3, minibatch_rows=256, ring_rows=512, timeout_s=20.0,
                       max_tokens_per_rank=max(tokens))
    results.append(_run(case, group.ranks if virtual else [None], config, group.streams if virtual else None))
    monkeypatch.delenv(COPIES_ENV)
    for name, value in SWITCHES_OFF.items():
        monkeypatch.setenv(name, value)
    results.append(_run(case, group.ranks if virtual else [None], config, group.streams if virtual else None))
    _check_against_oracle(case, results[0], f"settings {SETTINGS[0]}")
    for setting, res in zip(SETTINGS[1:] + ["register copies",
                                            "half-A loads, first pulls, pairs, zigzag, comm joining, pull helpers, "
                                            "first group, comm pull limit, relaxed polls off, groups of 16"],
                            results[1:]):
        _assert_equal_runs(results[0], res, f"settings {SETTINGS[0]} vs {setting}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["megakernel", "cuda"])
@pytest.mark.parametrize("virtual,split", [(False, 1), (False, 5), (True, 2)], ids=["P1-last", "P1-five", "P2-two"])
def test_weight_segments_are_bitwise_the_stacked_weights(backend, virtual, split):
    """Weights passed as two segments (the last experts in tensors of their own, as the fused
    shared expert is): the megakernel's second pair of weight maps and the cuda backend's
    launches per segment give the same bits as the stacked weights, gradients included."""
    from .gpu_cases import gpu_case, run_case

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
    from .gpu_cases import check_graph_replay

    check_graph_replay("megakernel", MoKConfig(minibatch_rows=256, ring_rows=512), seeds=(141, 142, 143))


@pytest.mark.gpu
def test_megakernel_timeout_names_the_missing_rank_and_returns_nan():
    from .gpu_cases import gpu_case

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
    x = torch.zeros(4096, 1024, dtype=torch.bfloat16, device="cuda")
    for shape in (MoEShape(4096, 1024, 2, 4, 512), MoEShape(8, 1024, 2, 4, 512)):
        assert backends.select_backend("auto", x, shape, MoKConfig(), 1) == "megakernel"
    assert backends.select_backend("auto", x, MoEShape(8, 1024, 2, 4, 512), MoKConfig(tile_rows=64), 1) == "cuda"


# ------------------------------------------------------------------------------------------
# Two processes on two GPUs: the real peer-memory path.

SWEEP_P2 = [
    (161, [4096, 4096], 7168, 2048, 6, 8, "uniform"),
    (162, [3000, 1234], 2048, 1024, 16, 4, "zipf"),
    (163, [777, 1], 1024, 512, 3, 1, "hot"),
    (164, [512, 513], 1024, 512, 12, 8, "empty"),
]
P2_SETTINGS = [MoKConfig(), MoKConfig(comm_sms_forward=2, minibatch_rows=128, ring_rows=256),
               MoKConfig(comm_sms_forward=12, minibatch_rows=512, ring_rows=1536)]


def _p2_worker(rank, world, specs):
    import torch.distributed as dist

    from .gpu_cases import check_rank_runs, gpu_case

    group = dist.group.WORLD
    for spec in specs:
        seed, tokens, H, I, L, K, routing = spec
        case = gpu_case(seed, tokens, H, I, L, K, routing)
        leaves = _leaves(case, rank)
        runs = []
        for n, config in enumerate(P2_SETTINGS + P2_SETTINGS[:2]):
            # The last run repeats the second setting with register copies (the same bits).
            if n == len(P2_SETTINGS) + 1:
                os.environ[COPIES_ENV] = "registers"
            config = MoKConfig(max_tokens_per_rank=4096, timeout_s=20.0, comm_sms_forward=config.comm_sms_forward,
                               minibatch_rows=config.minibatch_rows, ring_rows=config.ring_rows)
            x, w, fc1, fc2 = (t.detach().clone().requires_grad_() for t in leaves)
            y = mok_moe(x, case.ids[rank], w, fc1, fc2, ep_group=group, config=config, backend="megakernel")
            y.backward(case.dy[rank])
            torch.cuda.synchronize()
            check_errors()
            runs.append((y.detach(), x.grad, w.grad, fc1.grad, fc2.grad))
            os.environ.pop(COPIES_ENV, None)
        check_rank_runs(case, rank, runs, f"P=2 {spec}")


@pytest.mark.gpu2
def test_megakernel_two_gpus_match_oracle_and_are_bitwise_stable():
    run_ranks(_p2_worker, 2, SWEEP_P2, backend="nccl")


def _timeline_script(monkeypatch):
    """scripts/megakernel_timeline.py as a module (it sets MOK_MEGAKERNEL_TRACE on import; the
    monkeypatch puts it back)."""
    import importlib.util
    from pathlib import Path

    monkeypatch.setenv("MOK_MEGAKERNEL_TRACE", os.environ.get("MOK_MEGAKERNEL_TRACE", "0"))
    path = Path(__file__).resolve().parents[2] / "scripts" / "megakernel_timeline.py"
    spec = importlib.util.spec_from_file_location("megakernel_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timeline_clock_summary_takes_medians_per_gpu_after_the_first_fifth(monkeypatch):
    tl = _timeline_script(monkeypatch)
    # GPU 0: five samples, the first (settling) dropped; GPU 1: clocks 1500, 1400, 1300, 1200,
    # 1100 after its first; a line nvidia-smi prints for an unsupported field is skipped.
    lines = ["0, 1980, 300.5", "0, 1500, 690", "0, 1510, 700", "0, 1490, 699", "0, 1520, 701",
             "1, 1980, 200", "1, 1500, 650", "1, 1400, 660", "1, 1300, 670", "1, 1200, 680", "1, 1100, 690",
             "1, [N/A], [N/A]"]
    summary = tl.clock_summary("\n".join(lines))
    assert summary[0] == (1505.0, 700.0 - 0.5, 4)
    assert summary[1] == (1300.0, 670.0, 5)
    assert tl.clock_summary("") == {}


def test_timeline_tile_boundaries_measure_from_the_previous_tile_end(monkeypatch):
    # Two compute CTAs (a pair: CTA 0 leads), each running fc1, fc2, fc2 back to back; times in
    # ms as decode() gives them. Next tile taken 3 us before / input 1 us after / MMAs 2 us after
    # the previous tile's end on the leader, shifted by 1 us on the follower.
    tl = _timeline_script(monkeypatch)
    rows = {k: [] for k in ("kind", "block", "col", "cta", "take", "ready", "start", "done")}
    for cta, shift in ((0, 0.0), (1, 0.001)):
        end = 0.0
        for kind in (1, 2, 2):
            for name, value in (("kind", kind), ("block", 0), ("col", 0), ("cta", cta),
                                ("take", end - 0.003 + shift), ("ready", end + 0.001 + shift),
                                ("start", end + 0.002 + shift), ("done", end + 0.002 + shift + 0.05)):
                rows[name].append(value)
            end = rows["done"][-1]
    items = {k: np.array(v) for k, v in rows.items()}
    lines = tl.tile_boundaries(items, pairs=True)
    assert len(lines) == 4, lines  # (leader, follower) x (fc1 -> fc2, fc2 -> fc2)
    assert lines[0].startswith("  leader fc1 -> fc2 (n=1): next taken -3.00, input in +1.00, MMAs start +2.00")
    assert lines[3].startswith("  follower fc2 -> fc2 (n=1): next taken -2.00, input in +2.00, MMAs start +3.00")
    single = tl.tile_boundaries(items, pairs=False)
    assert [line.split(" (")[0] for line in single] == ["  fc1 -> fc2", "  fc2 -> fc2"]
    assert "(n=2)" in single[0] and "(n=2)" in single[1]


def test_timeline_maps_queue_blocks_to_layout_rows_and_their_homes(monkeypatch):
    # Two local experts: 300 rows (100 from rank 0, 200 from rank 1) and 130 rows (all from
    # rank 0), seen from rank 0. Layout blocks: expert 0 -> 0, 1, 2 (rows 0-299), expert 1 -> 3, 4.
    tl = _timeline_script(monkeypatch)
    by_source = np.array([[100, 130], [200, 0]])
    real = tl.block_real_rows(by_source.sum(axis=0), 5)
    assert real.tolist() == [128, 128, 44, 128, 2]
    # Rows [100, 300) of expert 0 come from rank 1: 28 of block 0, all of block 1, 44 of block 2.
    assert tl.block_remote_rows(by_source, 0, 5).tolist() == [28, 128, 44, 0, 0]
    assert tl.block_remote_rows(by_source, 1, 5).tolist() == [100, 0, 0, 128, 2]


def test_block_orders_permute_each_experts_blocks(use_lib, monkeypatch):
    """mok_megakernel_layout_blocks (the kernel's own layout_block, plan.cuh): which layout block
    each queue block stands for."""
    # Layout order, and zigzag: each expert's blocks from the front and the back in turn.
    assert mk.layout_blocks([300, 130], "layout") == [0, 1, 2, 3, 4]
    assert mk.layout_blocks([300, 130], "zigzag") == [0, 2, 1, 3, 4]
    assert mk.layout_blocks([300, 0, 600], "zigzag") == [0, 2, 1, 3, 7, 4, 6, 5]
    # The launches' order follows MOK_MEGAKERNEL_BLOCK_ORDER, zigzag by default.
    monkeypatch.delenv("MOK_MEGAKERNEL_BLOCK_ORDER", raising=False)
    assert mk.layout_blocks([300, 130]) == [0, 2, 1, 3, 4]
    monkeypatch.setenv("MOK_MEGAKERNEL_BLOCK_ORDER", "0")
    assert mk.layout_blocks([300, 130]) == [0, 1, 2, 3, 4]
    rng = random.Random(5)
    for _ in range(200):
        counts = [rng.choice([0, 1, 43, 128, 300, 683, 700, 5500]) for _ in range(rng.randint(1, 12))]
        starts = np.concatenate([[0], np.cumsum([(c + 127) // 128 for c in counts])]).tolist()
        out = mk.layout_blocks(counts, "zigzag")
        for first, end in zip(starts[:-1], starts[1:]):
            # A permutation of the expert's blocks: front, back, front + 1, back - 1, ...
            n = end - first
            assert out[first:end] == [first + (j // 2 if j % 2 == 0 else n - 1 - j // 2) for j in range(n)], counts
    with pytest.raises(mk.MegakernelArgumentError):
        mk.layout_blocks([-1], "zigzag")
    with pytest.raises(ValueError, match="block order 'diagonal'"):
        mk.layout_blocks([300], "diagonal")


def test_timeline_counts_joining_comm_ctas_apart(monkeypatch):
    # CTA 0 is a comm CTA (role 1) that ran one fc2 tile after its pulls; CTA 1 a compute CTA
    # with an fc1 and an fc2 tile. The busy share and stalls are the compute CTA's alone.
    tl = _timeline_script(monkeypatch)
    items = dict(kind=np.array([1, 2, 2, 3]), block=np.array([0, 0, 1, 1]), col=np.zeros(4, dtype=np.int64),
                 cta=np.array([1, 1, 0, 0]), take=np.array([0.01, 0.1, 0.5, 0.0]),
                 ready=np.array([0.01, 0.1, 0.5, 0.0]), start=np.array([0.02, 0.11, 0.5, 0.0]),
                 done=np.array([0.1, 0.14, 0.53, 0.05]))
    ctas = dict(role=np.array([1, 0]), cta=np.array([0, 1]), start=np.zeros(2), queue_end=np.array([0.5, 0.2]),
                combine=np.array([0.6, 0.6]), end=np.array([0.7, 0.7]))
    lines = tl.summarize(items, ctas, H=256, I=128, mb_rows=256, label="joined")
    assert any(line.startswith("comm CTAs that joined the compute queue: 1, 1 tiles from 0.500 ms") for line in lines)
    busy = [line for line in lines if line.startswith("compute CTAs")]
    # CTA 1: tiles 0.02-0.10 and 0.11-0.14 of its window 0-0.14 -> 110 / 140 us busy.
    assert busy and busy[0].startswith("compute CTAs 1: busy 78.6%"), busy


@pytest.mark.parametrize("bench", ["peer_store_bench", "slot_sum_bench"])
def test_standalone_bench_compiles(bench):
    """The standalone measurements in scripts/ (peer_store_bench.cu: fc2's push store pattern,
    two GPUs; slot_sum_bench.cu: the megakernel's own slot sum and variants of it, one GPU)
    still build with the toolkit CI has, against the headers they measure."""
    import subprocess
    import tempfile
    from pathlib import Path

    from megatron_mok import _build

    nvcc = _build.find_nvcc()
    if nvcc is None:
        pytest.skip(f"nvcc not found: cannot compile scripts/{bench}.cu")
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / bench
        res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                              f"-I{root / 'csrc' / 'include'}", str(root / "scripts" / f"{bench}.cu"),
                              "-o", str(out)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-2000:]
        assert out.stat().st_size > 0


def test_timeline_bound_times_each_side_in_blocks_after_warmup(monkeypatch):
    # 2 x `warmup` alternating untimed calls, then blocks A B B A B A A B, each `warmup` untimed
    # calls and then `rounds` timed ones; the medians are the calls' own times (12 ms and 3 ms
    # here, on the CPU clock).
    tl = _timeline_script(monkeypatch)
    monkeypatch.setattr(tl, "check_errors", lambda: None)
    order = []

    def sleeper(name, ms):
        def call():
            order.append(name)
            time.sleep(ms / 1e3)
        return call
    mk_ms, mm_ms = tl.bound_timing(sleeper("mk", 12.0), sleeper("mm", 3.0), rounds=3, warmup=2, distributed=False,
                                   rank=1, label="test", device=torch.device("cpu"))
    blocks = {"A": ["mk"] * 5, "B": ["mm"] * 5}
    assert order == ["mk", "mm"] * 2 + sum((blocks[c] for c in "ABBABAAB"), [])
    assert 12.0 <= mk_ms < 12.0 + 50 and 3.0 <= mm_ms < 3.0 + 50 and mk_ms > mm_ms



def test_host_profile_times_steps_at_start_or_return_and_restores_them():
    # scripts/host_profile.py --to-launch's instrument: a step marks the clock when its function
    # starts or returns, a path this version lacks is skipped, and everything is put back
    # (a staticmethod as a staticmethod).
    import importlib.util
    from pathlib import Path

    import megatron_mok.functional as functional

    path = Path(__file__).resolve().parents[2] / "scripts" / "host_profile.py"
    spec = importlib.util.spec_from_file_location("host_profile", path)
    hp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hp)
    steps = [("checks", "functional.check_inputs", "end"),
             ("forward", "functional.megakernel_backend._MegakernelMoE.forward", "start"),
             ("gone", "functional.no_such_step", "end")]
    before = (functional.check_inputs, mkb._MegakernelMoE.__dict__["forward"])
    ticks = iter(range(100))
    with hp.timed_steps(steps, lambda: next(ticks)) as marks:
        assert isinstance(mkb._MegakernelMoE.__dict__["forward"], staticmethod)
        x = torch.zeros(4, 8)
        functional.check_inputs(x, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2),
                                torch.zeros(1, 6, 8), torch.zeros(1, 8, 3))
        with pytest.raises(MoKInputError):  # fails inside: a step that does not return is not marked
            functional.check_inputs(x, None, None, None, None)
        with pytest.raises(AttributeError):  # marked on entry, then fails on the fake call
            mkb._MegakernelMoE.forward(None, x, None, None, None, None, None)
    assert marks == {"checks": [0], "forward": [1], "gone": []}
    assert (functional.check_inputs, mkb._MegakernelMoE.__dict__["forward"]) == before
