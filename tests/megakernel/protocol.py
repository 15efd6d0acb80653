"""A CPU replica of the forward megakernel's protocol (csrc/include/mok/megakernel/plan.cuh,
crews.cuh, kernel.cuh), for the tests that check it cannot deadlock.

The work plan itself comes from the library (``megatron_mok.ops.megakernel.plan_item``, the
kernel's own functions); :func:`simulate` hands its queues to concurrent workers in random
interleavings and replays the counters the kernel waits on and bumps.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional

from megatron_mok.ops import megakernel as mk

QUEUE_NAMES = ("compute", "pull", "first_pull")


def first_blocks(n_blocks: int, mb: int, slots: int) -> int:
    """Blocks the kernel pulls in parts when it starts: those of its first minibatches (a valid
    ring holds them)."""
    return min(mk.constants().first_pull_minibatches * mb, slots, n_blocks)


def units(n_blocks: int, mb: int, pairs: bool) -> int:
    """Tile units of the layout: blocks, or in pair mode pairs of blocks within a minibatch."""
    if not pairs:
        return n_blocks
    return sum((min(mb, n_blocks - m) + 1) // 2 for m in range(0, n_blocks, mb))


def queue_length(queue: str, n_blocks: int, mb: int, slots: int, n1: int, n2: int, pairs: bool = False) -> int:
    """Items of a queue of the plan, counted from the documented layout of the queues."""
    nf = first_blocks(n_blocks, mb, slots)
    return {"compute": units(n_blocks, mb, pairs) * (n1 + n2), "first_pull": nf * mk.constants().first_pull_parts,
            "pull": n_blocks - nf}[queue]


def plan_queue(queue: str, n_blocks: int, mb: int, slots: int, n1: int, n2: int, pairs: bool = False,
               group: int = 8) -> List[tuple]:
    """Every item of a queue of the library's plan (``mk.plan_item`` tuples), in order."""
    total = queue_length(queue, n_blocks, mb, slots, n1, n2, pairs)
    return [mk.plan_item(queue, i, n_blocks, mb, slots, n1, n2, pairs, group) for i in range(total)]


def pair_tiles(n_blocks: int, mb: int, slots: int, n1: int, n2: int, group: int = 8) -> List[List[tuple]]:
    """The pair-mode compute queue as [[tile of the first CTA, tile of the second (if any)]],
    each tile with the wait the single-CTA plan gives its block (the kernel's CTA of rank r waits
    for block + r exactly so). Asserts that the pair plan's wait is its first block's."""
    single = {item[:3]: item for item in plan_queue("compute", n_blocks, mb, slots, n1, n2, group=group)}
    out = []
    for kind, block, col, *wait in plan_queue("compute", n_blocks, mb, slots, n1, n2, pairs=True, group=group):
        assert tuple(wait) == single[(kind, block, col)][3:]
        second = mk.pair_partner(block, n_blocks, mb)
        out.append([single[(kind, block, col)]] + ([single[(kind, second, col)]] if second is not None else []))
    return out


def segments(items, mb: int) -> List[tuple]:
    """[(kind, minibatch)] of consecutive runs of items."""
    out = []
    for kind, block, *_ in items:
        key = (kind, block // mb)
        if not out or out[-1] != key:
            out.append(key)
    return out


def simulate(n_blocks: int, mb: int, slots: int, n1: int, n2: int, comm_workers: int, compute_workers: int,
             lookahead: int, seed: int, pairs: bool = False, stats: Optional[Dict[str, int]] = None,
             group: int = 8) -> Optional[str]:
    """Replay the kernel's protocol: workers take queue items in order, wait for the counter
    targets the plan gives, and bump the counters the kernel bumps. Returns None when every item
    ran, else a description of the deadlock. Asserts the dependencies and the slot ownership the
    targets are meant to enforce.

    As in the kernel (kernel.cuh, crews.cuh): every worker first serves the first-pull queue
    (parts of the first blocks), a comm worker until it is empty, a compute worker until the first
    group's parts are taken. Then every worker computes: its producer takes compute items in
    order and issues one once its inputs are in (up to ``lookahead`` issued and not yet
    consumed), its consumers finish them in order (an fc2 tile pushes its rows home itself; a slot
    is free once its block's fc2 tiles are done). A compute worker's pull helpers, once the first
    group's blocks have landed, take what is left of the first-pull queue, then the whole pull
    queue. With ``pairs``, a compute worker is a cluster of two CTAs that takes pair tiles: its
    loads go out once both blocks' inputs are in (each CTA's consumers wait for the weight box the
    other multicasts), and both tiles finish together. ``group``: row blocks of a group, the
    column sweep of the compute queue and the first pulls of the compute workers. ``stats``, a
    dict, gets the pulls ("help") and first-pull parts ("help_part") the helpers ran."""
    rng = random.Random(seed)
    parts = mk.constants().first_pull_parts
    queues = {q: plan_queue(q, n_blocks, mb, slots, n1, n2, group=group) for q in QUEUE_NAMES}
    # Compute items as lists of tiles: one tile, or the one or two tiles of a pair.
    queues["compute"] = (pair_tiles(n_blocks, mb, slots, n1, n2, group) if pairs else [[t] for t in queues["compute"]])
    nxt = {q: 0 for q in QUEUE_NAMES}
    nf = first_blocks(n_blocks, mb, slots)
    first_group = min(nf, mb, group)
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
            pulled = [("pull_part", b, j) for j in range(parts)] if b < nf else [("pull", b, 0)]
            need = {"fc1": pulled, "fc2": [("fc1", b, j) for j in range(n1)]}[kind]
            assert all(d in done for d in need), f"{kind} {b},{c} started before its inputs"

    def finish(item):
        kind, b, c = item[:3]
        done.add((kind, b, c))
        name, amount = bump[kind]
        counters[(name, b % slots)] = counters.get((name, b % slots), 0) + amount
        if kind == "fc2" and all(("fc2", b, j) in done for j in range(n2)):
            del owner[b % slots]

    helper_item = {w: None for w in range(compute_workers)}  # pull a compute worker's helpers hold
    producers = [None] * (compute_workers + comm_workers)  # item the TMA thread waits on
    issued = [[] for _ in range(compute_workers + comm_workers)]  # items whose loads are issued, in order
    joined = []  # comm workers now computing (producer index compute_workers + j)
    workers = [("comm", w) for w in range(comm_workers)] + [("compute", w) for w in range(compute_workers)]
    first = {wk: None for wk in workers}  # first-pull part a worker holds
    in_first = {wk: True for wk in workers}  # still serving the first-pull queue
    total = sum(len(q) for name, q in queues.items() if name != "compute") + n_blocks * (n1 + n2)
    while len(done) < total:
        actions = []
        for wk in workers:
            if not in_first[wk]:
                continue
            # Compute workers take parts of the first group's blocks only.
            limit = first_group * parts if wk[0] == "compute" else len(queues["first_pull"])
            if first[wk] is not None:
                if ready(first[wk]):
                    actions.append(("run_first", wk))
            elif nxt["first_pull"] < limit:
                actions.append(("take_first", wk))
            else:
                actions.append(("leave_first", wk))
        group_in = all(("pull_part", b, j) in done for b in range(first_group) for j in range(parts))
        for w in range(compute_workers):
            if in_first[("compute", w)] or not group_in:  # the helpers wait for the first group
                continue
            if helper_item[w] is not None:
                if ready(helper_item[w]):
                    actions.append(("run_help", w))
            elif nxt["first_pull"] < len(queues["first_pull"]):
                actions.append(("take_first_help", w))
            elif nxt["pull"] < len(queues["pull"]):
                actions.append(("take_pull", w))
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
            return (f"deadlock with {len(done)} of {total} items done: helpers hold {helper_item}, producers "
                    f"hold {producers}, counters {counters}")
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
            if w[0] == "comm":  # a comm CTA joins the compute CTAs after its first pulls
                joined.append(w[1])
        elif act == "take_first_help":
            helper_item[w] = queues["first_pull"][nxt["first_pull"]]
            nxt["first_pull"] += 1
        elif act == "take_pull":
            helper_item[w] = queues["pull"][nxt["pull"]]
            nxt["pull"] += 1
        elif act == "run_help":
            if stats is not None:
                key = "help_part" if helper_item[w][0] == "pull_part" else "help"
                stats[key] = stats.get(key, 0) + 1
            start(helper_item[w])
            finish(helper_item[w])
            helper_item[w] = None
        elif act == "take_compute":
            producers[w] = queues["compute"][nxt["compute"]]
            nxt["compute"] += 1
        elif act == "issue":
            for t in producers[w]:
                start(t)
            issued[w].append(producers[w])
            producers[w] = None
        else:
            for t in issued[w].pop(0):
                finish(t)
    assert not owner, f"slots still held at the end: {owner}"
    return None
