// The backward megakernel's work plan (docs/training.md, section 2): units, phases, which item
// each position of the three work queues holds, what an item waits for and what it signals.
//
// Pure functions, shared by the device code and the host (the C ABI exports them for the CPU
// replica, tests/megakernel/protocol.py, which checks that the protocol cannot deadlock).
//
// Row blocks are the forward's (plan.cuh): 128 rows of one expert, in queue order. Block b is
// kept (its forward activations are in the training ring) when b < n_keep, else replayed. It
// lives in backward slot b % slots as generation b / slots + 1. A unit is up to unit_blocks
// consecutive blocks of one expert (kWgradUnitBlocks in the kernel); an expert of n blocks has
// ceil(n / unit_blocks) units, numbered in queue order over all experts. Items:
//   part(b, i), pull(b): dY (and for a replayed block x and the router weights) into the slot
//   R(b, c):  replayed blocks only, 2 * i_cols per block (I / 128 columns of gate|up)
//   D2(b, c): i_cols per block (I / 256), its offload stores dgu and h
//   D1(b, c): h_cols per block (H / 256)
//   W(u, j):  strips of up to strip_tiles weight-gradient tiles of unit u: dW1 (4 * i_cols m-blocks
//             of 128 rows of 2I, h_cols n-blocks of 256 of H), then dW2 (2 * h_cols m-blocks, i_cols
//             n-blocks), n-block by n-block with the m-strips inside
// Queues (each handed out in order):
//   first pull: the first min(2 * mb_blocks, slots) blocks in kFirstPullParts parts each
//   pull:       the other blocks, in order
//   compute:    R(0), then for k = 0 .. n_mb: D1(k-1), W(k-1), R(k+1), D2(k) (parts outside
//               0 .. n_mb - 1 omitted); W(m) holds the strips of the units whose last block is in
//               minibatch m, unit by unit. R, D2 and D1 sweep columns over groups of group_blocks
//               blocks, as the forward's tiles.
// The tables (unit starts, carry ranks, phase starts, units per minibatch) are int32 words built
// by build_bwd_tables, headed by the sizes, so that a plan is one pointer.
// Pair mode (clusters of two CTAs, as the forward's, plan.cuh): an R, D2 or D1 position is a pair
// tile, the same column of two consecutive blocks of the sweep (first + 2j, first + 2j + 1 of the
// minibatch's blocks, or of its replayed ones for R; an odd last block is a pair of its own), CTA
// r on block + r with the weight boxes multicast; a sweep group holds group_blocks / 2 pairs. A W
// position is still one strip: CTA r takes its tiles first_tile + r, first_tile + r + 2, ... (the
// tiles (m, n), (m + 1, n) side by side, the B operand multicast). A pair item waits for the union
// of both blocks' waits and signals both blocks' signals; each CTA waits and signals for its own.
//
// The training ring (docs/training.md section 3) stores the kept blocks' rows compactly by 64-row
// halves, in queue order: each block takes the halves that hold a real row, so an expert of n rows
// takes ceil(n / 64) * 64 ring rows. The kept blocks are the largest queue prefix that fits.
#pragma once

#include <cstdint>

#include "mok/megakernel/plan.cuh"

namespace mok {
namespace mega {

constexpr int kWgradUnitBlocks = 32;  // row blocks of a unit in the kernel (4096 rows)
constexpr int kWgradStripTiles = 4;   // weight-gradient tiles of a W strip in the kernel
constexpr int kMaxStripTiles = 8;     // bound on strip_tiles (sizes the wait and signal lists)
constexpr int kMaxBwdWaits = 1 + kMaxStripTiles;    // W: unit_ready + one carry per tile
constexpr int kMaxBwdSignals = 1 + kMaxStripTiles;  // W: w_done + one carry per tile
static_assert(kMaxBwdWaits >= 4 && kMaxBwdSignals >= 4, "a pair D2 tile waits for and signals 2 per block");

// Backward compute kinds continue the forward's (plan.cuh: 1 fc1, 2 fc2, 3 pull, 5 the trace's CTA
// record, 6 part); pulls keep the forward's kinds.
enum BwdItemKind : int32_t { kBwdR = 7, kBwdD2 = 8, kBwdD1 = 9, kBwdW = 10 };

// Counters of the backward. Per slot: kDyReady .. kD1Done; per unit: kUnitReady, kWDone; per
// weight-gradient tile: kCarryDone. They only grow within a launch.
enum BwdCounter : int32_t {
  kDyReady = 0,    // pull / each part: +1 once its rows (dY, replay x, weights) are in the slot
  kGuReady = 1,    // R: +1 per consumer warpgroup after its gate|up stores
  kDguReady = 2,   // D2: +1 by the offload crew after dgu, h and the partials are stored
  kD1Done = 3,     // D1: +1 per consumer warpgroup after its MMAs
  kUnitReady = 4,  // D2 of a block of the unit: +1 by the offload crew
  kWDone = 5,      // W: +1 per consumer warpgroup per tile of the strip
  kCarryDone = 6,  // W of a carrying unit: +1 per consumer warpgroup per tile, once done with the carry
  kNumBwdCounters = 7,
};

// Header words of the plan tables; the arrays follow.
enum BwdTableHeader : int32_t {
  kTabBlocks = 0, kTabMbBlocks, kTabSlots, kTabUnitBlocks, kTabKeep, kTabHCols, kTabICols,
  kTabStripTiles, kTabGroupBlocks, kTabUnits, kTabMinibatches, kTabPairs, kTabHeaderWords,
};

struct BwdPlan {
  int n_blocks;      // row blocks of the layout
  int mb_blocks;     // row blocks per minibatch
  int slots;         // backward slots S_b (unit_blocks + 2 * mb_blocks by default)
  int unit_blocks;   // row blocks of a full unit
  int n_keep;        // blocks b < n_keep are kept, the others replayed
  int h_cols;        // H / 256: D1 items per block
  int i_cols;        // I / 256: D2 items per block (2 * i_cols R items)
  int strip_tiles;   // weight-gradient tiles of a W strip (the last strip of a matrix may have fewer)
  int group_blocks;  // row blocks of a column sweep
  int n_units;
  int n_mb;          // minibatches
  const int32_t* unit_start;   // [n_units + 1]: first block of each unit, then n_blocks
  const int32_t* unit_carry;   // [n_units]: c(u), carrying units before u, or -1 when u does not carry
  const int32_t* phase_start;  // [n_mb + 3]: position of R(0) (0), of phase k at k + 1, then the end
  const int32_t* w_units;      // [n_mb + 1]: first unit whose last block is in minibatch m, then n_units
  int pairs;                   // 1: pair mode (R, D2, D1 positions are pair tiles), else 0
};

struct BwdItem {
  int32_t kind;        // ItemKind (pulls) or BwdItemKind
  int32_t block;       // row block; W: the unit's last block
  int32_t col;         // column block, part or strip
  int32_t unit;        // the block's unit, or W's unit
  int32_t first_tile;  // W: first weight-gradient tile of the strip, else 0
  int32_t tiles;       // W: tiles of the strip, else 0
};

// counters[counter][index] >= target before the item starts.
struct BwdWait {
  int32_t counter;
  int32_t index;
  int32_t target;
};

// counters[counter][index] += amount when the item (or its offload) is done.
struct BwdSignal {
  int32_t counter;
  int32_t index;
  int32_t amount;
};

MOK_HD int div_up(int a, int b) { return (a + b - 1) / b; }
MOK_HD int imin(int a, int b) { return a < b ? a : b; }
MOK_HD int imax(int a, int b) { return a > b ? a : b; }

// Items per block and per unit of each kind.
MOK_HD int r_cols(const BwdPlan& p) { return 2 * p.i_cols; }
MOK_HD int d2_cols(const BwdPlan& p) { return p.i_cols; }
MOK_HD int d1_cols(const BwdPlan& p) { return p.h_cols; }
// Weight-gradient tiles of one expert: dW1 (4 i_cols x h_cols) then dW2 (2 h_cols x i_cols).
MOK_HD int w1_mblocks(const BwdPlan& p) { return 4 * p.i_cols; }
MOK_HD int w2_mblocks(const BwdPlan& p) { return 2 * p.h_cols; }
MOK_HD int w1_tiles(const BwdPlan& p) { return w1_mblocks(p) * p.h_cols; }
MOK_HD int wgrad_tiles(const BwdPlan& p) { return w1_tiles(p) + w2_mblocks(p) * p.i_cols; }
// W strips of a unit: each n-block's m-blocks in strips of strip_tiles.
MOK_HD int w1_strips(const BwdPlan& p) { return div_up(w1_mblocks(p), p.strip_tiles) * p.h_cols; }
MOK_HD int w_strips(const BwdPlan& p) { return w1_strips(p) + div_up(w2_mblocks(p), p.strip_tiles) * p.i_cols; }

// Words of the plan tables for a layout of n_blocks blocks in n_units units.
MOK_HD int64_t bwd_table_words(int n_blocks, int mb_blocks, int n_units) {
  const int n_mb = div_up(n_blocks, mb_blocks);
  return kTabHeaderWords + (int64_t)(n_units + 1) + n_units + (n_mb + 3) + (n_mb + 1);
}

// Units of a layout whose experts have expert_blocks[0 .. L) row blocks.
MOK_HD int count_units(const int32_t* expert_blocks, int L, int unit_blocks) {
  int n = 0;
  for (int l = 0; l < L; ++l) n += div_up(expert_blocks[l], unit_blocks);
  return n;
}

// The most units a layout of at most max_blocks row blocks over L experts can have (each expert's
// last unit may be partial): what the unit counters are sized for.
MOK_HD int bwd_max_units(int max_blocks, int L, int unit_blocks) { return max_blocks / unit_blocks + L; }

// The backward's counter buffer (int32 words), one per workspace: the forward's header words
// (plan.cuh, HeaderWord: epoch, queue positions, role ticket; kFc2Delivered counts the D1 tile
// halves delivered), then each BwdCounter's array (dy_ready .. d1_done by slot, unit_ready and
// w_done by unit id, carry_done by weight-gradient tile), then the plan tables, which the reset
// kernel builds on the device. The reset zeroes the words from kComputeNext to `tables` (the unit
// arrays only up to this launch's units); the tables are rewritten whole.
struct BwdCounterLayout {
  int64_t base[kNumBwdCounters];  // word of each counter's element 0
  int64_t length[kNumBwdCounters];
  int64_t tables;                 // word of the plan tables (bwd_plan_of)
  int64_t words;                  // the buffer
};

MOK_HD BwdCounterLayout bwd_counter_layout(int slots, int max_units, int wgrad_tiles, int64_t table_words) {
  BwdCounterLayout l;
  int64_t at = kHeaderWords;
  for (int c = 0; c < kNumBwdCounters; ++c) {
    l.length[c] = c <= kD1Done ? slots : c <= kWDone ? max_units : wgrad_tiles;
    l.base[c] = at;
    at += l.length[c];
  }
  l.tables = at;
  l.words = at + table_words;
  return l;
}

// The plan whose tables (built by build_bwd_tables) start at `tab`.
MOK_HD BwdPlan bwd_plan_of(const int32_t* tab) {
  BwdPlan p;
  p.n_blocks = tab[kTabBlocks];
  p.mb_blocks = tab[kTabMbBlocks];
  p.slots = tab[kTabSlots];
  p.unit_blocks = tab[kTabUnitBlocks];
  p.n_keep = tab[kTabKeep];
  p.h_cols = tab[kTabHCols];
  p.i_cols = tab[kTabICols];
  p.strip_tiles = tab[kTabStripTiles];
  p.group_blocks = tab[kTabGroupBlocks];
  p.n_units = tab[kTabUnits];
  p.n_mb = tab[kTabMinibatches];
  p.pairs = tab[kTabPairs];
  p.unit_start = tab + kTabHeaderWords;
  p.unit_carry = p.unit_start + p.n_units + 1;
  p.phase_start = p.unit_carry + p.n_units;
  p.w_units = p.phase_start + p.n_mb + 3;
  return p;
}

// Blocks of minibatch m, and those of them that are replayed (a suffix: kept blocks are a prefix).
MOK_HD int mb_first(const BwdPlan& p, int m) { return m * p.mb_blocks; }
MOK_HD int mb_size(const BwdPlan& p, int m) { return imin(p.mb_blocks, p.n_blocks - mb_first(p, m)); }
MOK_HD int mb_replay_first(const BwdPlan& p, int m) {
  return imax(mb_first(p, m), imin(p.n_keep, mb_first(p, m) + mb_size(p, m)));
}
MOK_HD int mb_replayed(const BwdPlan& p, int m) { return mb_first(p, m) + mb_size(p, m) - mb_replay_first(p, m); }

// Tile units of a sweep over nb blocks: the blocks, or in pair mode their pairs.
MOK_HD int sweep_units(const BwdPlan& p, int nb) { return p.pairs ? (nb + 1) / 2 : nb; }

// Items of each part of the compute queue for minibatch m (0 outside 0 .. n_mb - 1).
MOK_HD bool mb_valid(const BwdPlan& p, int m) { return m >= 0 && m < p.n_mb; }
MOK_HD int r_items(const BwdPlan& p, int m) {
  return mb_valid(p, m) ? sweep_units(p, mb_replayed(p, m)) * r_cols(p) : 0;
}
MOK_HD int d2_items(const BwdPlan& p, int m) {
  return mb_valid(p, m) ? sweep_units(p, mb_size(p, m)) * d2_cols(p) : 0;
}
MOK_HD int d1_items(const BwdPlan& p, int m) {
  return mb_valid(p, m) ? sweep_units(p, mb_size(p, m)) * d1_cols(p) : 0;
}
MOK_HD int w_items(const BwdPlan& p, int m) {
  return mb_valid(p, m) ? (p.w_units[m + 1] - p.w_units[m]) * w_strips(p) : 0;
}
// Compute positions of phase k (k = -1: R(0); k = 0 .. n_mb: D1(k-1), W(k-1), R(k+1), D2(k)).
MOK_HD int phase_items(const BwdPlan& p, int k) {
  if (k < 0) return r_items(p, 0);
  return d1_items(p, k - 1) + w_items(p, k - 1) + r_items(p, k + 1) + d2_items(p, k);
}

// Fills the plan tables `tab` (bwd_table_words words) for experts of expert_blocks[0 .. L) row
// blocks, one thread (the reset kernel's, or the host). Sizes as in BwdPlan; pairs 0 or 1.
MOK_HD void build_bwd_tables(const int32_t* expert_blocks, int L, int mb_blocks, int slots, int unit_blocks,
                             int n_keep, int h_cols, int i_cols, int strip_tiles, int group_blocks, int pairs,
                             int32_t* tab) {
  int n_blocks = 0;
  for (int l = 0; l < L; ++l) n_blocks += expert_blocks[l];
  tab[kTabBlocks] = n_blocks;
  tab[kTabMbBlocks] = mb_blocks;
  tab[kTabSlots] = slots;
  tab[kTabUnitBlocks] = unit_blocks;
  tab[kTabKeep] = imin(n_keep, n_blocks);
  tab[kTabHCols] = h_cols;
  tab[kTabICols] = i_cols;
  tab[kTabStripTiles] = strip_tiles;
  tab[kTabGroupBlocks] = group_blocks;
  tab[kTabUnits] = count_units(expert_blocks, L, unit_blocks);
  tab[kTabMinibatches] = div_up(n_blocks, mb_blocks);
  tab[kTabPairs] = pairs;
  BwdPlan p = bwd_plan_of(tab);
  int32_t* unit_start = tab + kTabHeaderWords;
  int32_t* unit_carry = unit_start + p.n_units + 1;
  int32_t* phase_start = unit_carry + p.n_units;
  int32_t* w_units = phase_start + p.n_mb + 3;
  // Units: each expert's blocks in runs of unit_blocks. A unit carries when its expert has more
  // than one unit (it stores the carry, loads it, or both); c(u) numbers those units in order.
  int u = 0, first = 0, carrying = 0;
  for (int l = 0; l < L; ++l) {
    const int nu = div_up(expert_blocks[l], unit_blocks);
    for (int i = 0; i < nu; ++i, ++u) {
      unit_start[u] = first + i * unit_blocks;
      unit_carry[u] = nu > 1 ? carrying++ : -1;
    }
    first += expert_blocks[l];
  }
  unit_start[p.n_units] = n_blocks;
  // Units by the minibatch of their last block (units are in queue order, so this is monotone).
  u = 0;
  for (int m = 0; m < p.n_mb; ++m) {
    w_units[m] = u;
    const int end = mb_first(p, m) + mb_size(p, m);
    while (u < p.n_units && unit_start[u + 1] <= end) ++u;
  }
  w_units[p.n_mb] = p.n_units;
  phase_start[0] = 0;
  for (int k = -1; k <= p.n_mb; ++k) phase_start[k + 2] = phase_start[k + 1] + phase_items(p, k);
}

MOK_HD int bwd_compute_items(const BwdPlan& p) { return p.phase_start[p.n_mb + 2]; }
MOK_HD int bwd_first_blocks(const BwdPlan& p) {
  return imin(imin(kFirstPullMinibatches * p.mb_blocks, p.slots), p.n_blocks);
}
MOK_HD int bwd_queue_items(const BwdPlan& p, int queue) {
  switch (queue) {
    case kComputeQueue: return bwd_compute_items(p);
    case kPullQueue: return p.n_blocks - bwd_first_blocks(p);
    default: return bwd_first_blocks(p) * kFirstPullParts;
  }
}

// Unit of block b: the last unit starting at or before b (binary search, O(log n_units)).
MOK_HD int unit_of(const BwdPlan& p, int b) {
  int lo = 0, hi = p.n_units - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.unit_start[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}
MOK_HD int unit_size(const BwdPlan& p, int u) { return p.unit_start[u + 1] - p.unit_start[u]; }

// Item idx of the tiles of blocks [first, first + nb) with `cols` columns: groups of
// group_blocks blocks (half as many pairs), column by column inside a group. In pair mode the
// item's block is the pair's first block.
MOK_HD BwdItem bwd_sweep_item(const BwdPlan& p, int32_t kind, int first, int nb, int cols, int idx) {
  const int group_units = p.pairs ? p.group_blocks / 2 : p.group_blocks;
  const int group = idx / (group_units * cols);
  const int in_group = idx - group * group_units * cols;
  const int in_this = imin(sweep_units(p, nb) - group * group_units, group_units);
  BwdItem it;
  it.kind = kind;
  it.col = in_group / in_this;
  it.block = first + (group * group_units + in_group % in_this) * (p.pairs ? 2 : 1);
  it.unit = unit_of(p, it.block);
  it.first_tile = 0;
  it.tiles = 0;
  return it;
}

// Strip j of unit u: dW1's n-blocks with their m-strips, then dW2's. Tiles are numbered
// n * m_blocks + m within each matrix, dW2's after dW1's, so a strip's tiles are consecutive.
MOK_HD BwdItem bwd_strip_item(const BwdPlan& p, int u, int j) {
  BwdItem it;
  it.kind = kBwdW;
  it.unit = u;
  it.block = p.unit_start[u + 1] - 1;
  it.col = j;
  const bool second = j >= w1_strips(p);
  const int mblocks = second ? w2_mblocks(p) : w1_mblocks(p);
  const int per_n = div_up(mblocks, p.strip_tiles);
  const int jj = second ? j - w1_strips(p) : j;
  const int n = jj / per_n, ms = jj - n * per_n;
  it.first_tile = (second ? w1_tiles(p) : 0) + n * mblocks + ms * p.strip_tiles;
  it.tiles = imin(p.strip_tiles, mblocks - ms * p.strip_tiles);
  return it;
}

// Item at position i of the compute queue (0 <= i < bwd_compute_items): the phase by binary
// search over the phase starts (O(log n_mb)), then the part of the phase.
MOK_HD BwdItem bwd_compute_item(const BwdPlan& p, int i) {
  int lo = 0, hi = p.n_mb + 1;  // phase index k + 1
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.phase_start[mid] <= i) lo = mid; else hi = mid - 1;
  }
  const int k = lo - 1;
  int off = i - p.phase_start[lo];
  if (k < 0) return bwd_sweep_item(p, kBwdR, mb_replay_first(p, 0), mb_replayed(p, 0), r_cols(p), off);
  if (off < d1_items(p, k - 1))
    return bwd_sweep_item(p, kBwdD1, mb_first(p, k - 1), mb_size(p, k - 1), d1_cols(p), off);
  off -= d1_items(p, k - 1);
  if (off < w_items(p, k - 1)) {
    const int s = w_strips(p);
    return bwd_strip_item(p, p.w_units[k - 1] + off / s, off % s);
  }
  off -= w_items(p, k - 1);
  if (off < r_items(p, k + 1))
    return bwd_sweep_item(p, kBwdR, mb_replay_first(p, k + 1), mb_replayed(p, k + 1), r_cols(p), off);
  off -= r_items(p, k + 1);
  return bwd_sweep_item(p, kBwdD2, mb_first(p, k), mb_size(p, k), d2_cols(p), off);
}

MOK_HD BwdItem bwd_queue_item(const BwdPlan& p, int queue, int i) {
  if (queue == kComputeQueue) return bwd_compute_item(p, i);
  BwdItem it;
  if (queue == kPullQueue) {
    it.kind = kPull;
    it.block = bwd_first_blocks(p) + i;
    it.col = 0;
  } else {
    it.kind = kPullPart;
    it.block = i / kFirstPullParts;
    it.col = i % kFirstPullParts;
  }
  it.unit = unit_of(p, it.block);
  it.first_tile = 0;
  it.tiles = 0;
  return it;
}

MOK_HD int bwd_generation(const BwdPlan& p, int block) { return block / p.slots + 1; }
// dy_ready arrivals of slot s up to generation g: a first block's parts, then one pull each.
MOK_HD int dy_arrivals(const BwdPlan& p, int s, int g) {
  return (s < bwd_first_blocks(p) ? kFirstPullParts : 1) + (g - 1);
}
// r(s, g): replayed occupants of slot s in generations 1 .. g (blocks s + (g' - 1) * slots >= n_keep).
MOK_HD int replayed_occupants(const BwdPlan& p, int s, int g) {
  const int first_g = (p.n_keep <= s ? 0 : div_up(p.n_keep - s, p.slots)) + 1;
  return imax(0, g - first_g + 1);
}

// Pair mode: the second block of the pair tile `it` (R, D2, D1), or -1 when it has none (the odd
// last block of its minibatch, single CTAs, or another kind). Every sweep's pairs start at an
// even offset from a start inside the minibatch and end at its end, so block + 1 is the partner
// whenever it is in the minibatch.
MOK_HD int bwd_pair_second(const BwdPlan& p, const BwdItem& it) {
  if (!p.pairs || (it.kind != kBwdR && it.kind != kBwdD2 && it.kind != kBwdD1)) return -1;
  const int m = it.block / p.mb_blocks;
  return it.block + 1 < mb_first(p, m) + mb_size(p, m) ? it.block + 1 : -1;
}

// The tile of `it` that the pair's second CTA runs on block `second`.
MOK_HD BwdItem bwd_second_tile(const BwdPlan& p, const BwdItem& it, int second) {
  BwdItem t = it;
  t.block = second;
  t.unit = unit_of(p, second);
  return t;
}

// The waits of one CTA's tile (a single CTA's item) into out; returns how many.
MOK_HD int bwd_tile_waits(const BwdPlan& p, const BwdItem& it, BwdWait* out) {
  const int s = it.block % p.slots, g = bwd_generation(p, it.block);
  int n = 0;
  switch (it.kind) {
    case kPull:
    case kPullPart:  // the slot's previous occupant: its D1 tiles, and every W tile of its unit
      if (g > 1) {
        out[n++] = BwdWait{kD1Done, s, kTileArrivals * d1_cols(p) * (g - 1)};
        out[n++] = BwdWait{kWDone, unit_of(p, it.block - p.slots), kTileArrivals * wgrad_tiles(p)};
      }
      break;
    case kBwdR:
      out[n++] = BwdWait{kDyReady, s, dy_arrivals(p, s, g)};
      break;
    case kBwdD2:
      out[n++] = BwdWait{kDyReady, s, dy_arrivals(p, s, g)};
      if (it.block >= p.n_keep)
        out[n++] = BwdWait{kGuReady, s, kTileArrivals * r_cols(p) * replayed_occupants(p, s, g)};
      break;
    case kBwdD1:
      out[n++] = BwdWait{kDguReady, s, d2_cols(p) * g};
      break;
    case kBwdW:
      out[n++] = BwdWait{kUnitReady, it.unit, d2_cols(p) * unit_size(p, it.unit)};
      if (p.unit_carry[it.unit] > 0)
        for (int t = 0; t < it.tiles; ++t)
          out[n++] = BwdWait{kCarryDone, it.first_tile + t, kTileArrivals * p.unit_carry[it.unit]};
      break;
    default:
      break;
  }
  return n;
}

// The waits of an item into out[0 .. kMaxBwdWaits); returns how many. A pair tile: its first
// block's waits, then its second block's.
MOK_HD int bwd_waits(const BwdPlan& p, const BwdItem& it, BwdWait* out) {
  const int n = bwd_tile_waits(p, it, out);
  const int second = bwd_pair_second(p, it);
  return second < 0 ? n : n + bwd_tile_waits(p, bwd_second_tile(p, it, second), out + n);
}

// The signals of one CTA's tile (D2's: its offload crew's) into out; returns how many.
MOK_HD int bwd_tile_signals(const BwdPlan& p, const BwdItem& it, BwdSignal* out) {
  const int s = it.block % p.slots;
  int n = 0;
  switch (it.kind) {
    case kPull:
    case kPullPart: out[n++] = BwdSignal{kDyReady, s, 1}; break;
    case kBwdR: out[n++] = BwdSignal{kGuReady, s, kTileArrivals}; break;
    case kBwdD2:
      out[n++] = BwdSignal{kDguReady, s, 1};
      out[n++] = BwdSignal{kUnitReady, it.unit, 1};
      break;
    case kBwdD1: out[n++] = BwdSignal{kD1Done, s, kTileArrivals}; break;
    case kBwdW:
      out[n++] = BwdSignal{kWDone, it.unit, kTileArrivals * it.tiles};
      if (p.unit_carry[it.unit] >= 0)
        for (int t = 0; t < it.tiles; ++t) out[n++] = BwdSignal{kCarryDone, it.first_tile + t, kTileArrivals};
      break;
    default:
      break;
  }
  return n;
}

// The signals of an item into out[0 .. kMaxBwdSignals); returns how many. A pair tile: its first
// block's signals, then its second block's.
MOK_HD int bwd_signals(const BwdPlan& p, const BwdItem& it, BwdSignal* out) {
  const int n = bwd_tile_signals(p, it, out);
  const int second = bwd_pair_second(p, it);
  return second < 0 ? n : n + bwd_tile_signals(p, bwd_second_tile(p, it, second), out + n);
}

// ---- the training ring's compact rows -----------------------------------------------------------

constexpr int kHalfRows = kBlockRows / 2;  // rows of a half block, the training ring's unit

// Queue position (within its expert) of an expert's last layout block, the only one that may hold
// fewer than 128 real rows: zigzag (plan.cuh) puts it second when the expert has two blocks or more.
MOK_HD int partial_position(int n_blocks) { return n_blocks >= 2 ? 1 : 0; }

// Halves of an expert of `rows` rows that its last layout block takes (1 or 2; 0 when empty).
MOK_HD int last_block_halves(int rows) {
  return rows <= 0 ? 0 : div_up(rows - (div_up(rows, kBlockRows) - 1) * kBlockRows, kHalfRows);
}

// Ring rows that the first j queue blocks of an expert of `rows` rows take: 128 each, 64 less when
// the partial block is among them and holds one half. j = all its blocks gives ceil(rows / 64) * 64.
MOK_HD int expert_compact_rows(int rows, int j) {
  const int n = div_up(rows, kBlockRows);
  return j * kBlockRows - (j > partial_position(n) ? (2 - last_block_halves(rows)) * kHalfRows : 0);
}

// Halves that queue block j of an expert of `rows` rows takes in the training ring (1 or 2).
MOK_HD int compact_block_halves(int rows, int j) {
  return (expert_compact_rows(rows, j + 1) - expert_compact_rows(rows, j)) / kHalfRows;
}

// The expert's queue blocks, of its first ones, that fit `avail` ring rows: the largest j <= n with
// expert_compact_rows(rows, j) <= avail (each block takes 64 or 128 rows, so j = avail / 128 or one
// more).
MOK_HD int compact_blocks_fitting(int rows, int avail) {
  const int n = div_up(rows, kBlockRows);
  if (avail >= expert_compact_rows(rows, n)) return n;
  const int j = avail / kBlockRows;
  return j + 1 <= n && expert_compact_rows(rows, j + 1) <= avail ? j + 1 : j;
}

// N_keep: the largest queue prefix of blocks whose compact rows fit a training ring of ring_rows
// rows, for experts of counts[0 .. L) rows (one thread: O(L)).
MOK_HD int training_ring_keep(const int32_t* counts, int L, int64_t ring_rows) {
  int keep = 0;
  int64_t used = 0;
  for (int l = 0; l < L; ++l) {
    const int all = expert_compact_rows(counts[l], div_up(counts[l], kBlockRows));
    if (used + all > ring_rows) {
      return keep + compact_blocks_fitting(counts[l], (int)(ring_rows - used));
    }
    used += all;
    keep += div_up(counts[l], kBlockRows);
  }
  return keep;
}

}  // namespace mega
}  // namespace mok
