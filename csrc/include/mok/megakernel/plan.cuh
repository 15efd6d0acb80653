// The forward megakernel's work plan: which item each position of the three work queues holds,
// what an item waits for, and which counter it bumps when done (docs/megakernel.md).
//
// Pure functions of a few sizes, shared by the device code and the host (the C ABI exports
// them for the CPU tests, which replay the protocol to check that it cannot deadlock).
//
// The expert-grouped layout of the schedule (rows [0, offsets[L]), every expert's segment
// padded to 128 rows) is cut into row blocks of kBlockRows rows, each of one expert. Block b
// lives in ring slot b % slots while it is in flight; it is the (b / slots + 1)-th
// generation of that slot. A minibatch is mb_blocks consecutive blocks (the last one may be
// shorter). Three queues, each handed out in order by an atomic counter:
//   first pull: the blocks of the first two minibatches (the "first blocks") in parts of
//            kBlockRows / kFirstPullParts rows, part(0, 0), part(0, 1), ..., served by every
//            CTA when the launch starts (nothing can be computed before they land, and one
//            CTA takes ~0.1 ms to pull a whole block); compute CTAs take only the first
//            group's parts, then start on its tiles (their pull helpers join the rest once
//            the first group has landed)
//   compute: fc1(mb 0), then for m = 1 .. n_mb-1: fc1(mb m), fc2(mb m-1); then fc2(last)
//   pull:    pull(nf), pull(nf + 1), ... (block order after the nf first blocks), served by
//            the pull helpers of the compute CTAs (warps 1-3 of the producer warpgroup)
// There is no push item: an fc2 tile's epilogue stores its output rows straight into their
// home ranks' (token, slot) rows, so a block's slot is free once its fc2 tiles are done, and the
// pulls only wait for that, as far ahead as the ring allows.
// Within a minibatch, GEMM tiles run in groups of up to group_blocks row blocks (8 by default),
// column block by column block inside a group (the CTAs that run together share the weight
// tile in L2).
// Pair mode (the kernel launched in clusters of two CTAs): a compute item is a pair tile, the
// same column block of two consecutive blocks of a minibatch (first + 2j and first + 2j + 1),
// one per CTA of the cluster; both CTAs take it together. When the two blocks belong to one
// expert, each CTA loads half of the weight tile and multicasts it to both (one L2 read of the
// weights per pair). Every wait and counter stays per block: the CTA of rank r waits for and
// bumps block + r's counters, exactly as a single CTA would.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOK_HD __host__ __device__ __forceinline__
#else
#define MOK_HD inline
#endif

namespace mok {
namespace mega {

constexpr int kBlockRows = 128;       // rows of a row block (= tile_rows = the GEMM tile's M)
constexpr int kFc1Cols = 128;         // h columns of an fc1 tile (256 gate+up rows of fc1)
constexpr int kFc2Cols = 256;         // output columns of an fc2 tile
constexpr int kDefaultGroupBlocks = 8;  // row blocks per column sweep inside a minibatch
constexpr int kMinGroupBlocks = 2;      // group_blocks: even, kMinGroupBlocks .. kMaxGroupBlocks
constexpr int kMaxGroupBlocks = 64;
constexpr int kTileArrivals = 2;      // consumer warpgroups per GEMM tile; each bumps once
constexpr int kFirstPullParts = 8;    // parts of a first block's pull (16 rows each)
constexpr int kFirstPullMinibatches = 2;  // minibatches whose blocks are pulled in parts

// (5 is the trace's CTA record kind, trace.cuh.)
enum ItemKind : int32_t { kEnd = 0, kFc1 = 1, kFc2 = 2, kPull = 3, kPullPart = 6 };
enum Queue : int32_t { kComputeQueue = 0, kPullQueue = 1, kFirstPullQueue = 2 };
// Per-slot counters, each an int32[slots] array; they only grow within a launch. kFc2Done also
// says that the slot is free: its block's x, h and router weights are no longer read.
enum SlotCounter : int32_t { kXReady = 0, kHReady = 1, kFc2Done = 2, kNumSlotCounters = 3 };

// Header words of the counter buffer (int32 units); the slot counters follow.
enum HeaderWord : int32_t {
  kEpochLo = 0,       // uint64 epoch of this launch (words 0-1), written by the reset kernel
  kComputeNext = 2,   // compute queue position
  kPullNext = 3,      // pull queue position
  kFc2Delivered = 4,  // fc2 tile halves (one per consumer warpgroup) whose output rows have
                      // reached their home ranks (counted by each CTA at its end, tiles.cuh)
  kSumNext = 5,       // slot-sum queue position (units: a quarter of a token's row)
  kRoleTicket = 6,    // CTAs started: the first comm_ctas become comm CTAs
  kFirstPullNext = 7, // first-pull queue position
  kHeaderWords = 8,
};

MOK_HD int64_t counter_words(int slots) { return kHeaderWords + (int64_t)kNumSlotCounters * slots; }
MOK_HD int counter_index(int counter, int slot, int slots) { return kHeaderWords + counter * slots + slot; }

struct Plan {
  int n_blocks;   // row blocks of the layout: offsets[L] / kBlockRows
  int mb_blocks;  // row blocks per minibatch (minibatch_rows / kBlockRows)
  int slots;      // ring slots (ring_rows / kBlockRows), a multiple of mb_blocks, >= 2 minibatches
  int n1;         // fc1 column blocks: I / kFc1Cols
  int n2;         // fc2 column blocks: H / kFc2Cols
  int pairs = 0;  // 1: compute items are pair tiles, for CTA clusters of two (below)
  int group_blocks = kDefaultGroupBlocks;  // row blocks of a column sweep (MokMegakernelTunables)
};

struct Item {
  int32_t kind;   // ItemKind
  int32_t block;  // row block
  int32_t col;    // column block (GEMM items), 0 for comm items
};

// What an item waits for before it starts: counters[counter][slot] >= target (target <= 0:
// nothing to wait for).
struct Wait {
  int32_t counter;
  int32_t slot;
  int32_t target;
};

MOK_HD int num_minibatches(const Plan& p) { return (p.n_blocks + p.mb_blocks - 1) / p.mb_blocks; }
// Tile units of a minibatch of nb blocks: its blocks, or in pair mode its pairs of blocks
// (first + 2j, first + 2j + 1; an odd last block is a pair of its own).
MOK_HD int units_of(const Plan& p, int nb) { return p.pairs ? (nb + 1) / 2 : nb; }
MOK_HD int last_minibatch_blocks(const Plan& p) {
  return p.n_blocks - (num_minibatches(p) - 1) * p.mb_blocks;
}
MOK_HD int compute_items(const Plan& p) {
  if (p.n_blocks == 0) return 0;
  const int units = (num_minibatches(p) - 1) * units_of(p, p.mb_blocks) + units_of(p, last_minibatch_blocks(p));
  return units * (p.n1 + p.n2);
}
// Trace records of compute items: one per item, in pair mode one per CTA of the pair.
MOK_HD int compute_records(const Plan& p) { return p.pairs ? 2 * compute_items(p) : compute_items(p); }
// fc2 tile halves of the launch (one per consumer warpgroup of every fc2 tile): what
// kFc2Delivered reaches once every output row is at home.
MOK_HD int fc2_arrivals(const Plan& p) { return p.n_blocks * p.n2 * kTileArrivals; }
// Record slots of the trace for comm items: one per block for pulls (the first blocks' records
// stay empty; their parts have records after the CTAs', trace.cuh).
MOK_HD int comm_items(const Plan& p) { return p.n_blocks; }
// Blocks pulled in parts when the launch starts. The ring holds at least two minibatches, so
// they are all first generation: their slots were never used.
MOK_HD int first_blocks(const Plan& p) {
  int n = kFirstPullMinibatches * p.mb_blocks;
  n = n < p.slots ? n : p.slots;  // (no-op for a valid ring)
  return n < p.n_blocks ? n : p.n_blocks;
}
MOK_HD int queue_items(const Plan& p, int queue) {
  switch (queue) {
    case kComputeQueue: return compute_items(p);
    case kPullQueue: return p.n_blocks - first_blocks(p);
    default: return first_blocks(p) * kFirstPullParts;
  }
}

// Item `idx` of the tiles of minibatch m with `cols` column blocks (cols == 1: the units in
// order). Groups of p.group_blocks blocks (half as many pairs), column block by column
// block inside a group. In pair mode the item's block is the pair's first block.
MOK_HD Item tile_in_minibatch(const Plan& p, int32_t kind, int m, int cols, int idx) {
  const int first = m * p.mb_blocks;
  const int nb = (p.n_blocks - first) < p.mb_blocks ? (p.n_blocks - first) : p.mb_blocks;
  const int nu = units_of(p, nb);
  const int group_units = p.pairs ? p.group_blocks / 2 : p.group_blocks;
  const int group = idx / (group_units * cols);
  const int in_group = idx - group * group_units * cols;
  const int left = nu - group * group_units;
  const int units_in_group = left < group_units ? left : group_units;
  Item it;
  it.kind = kind;
  it.col = in_group / units_in_group;
  it.block = first + (group * group_units + in_group % units_in_group) * (p.pairs ? 2 : 1);
  return it;
}

// Block order: which layout block of its expert each block of the queues stands for. The plan
// (queues, slots, counters) stays in queue order; only the rows a block stands for change,
// within its expert, so an expert's blocks keep their queue positions. Zigzag: the j-th block of
// an expert whose blocks are [first, first + n) of the layout is its block j / 2 from the front
// (even j) or from the back (odd j). Within an expert the layout holds the rows in (source
// rank, token, slot) order, so at P = 2 the front blocks come from rank 0 and the back ones from
// rank 1: the order alternates between local and remote rows, for the pulls and for fc2's
// pushes, where the layout's own order runs a long stretch of one kind (a large expert holds
// tens of blocks from each rank) and every CTA pushes over NVLink at once.

// Position j of n, front and back in turn.
MOK_HD int zigzag_index(int n, int j) { return (j & 1) == 0 ? j / 2 : n - 1 - j / 2; }

// The layout block for queue block `block` of the expert whose layout blocks are
// [first, first + n) (the same range of queue positions).
MOK_HD int layout_block(int first, int n, int block) { return first + zigzag_index(n, block - first); }

// Pair mode: the second block of the pair whose first block is `block`, or -1 when the pair is
// the odd last block of its minibatch.
MOK_HD int pair_partner(const Plan& p, int block) {
  const int end_of_mb = (block / p.mb_blocks + 1) * p.mb_blocks;
  const int end = end_of_mb < p.n_blocks ? end_of_mb : p.n_blocks;
  return block + 1 < end ? block + 1 : -1;
}

// Position `i` of a queue laid out as A(0), A(1), B(0), A(2), B(1), ..., A(n-1), B(n-2), B(n-1)
// where A(m) has units(m) * ca items and B(m) units(m) * cb items.
MOK_HD Item interleaved_item(const Plan& p, int i, int32_t kind_a, int ca, int32_t kind_b, int cb) {
  const int n = num_minibatches(p);
  const int B = units_of(p, p.mb_blocks);           // units of a full minibatch
  const int last = units_of(p, last_minibatch_blocks(p));  // units of the last minibatch
  if (n == 1) {
    if (i < last * ca) return tile_in_minibatch(p, kind_a, 0, ca, i);
    return tile_in_minibatch(p, kind_b, 0, cb, i - last * ca);
  }
  if (i < B * ca) return tile_in_minibatch(p, kind_a, 0, ca, i);
  int j = i - B * ca;
  const int pair = B * (ca + cb);  // A(m) + B(m-1), both full, for 1 <= m <= n-2
  const int k = j / pair;
  if (k < n - 2) {
    const int r = j - k * pair;
    if (r < B * ca) return tile_in_minibatch(p, kind_a, k + 1, ca, r);
    return tile_in_minibatch(p, kind_b, k, cb, r - B * ca);
  }
  j -= (n - 2) * pair;
  if (j < last * ca) return tile_in_minibatch(p, kind_a, n - 1, ca, j);
  j -= last * ca;
  if (j < B * cb) return tile_in_minibatch(p, kind_b, n - 2, cb, j);
  return tile_in_minibatch(p, kind_b, n - 1, cb, j - B * cb);
}

// Item at position i of the compute queue (0 <= i < compute_items).
MOK_HD Item compute_item(const Plan& p, int i) { return interleaved_item(p, i, kFc1, p.n1, kFc2, p.n2); }

MOK_HD Item queue_item(const Plan& p, int queue, int i) {
  if (queue == kComputeQueue) return compute_item(p, i);
  Item it;
  if (queue == kPullQueue) {  // the blocks after the first ones, in order
    it.kind = kPull;
    it.block = first_blocks(p) + i;
    it.col = 0;
  } else {
    it.kind = kPullPart;
    it.block = i / kFirstPullParts;
    it.col = i % kFirstPullParts;  // the part: rows [col * rows, (col + 1) * rows) of the block
  }
  return it;
}

// First-pull positions a compute CTA takes: the parts of the first group's blocks (the first
// wave's tiles need nothing else). The comm CTAs, and the compute CTAs' pull helpers once those
// have landed, pull the rest of the first blocks while the compute CTAs start on the first
// tiles. At P > 1 half of those rows cross NVLink, whose bandwidth sets when the first tile can
// start: the first group alone lands in half the time of the first minibatch.
MOK_HD int first_pull_items_for_compute(const Plan& p) {
  int n = first_blocks(p) < p.mb_blocks ? first_blocks(p) : p.mb_blocks;
  if (n > p.group_blocks) n = p.group_blocks;
  return n * kFirstPullParts;
}

// x_ready arrivals of the first generation of a slot: one per part for a first block's slot.
MOK_HD int first_pull_arrivals(const Plan& p, int slot) { return slot < first_blocks(p) ? kFirstPullParts : 1; }

// Generation of block b in its slot: 1 for the first S blocks, 2 for the next S, ...
MOK_HD int generation(const Plan& p, int block) { return block / p.slots + 1; }

MOK_HD Wait wait_of(const Plan& p, const Item& it) {
  const int g = generation(p, it.block);
  Wait w;
  w.slot = it.block % p.slots;
  switch (it.kind) {
    case kFc1:  // the block's x rows and router weights are in the ring (its slot's first
                // generation arrives in parts when it was a first block)
      w.counter = kXReady;
      w.target = first_pull_arrivals(p, w.slot) + (g - 1);
      break;
    case kFc2:  // every fc1 tile of the block stored its h columns
      w.counter = kHReady;
      w.target = g * kTileArrivals * p.n1;
      break;
    case kPull:      // every fc2 tile of the slot's previous block is done (its x, h and
    case kPullPart:  // router weights are no longer read; a first block: g == 1, no wait)
      w.counter = kFc2Done;
      w.target = (g - 1) * kTileArrivals * p.n2;
      break;
    default:
      w.counter = 0;
      w.target = 0;
      break;
  }
  return w;
}

// The counter an item bumps when done, and by how much (GEMM tiles: once per consumer
// warpgroup, kTileArrivals in all).
MOK_HD int signal_counter(int32_t kind) { return kind == kFc1 ? kHReady : kind == kFc2 ? kFc2Done : kXReady; }
MOK_HD int signal_amount(int32_t kind) { return (kind == kFc1 || kind == kFc2) ? kTileArrivals : 1; }

}  // namespace mega
}  // namespace mok
