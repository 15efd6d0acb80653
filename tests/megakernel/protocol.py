"""A CPU replica of the forward megakernel's protocol (csrc/include/mok/megakernel/plan.cuh,
crews.cuh, kernel.cuh), for the tests that check it cannot deadlock, and of the backward
megakernel's plan (csrc/include/mok/megakernel/bwd_plan.cuh, docs/training.md section 2).

The work plan itself comes from the library (``megatron_mok.ops.megakernel.plan_item``, the
kernel's own functions); :func:`simulate` hands its queues to concurrent workers in random
interleavings and replays the counters the kernel waits on and bumps. :func:`simulate_backward`
does the same with the backward's plan (``mok_megakernel_backward_*`` through ctypes).
"""

from __future__ import annotations

import ctypes
import random
from typing import Dict, List, NamedTuple, Optional, Sequence

from megatron_mok.ops import megakernel as mk
from megatron_mok.ops.library import load_library

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


# ---- the backward megakernel's plan (bwd_plan.cuh) ----------------------------------------------

BWD_KINDS = {3: "pull", 6: "pull_part", 7: "R", 8: "D2", 9: "D1", 10: "W"}
"""Item kinds of the backward plan (bwd_plan.cuh; pulls keep the forward's numbers)."""
BWD_COUNTERS = ("dy_ready", "gu_ready", "dgu_ready", "d1_done", "unit_ready", "w_done", "carry_done")
"""The backward's counters by number: four per slot, two per unit, one per weight-gradient tile."""
BWD_ITEM_WORDS = 62
"""int32 words of an item record (mok_megakernel_backward_plan_item's out_len)."""
BWD_SIZES = ("compute", "pull", "first_pull", "units", "minibatches", "tiles_per_unit", "strips_per_unit",
             "first_blocks")

_i, _i64, _v = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


class BwdItem(NamedTuple):
    """An item of the backward plan: kind (BWD_KINDS' names), row block (W: its unit's last), column
    (part, strip), unit, W's first tile and tile count, waits [(counter name, index, target)] and
    signals [(counter name, index, amount)]."""

    kind: str
    block: int
    col: int
    unit: int
    first_tile: int
    tiles: int
    waits: tuple
    signals: tuple

    @property
    def key(self) -> tuple:
        """(kind, block or unit, column): what identifies the item."""
        return (self.kind, self.unit if self.kind == "W" else self.block, self.col)


class BackwardPlan(NamedTuple):
    """The library's tables of a backward plan (int32 array) and the sizes it reports."""

    tables: object
    words: int
    sizes: Dict[str, int]


def backward_exports():
    """The library and its backward-plan exports."""
    lib = load_library()
    return lib, {
        "tables": lib.function("mok_megakernel_backward_tables", _i,
                               [_v, _i, _i, _i, _i, _i, _i, _i, _i, _i, _i, _v, _i64, _v]),
        "sizes": lib.function("mok_megakernel_backward_plan_sizes", _i, [_v, _i64, _v]),
        "item": lib.function("mok_megakernel_backward_plan_item", _i, [_i, _i, _v, _i64, _v, _i]),
        "ring_rows": lib.function("mok_megakernel_training_ring_rows_of", _i, [_v, _i, _i64, _v, _v, _i64]),
        "counters": lib.function("mok_megakernel_backward_counter_layout", _i, [_i, _i, _i, _i, _i, _i, _i, _v, _i]),
    }


class CounterLayout(NamedTuple):
    """The backward's counter buffer (mok_megakernel_backward_counter_layout): each counter's first
    word and length by name, the plan tables' first word, the buffer's words."""

    base: Dict[str, int]
    length: Dict[str, int]
    tables: int
    words: int


def backward_counter_layout(slots: int, max_blocks: int, L: int, unit: int, mb: int, h_cols: int,
                            i_cols: int) -> CounterLayout:
    """The library's counter buffer layout for these sizes."""
    lib, fns = backward_exports()
    n = len(BWD_COUNTERS)
    out = (ctypes.c_int64 * (2 * n + 2))()
    _bwd_error(lib, fns["counters"](slots, max_blocks, L, unit, mb, h_cols, i_cols, out, 2 * n + 2),
               f"counter layout {(slots, max_blocks, L, unit, mb, h_cols, i_cols)}")
    return CounterLayout(dict(zip(BWD_COUNTERS, out[:n])), dict(zip(BWD_COUNTERS, out[n:2 * n])), out[2 * n],
                         out[2 * n + 1])


def _bwd_error(lib, code: int, what: str) -> None:
    """Raise mk.MegakernelArgumentError naming ``what`` when ``code`` is not MOK_OK."""
    if code != 0:
        raise mk.MegakernelArgumentError(f"{what}: {lib._dll.mok_error_string(code).decode()}")


def backward_plan(expert_blocks: Sequence[int], mb: int, slots: int, unit: int, n_keep: int, h_cols: int,
                  i_cols: int, strip: int = 4, group: int = 8, pairs: bool = False) -> BackwardPlan:
    """The library's backward plan for experts of ``expert_blocks`` row blocks (the kernel's
    tables, built by mok_megakernel_backward_tables, in clusters of two with ``pairs``), and its
    queue sizes."""
    lib, fns = backward_exports()
    blocks = (ctypes.c_int32 * max(len(expert_blocks), 1))(*[int(b) for b in expert_blocks])
    args = (blocks, len(expert_blocks), mb, slots, unit, n_keep, h_cols, i_cols, strip, group, int(pairs))
    build = fns["tables"]
    need = ctypes.c_int64()
    _bwd_error(lib, build(*args, None, 0, ctypes.byref(need)), f"backward tables {args[2:]}")
    tables = (ctypes.c_int32 * need.value)()
    _bwd_error(lib, build(*args, tables, need.value, ctypes.byref(need)), "backward tables")
    out = (ctypes.c_int64 * len(BWD_SIZES))()
    _bwd_error(lib, fns["sizes"](tables, need.value, out), "backward plan sizes")
    return BackwardPlan(tables, need.value, dict(zip(BWD_SIZES, (int(v) for v in out))))


def backward_item(plan: BackwardPlan, queue: str, index: int) -> BwdItem:
    """Item ``index`` of ``queue`` ("compute", "pull", "first_pull") of the library's backward plan."""
    lib, fns = backward_exports()
    out = (ctypes.c_int32 * BWD_ITEM_WORDS)()
    _bwd_error(lib, fns["item"](mk.QUEUES[queue], index, plan.tables, plan.words, out, BWD_ITEM_WORDS),
               f"backward plan item {queue} {index}")
    kind, block, col, unit, first_tile, tiles, nw, ns = out[:8]
    trip = [tuple(out[8 + 3 * i:11 + 3 * i]) for i in range(nw + ns)]
    waits = tuple((BWD_COUNTERS[c], i, t) for c, i, t in trip[:nw])
    signals = tuple((BWD_COUNTERS[c], i, a) for c, i, a in trip[nw:])
    return BwdItem(BWD_KINDS[kind], block, col, unit, first_tile, tiles, waits, signals)


def backward_queue(plan: BackwardPlan, queue: str) -> List[BwdItem]:
    """Every item of a queue of the library's backward plan, in order."""
    return [backward_item(plan, queue, i) for i in range(plan.sizes[queue])]


def backward_units(expert_blocks: Sequence[int], unit: int) -> List[range]:
    """The units of the layout, computed here (not by the library): each expert's blocks in runs of
    ``unit`` blocks, in queue order, as ranges of blocks."""
    out, first = [], 0
    for n in expert_blocks:
        out += [range(first + s, min(first + s + unit, first + n)) for s in range(0, n, unit)]
        first += n
    return out


def backward_strips(h_cols: int, i_cols: int, strip: int) -> List[range]:
    """The W strips of a unit as ranges of weight-gradient tiles, computed here: dW1 (4 i_cols
    m-blocks by h_cols n-blocks), then dW2 (2 h_cols by i_cols), n-block by n-block, m-strips of
    up to ``strip`` tiles inside; tile numbers n * m_blocks + m, dW2's after dW1's."""
    out, base = [], 0
    for mblocks, nblocks in ((4 * i_cols, h_cols), (2 * h_cols, i_cols)):
        for n in range(nblocks):
            out += [range(base + n * mblocks + m, base + n * mblocks + min(m + strip, mblocks))
                    for m in range(0, mblocks, strip)]
        base += mblocks * nblocks
    return out


def backward_expected_items(expert_blocks: Sequence[int], unit: int, n_keep: int, h_cols: int,
                            i_cols: int, strip: int) -> set:
    """Keys of every compute item the backward must run, from docs/training.md 2.2 (not from the
    library): R per replayed block, D2 and D1 per block, W per strip of each unit."""
    n = sum(expert_blocks)
    keys = {("D2", b, c) for b in range(n) for c in range(i_cols)}
    keys |= {("D1", b, c) for b in range(n) for c in range(h_cols)}
    keys |= {("R", b, c) for b in range(n_keep, n) for c in range(2 * i_cols)}
    strips = len(backward_strips(h_cols, i_cols, strip))
    keys |= {("W", u, j) for u in range(len(backward_units(expert_blocks, unit))) for j in range(strips)}
    return keys


def backward_pair_partner(block: int, n_blocks: int, mb: int) -> Optional[int]:
    """The second block of the backward pair tile whose first block is ``block``, computed here:
    block + 1 when it lies in the same minibatch (every sweep's pairs start at an even offset from
    a start inside the minibatch and run to its end), else None."""
    end = min((block // mb + 1) * mb, n_blocks)
    return block + 1 if block + 1 < end else None


def backward_pair_tiles(expert_blocks: Sequence[int], mb: int, slots: int, unit: int, n_keep: int, h_cols: int,
                        i_cols: int, strip: int = 4, group: int = 8) -> List[List[BwdItem]]:
    """The pair-mode compute queue of the library as [[the tiles the cluster runs]]: for R, D2 and
    D1 the single-CTA plan's items of the pair's first block and (if any) its second, for W the
    strip alone (both CTAs run it). Asserts that each pair item waits for and signals exactly what
    its tiles do, first block first."""
    args = (expert_blocks, mb, slots, unit, n_keep, h_cols, i_cols, strip, group)
    single = {it.key: it for it in backward_queue(backward_plan(*args), "compute")}
    n_blocks = sum(expert_blocks)
    out = []
    for it in backward_queue(backward_plan(*args, pairs=True), "compute"):
        tiles = [single[it.key]]
        second = None if it.kind == "W" else backward_pair_partner(it.block, n_blocks, mb)
        if second is not None:
            tiles.append(single[(it.kind, second, it.col)])
        assert it.waits == sum((t.waits for t in tiles), ()), (it, tiles)
        assert it.signals == sum((t.signals for t in tiles), ()), (it, tiles)
        assert it._replace(waits=(), signals=()) == tiles[0]._replace(waits=(), signals=()), (it, tiles[0])
        out.append(tiles)
    return out


def training_ring_rows_of(counts: Sequence[int], ring_rows: int):
    """The library's training-ring rows (mok_megakernel_training_ring_rows_of): (N_keep,
    [(first ring row, halves)] of every queue block)."""
    lib, fns = backward_exports()
    n_blocks = sum(-(-int(c) // 128) for c in counts)
    arr = (ctypes.c_int32 * max(len(counts), 1))(*[int(c) for c in counts])
    out = (ctypes.c_int32 * max(2 * n_blocks, 1))()
    keep = ctypes.c_int32()
    _bwd_error(lib, fns["ring_rows"](arr, len(counts), ring_rows, ctypes.byref(keep), out, 2 * n_blocks),
               f"training ring rows {list(counts)} {ring_rows}")
    return keep.value, [(out[2 * b], out[2 * b + 1]) for b in range(n_blocks)]


def simulate_backward(expert_blocks: Sequence[int], mb: int, slots: int, unit: int, n_keep: int, h_cols: int,
                      i_cols: int, comm_workers: int, compute_workers: int, lookahead: int, seed: int,
                      strip: int = 4, group: int = 8, stats: Optional[Dict[str, int]] = None,
                      pairs: bool = False) -> Optional[str]:
    """Replay the backward megakernel's protocol with the library's plan: workers take queue items
    in order, hold each until the counter targets of its waits are met, and bump the counters its
    signals name. Returns None when every item ran, else a description of the deadlock (no worker
    can move while items remain).

    Workers, as docs/training.md 2.3: comm workers serve the first-pull queue (parts of the first
    blocks) until it is empty, then compute. A compute worker's producer takes compute items in
    order and issues one once its waits are met (up to ``lookahead`` issued and not consumed);
    its consumers finish them in order; a D2 tile goes to the worker's offload crew, which has one
    staging buffer (a D2 or W tile is consumed only once the crew has emptied it) and signals
    dgu_ready and unit_ready when done. Each compute worker's pull helper takes the rest of the
    first-pull queue, then the pull queue, in order.

    Asserts, independently of the plan's waits (from what each item reads, docs/training.md 2.2):
    every item runs exactly once and only after its inputs are done (R: the block's pull; D2: the
    pull and, replayed, every R tile; D1: every D2 tile and its offload; W: the offloads of every
    D2 tile of its unit); R only for replayed blocks; a block's items only while its slot holds it;
    a slot pulled again only after its occupant's D1 tiles and every W tile of its unit; carrying
    units touch each tile's carry in unit order (a unit's W tile after the previous carrying
    unit's); every expected item ran. ``stats`` gets the pulls the helpers ran ("help").

    With ``pairs`` every worker is a cluster of two CTAs (docs/training.md 2.6): a comm cluster's
    CTAs pull parts each and join the compute queue together once the first-pull queue is empty;
    a compute cluster takes the pair plan's items (:func:`backward_pair_tiles`), issues one once
    the waits of both its tiles are met, and its consumers finish both together, each CTA's D2
    tile into that CTA's staging buffer (a W strip, whose tiles both CTAs store, needs both
    buffers empty); each CTA has its own offload crew and pull helper."""
    rng = random.Random(seed)
    plan = backward_plan(expert_blocks, mb, slots, unit, n_keep, h_cols, i_cols, strip, group)
    queues = {q: backward_queue(plan, q) for q in QUEUE_NAMES}
    # Compute items as lists of tiles: one, or the tiles of a pair item.
    queues["compute"] = (backward_pair_tiles(expert_blocks, mb, slots, unit, n_keep, h_cols, i_cols, strip, group)
                         if pairs else [[it] for it in queues["compute"]])
    width = 2 if pairs else 1
    n_blocks = sum(expert_blocks)
    parts = mk.constants().first_pull_parts
    units = backward_units(expert_blocks, unit)
    unit_of = {b: u for u, r in enumerate(units) for b in r}
    expert_units = []
    for n in expert_blocks:
        k = -(-n // unit)
        expert_units += [k] * k
    carry_rank, c = {}, 0
    for u, k in enumerate(expert_units):
        if k > 1:
            carry_rank[u], c = c, c + 1
    n_strips = len(backward_strips(h_cols, i_cols, strip))
    nf = plan.sizes["first_blocks"]
    counters: Dict[tuple, int] = {}
    done, started = set(), set()
    owner: Dict[int, int] = {}  # slot -> block in flight
    carry_log: Dict[int, List[int]] = {}  # tile -> carry ranks that finished with it, in order

    def ready(item):
        return all(counters.get((cn, i), 0) >= t for cn, i, t in item.waits)

    def pulled(b):
        return ([("pull_part", b, j) for j in range(parts)] if b < nf else [("pull", b, 0)])

    def start(item):
        key = item.key
        kind, b = item.kind, item.block
        assert key not in started, f"{key} runs twice"
        started.add(key)
        s = b % slots
        if kind in ("pull", "pull_part"):
            if b >= slots:
                prev = b - slots
                assert all(("D1", prev, j) in done for j in range(h_cols)), f"pull {b} before D1 of {prev}"
                assert all(("W", unit_of[prev], j) in done for j in range(n_strips)), (
                    f"pull {b} before the W tiles of unit {unit_of[prev]} (block {prev})")
            assert owner.get(s, b) == b, f"pull {b} into slot {s} still holding block {owner.get(s)}"
            owner[s] = b
            return
        if kind == "W":
            u = item.unit
            assert all(("D2", x, j) in done for x in units[u] for j in range(i_cols)), f"W {u} before its D2s"
            if u in carry_rank:
                for t in range(item.first_tile, item.first_tile + item.tiles):
                    assert carry_log.get(t, []) == list(range(carry_rank[u])), (
                        f"W of unit {u} touches the carry of tile {t} after {carry_log.get(t)}")
            return
        assert owner.get(s) == b, f"{kind} of block {b} while slot {s} holds {owner.get(s)}"
        need = {"R": pulled(b), "D1": [("D2", b, j) for j in range(i_cols)],
                "D2": pulled(b) + ([("R", b, j) for j in range(2 * i_cols)] if b >= n_keep else [])}[kind]
        assert kind != "R" or b >= n_keep, f"R of kept block {b}"
        assert all(d in done for d in need), f"{key} started before its inputs"

    def finish(item):
        done.add(item.key)
        for cn, i, a in item.signals:
            counters[(cn, i)] = counters.get((cn, i), 0) + a
        if item.kind == "W" and item.unit in carry_rank:
            for t in range(item.first_tile, item.first_tile + item.tiles):
                carry_log.setdefault(t, []).append(carry_rank[item.unit])
        # A slot is free once its block's D1 tiles and its unit's W tiles are done.
        for b in ([item.block] if item.kind != "W" else list(units[item.unit])):
            s = b % slots
            if owner.get(s) == b and all(("D1", b, j) in done for j in range(h_cols)) and all(
                    ("W", unit_of[b], j) in done for j in range(n_strips)):
                del owner[s]

    n_workers = compute_workers + comm_workers  # clusters in pair mode
    ctas = range(width)
    producer = [None] * n_workers  # tiles a producer waits on
    issued = [[] for _ in range(n_workers)]  # tiles issued, consumed in order
    offload = [[None] * width for _ in range(n_workers)]  # D2 tile in each CTA's staging buffer
    helper = {(w, r): None for w in range(compute_workers) for r in ctas}  # pull a CTA's helper holds
    first_item = {(w, r): None for w in range(comm_workers) for r in ctas}  # part a comm CTA holds
    computing = [w < compute_workers for w in range(n_workers)]  # comm workers join when done pulling
    nxt = {q: 0 for q in QUEUE_NAMES}
    total = sum(len(queues[q]) for q in ("first_pull", "pull")) + sum(len(t) for t in queues["compute"])

    def buffers_free(w, tiles):
        """The staging buffers the head tiles need are empty (D2: its CTA's; W: every CTA's)."""
        if tiles[0].kind == "W":
            return all(x is None for x in offload[w])
        return all(offload[w][r] is None for r, t in enumerate(tiles) if t.kind == "D2")

    while len(done) < total:
        actions = []
        for w in range(comm_workers):
            if computing[compute_workers + w]:
                continue
            for r in ctas:
                if first_item[(w, r)] is not None:
                    if ready(first_item[(w, r)]):
                        actions.append(("run_first", (w, r)))
                elif nxt["first_pull"] < len(queues["first_pull"]):
                    actions.append(("take_first", (w, r)))
            if nxt["first_pull"] == len(queues["first_pull"]) and all(first_item[(w, r)] is None for r in ctas):
                actions.append(("join", w))
        for wr, held in helper.items():
            if held is not None:
                if ready(held):
                    actions.append(("run_help", wr))
            elif nxt["first_pull"] < len(queues["first_pull"]) or nxt["pull"] < len(queues["pull"]):
                actions.append(("take_help", wr))
        for w in range(n_workers):
            if not computing[w]:
                continue
            if producer[w] is None:
                if nxt["compute"] < len(queues["compute"]) and len(issued[w]) < lookahead:
                    actions.append(("take_compute", w))
            elif all(ready(t) for t in producer[w]):
                actions.append(("issue", w))
            if issued[w] and buffers_free(w, issued[w][0]):
                actions.append(("consume", w))
            for r in ctas:
                if offload[w][r] is not None:
                    actions.append(("offload", (w, r)))
        if not actions:
            return (f"deadlock with {len(done)} of {total} items done: helpers hold "
                    f"{[h.key if h else None for h in helper.values()]}, producers hold "
                    f"{[[t.key for t in p] if p else None for p in producer]}, slots {owner}")
        act, w = rng.choice(actions)
        if act == "take_first":
            first_item[w] = queues["first_pull"][nxt["first_pull"]]
            nxt["first_pull"] += 1
        elif act == "run_first":
            start(first_item[w])
            finish(first_item[w])
            first_item[w] = None
        elif act == "join":
            computing[compute_workers + w] = True
        elif act == "take_help":
            q = "first_pull" if nxt["first_pull"] < len(queues["first_pull"]) else "pull"
            helper[w] = queues[q][nxt[q]]
            nxt[q] += 1
        elif act == "run_help":
            if stats is not None:
                stats["help"] = stats.get("help", 0) + 1
            start(helper[w])
            finish(helper[w])
            helper[w] = None
        elif act == "take_compute":
            producer[w] = queues["compute"][nxt["compute"]]
            nxt["compute"] += 1
        elif act == "issue":
            for t in producer[w]:
                start(t)
            issued[w].append(producer[w])
            producer[w] = None
        elif act == "consume":
            for r, t in enumerate(issued[w].pop(0)):
                if t.kind == "D2":
                    offload[w][r] = t
                else:
                    finish(t)
        else:
            cw, r = w
            finish(offload[cw][r])
            offload[cw][r] = None
    want = backward_expected_items(expert_blocks, unit, n_keep, h_cols, i_cols, strip)
    want |= {("pull_part", b, j) for b in range(nf) for j in range(parts)}
    want |= {("pull", b, 0) for b in range(nf, n_blocks)}
    assert done == want, f"ran {len(done)} items, expected {len(want)}: {sorted(done ^ want)[:8]}"
    assert not owner, f"slots still held at the end: {owner}"
    return None
