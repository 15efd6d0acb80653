// Tile schedulers of the grouped GEMMs. Both are pure functions of a linear tile index, so the
// producer and the consumers of a CTA (and any persistent kernel that embeds the tile loop)
// derive the same tile from the same index without talking to each other.
//
// Row-grouped GEMMs (fc1, fc2, data gradients): the expert-grouped layout pads every expert's
// segment to a multiple of the row block, so the R_pad rows cut into R_pad / BM row blocks
// that each belong to exactly one expert, and every (row block, column block) tile costs the
// same K loop. Routing skew therefore changes only how many tiles an expert has, never what a
// tile costs: striding the persistent CTAs over the linear tile index leaves at most one tile
// of difference between CTAs, whatever the routing. Within an expert, tiles run column block
// by column block over groups of kGroupRows row blocks, so the CTAs that run at the same time
// share the weight tile (and the activation rows stay in L2 across column blocks).
//
// Weight gradients: every expert has the same (M / BM) x (N / BN) output tiles, but a tile's
// K loop is the expert's row count, so tile costs follow the routing. Experts are ordered by
// row count, largest first (ties by index), and tiles are dealt round-robin in that order:
// each round of gridDim tiles has nearly equal costs, and the imbalance summed over all rounds
// is at most one tile of the largest expert (longest-processing-time-first list scheduling).
// A launch may cover only the layout rows [row0, row1) (a chunk of the rows): the row counts
// are then those inside the range, and the experts with no part in it get no tiles at all.
#pragma once

#include <cstdint>

namespace mok {
namespace gemm {

constexpr int kGroupRows = 8;

struct RowTile {
  int expert;
  int row0;       // first row of the tile in the grouped layout
  int col_block;  // column block index
  int row_end;    // first row of the expert's padding (rows >= row_end are padding)
  bool valid;     // false: a cluster's second row block past the expert's last (computed,
                  // never stored)
};

// offs: the CTA's shared-memory copy of offsets[0..L]; counts: device counts[L] (or null: no
// padding mask). offs[0] need not be 0: a launch over a segment of the experts (offsets and
// counts from expert l0 on) tiles rows offs[0] .. offs[L] only.
struct RowScheduler {
  const int32_t* offs;
  const int32_t* counts;
  int L, bm, num_cb, total;
  int first;  // tile index of row offs[0]

  __device__ __forceinline__ RowScheduler(const int32_t* offs_, const int32_t* counts_, int L_,
                                          int bm_, int num_cb_, int64_t rows_cap)
      : offs(offs_), counts(counts_), L(L_), bm(bm_), num_cb(num_cb_) {
    int64_t r_pad = offs[L];
    if (r_pad > rows_cap) r_pad = rows_cap;
    first = (offs[0] / bm) * num_cb;
    total = static_cast<int>(r_pad / bm) * num_cb - first;
    if (total < 0) total = 0;
  }

  __device__ __forceinline__ RowTile tile(int t) const {
    t += first;
    // Largest expert l whose first tile index offs[l] / bm * num_cb is <= t.
    int lo = 0, hi = L - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if ((offs[mid] / bm) * num_cb <= t) lo = mid; else hi = mid - 1;
    }
    const int l = lo;
    const int rb0 = offs[l] / bm;
    const int nrb = offs[l + 1] / bm - rb0;
    const int local = t - rb0 * num_cb;
    const int group = local / (kGroupRows * num_cb);
    const int in_group = local - group * kGroupRows * num_cb;
    const int rows_in_group = min(kGroupRows, nrb - group * kGroupRows);
    const int cb = in_group / rows_in_group;
    const int rb = group * kGroupRows + in_group % rows_in_group;
    RowTile out;
    out.expert = l;
    out.row0 = (rb0 + rb) * bm;
    out.col_block = cb;
    out.row_end = counts != nullptr ? offs[l] + counts[l] : offs[l + 1];
    out.valid = true;
    return out;
  }
};

// The same for clusters of two CTAs: the unit is a pair of consecutive row blocks of one
// expert (an expert with an odd number of row blocks leaves the second CTA of its last pair an
// invalid tile). pstart: shared int32[L + 1], the first pair-tile index of every expert, built
// by build_pair_starts().
struct PairRowScheduler {
  const int32_t* offs;
  const int32_t* pstart;
  const int32_t* counts;
  int L, bm, num_cb, total;

  // One thread; the caller synchronises afterwards.
  __device__ static void build_pair_starts(const int32_t* offs, int32_t* pstart, int L, int bm,
                                           int num_cb, int64_t rows_cap) {
    int acc = 0;
    for (int l = 0; l < L; ++l) {
      pstart[l] = acc;
      const int64_t end = offs[l + 1] < rows_cap ? offs[l + 1] : rows_cap;
      const int nrb = end > offs[l] ? static_cast<int>((end - offs[l]) / bm) : 0;
      acc += (nrb + 1) / 2 * num_cb;
    }
    pstart[L] = acc;
  }

  __device__ __forceinline__ PairRowScheduler(const int32_t* offs_, const int32_t* pstart_,
                                              const int32_t* counts_, int L_, int bm_,
                                              int num_cb_)
      : offs(offs_), pstart(pstart_), counts(counts_), L(L_), bm(bm_), num_cb(num_cb_),
        total(pstart_[L_]) {}

  __device__ __forceinline__ RowTile tile(int t, int rank) const {
    int lo = 0, hi = L - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (pstart[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int l = lo;
    const int rb0 = offs[l] / bm;
    const int nrb = offs[l + 1] / bm - rb0;
    const int npr = (nrb + 1) / 2;
    const int local = t - pstart[l];
    const int group = local / (kGroupRows * num_cb);
    const int in_group = local - group * kGroupRows * num_cb;
    const int pairs_in_group = min(kGroupRows, npr - group * kGroupRows);
    const int cb = in_group / pairs_in_group;
    const int rb = 2 * (group * kGroupRows + in_group % pairs_in_group) + rank;
    RowTile out;
    out.expert = l;
    out.row0 = (rb0 + rb) * bm;
    out.col_block = cb;
    out.row_end = counts != nullptr ? offs[l] + counts[l] : offs[l + 1];
    out.valid = rb < nrb;
    return out;
  }
};

struct WgradTile {
  int expert;
  int row0;        // first K row in a and b (the layout row minus the launch's row0)
  int k_rows;      // K rows of the expert inside the launch's range (a multiple of 64; 0: none)
  int m0, n0;      // output tile origin
  bool carry_in;   // the segment began before the range: acc starts from the carried partial sum
  bool carry_out;  // the segment goes on after the range: acc is carried out, not stored in out
};

// Expert l's part in the layout rows [row0, row1) (row0, row1 multiples of 64): its rows there,
// 0 for an empty expert at a row of the range (row0 <= g0 <= row1, it still gets its zero
// output), -1 when it has no part (its tiles are another launch's).
__device__ __forceinline__ int wgrad_rows_in(const int32_t* offs, int l, int row0, int row1) {
  const int g0 = offs[l], g1 = offs[l + 1];
  if (g0 >= g1) return (row0 <= g0 && g0 <= row1) ? 0 : -1;
  if (g0 >= row1 || g1 <= row0) return -1;
  return min(g1, row1) - max(g0, row0);
}

// order: shared int32[L + 1], filled by build_order(); offs: shared copy of offsets[0..L].
// An order entry packs the expert (low kOrderExpertBits bits) and the 64-row blocks of padding
// its K loop skips (the rest), read from the counts once per CTA instead of once per tile.
constexpr int kOrderExpertBits = 11;
static_assert(kMaxExperts <= (1 << kOrderExpertBits), "an expert index fits the order entry");

struct WgradScheduler {
  const int32_t* offs;
  const int32_t* order;
  int L, num_mb, num_nb, total;
  int row0, row1;   // the launch's layout rows
  bool carry_out;   // a carry-out buffer was given: segments past row1 carry out

  __device__ __forceinline__ WgradScheduler(const int32_t* offs_, const int32_t* order_, int L_,
                                            int num_mb_, int num_nb_, int row0_, int row1_,
                                            bool carry_out_)
      : offs(offs_), order(order_), L(L_), num_mb(num_mb_), num_nb(num_nb_),
        total(order_[L_] * num_mb_ * num_nb_), row0(row0_), row1(row1_), carry_out(carry_out_) {}

  // All threads of the CTA call this, then synchronise: order[rank] = expert, experts with a
  // part in [row0, row1) first by their rows there (descending, ties by index), then the others;
  // order[L] = the number of experts with a part. With counts (global [L] real rows per expert,
  // or null), each entry also carries the 64-row blocks past the block of the expert's last real
  // row (padding, zeros: its K loop skips them; the carries still follow the segment).
  __device__ static void build_order(const int32_t* offs, const int32_t* counts, int32_t* order, int L,
                                     int row0, int row1) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) {
      const int rows = wgrad_rows_in(offs, l, row0, row1);
      int rank = 0;
      for (int m = 0; m < L; ++m) {
        const int r = wgrad_rows_in(offs, m, row0, row1);
        rank += (r > rows) || (r == rows && m < l);
      }
      int skip = 0;
      if (counts != nullptr) {
        const int seg_blocks = (offs[l + 1] - offs[l]) / kBK;
        const int real_blocks = (max(counts[l], 0) + kBK - 1) / kBK;
        skip = min(max(seg_blocks - real_blocks, 0), (1 << (31 - kOrderExpertBits)) - 1);
      }
      order[rank] = l | (skip << kOrderExpertBits);
    }
    if (threadIdx.x == 0) {
      int present = 0;
      for (int l = 0; l < L; ++l) present += wgrad_rows_in(offs, l, row0, row1) >= 0;
      order[L] = present;
    }
  }

  __device__ __forceinline__ WgradTile tile(int t, int bm, int bn) const {
    const int per_expert = num_mb * num_nb;
    const int p = t / per_expert;
    const int local = t - p * per_expert;
    const int l = order[p] & ((1 << kOrderExpertBits) - 1);
    const int g0 = offs[l], g1 = offs[l + 1];
    const int end = g1 - (order[p] >> kOrderExpertBits) * kBK;  // past the last real row's block
    const int lo = max(g0, row0), hi = min(end, row1);
    WgradTile out;
    out.expert = l;
    out.row0 = lo - row0;
    out.k_rows = hi > lo ? hi - lo : 0;
    out.m0 = (local % num_mb) * bm;
    out.n0 = (local / num_mb) * bn;
    out.carry_in = g0 < row0;  // with a part in the range: g1 > row0, the segment spans row0
    out.carry_out = carry_out && g1 > row1;
    return out;
  }
};

}  // namespace gemm
}  // namespace mok
