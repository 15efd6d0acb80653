// The megakernels' work plans (mok/megakernel/plan.cuh, the forward's; bwd_plan.cuh, the
// backward's) on the host, for the CPU tests that replay the kernels' protocols and for tools that
// map a trace back to the layout. No CUDA call.
#include <cstdint>

#include "mok/cuda_check.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/bwd_plan.cuh"
#include "mok/megakernel/plan.cuh"

using namespace mok::mega;

MOK_API int64_t mok_megakernel_counter_words(int ring_slots) {
  return ring_slots >= 1 ? counter_words(ring_slots) : 0;
}

MOK_API int mok_megakernel_plan_item(int queue, int index, int n_blocks, int mb_blocks, int slots,
                                     int n1, int n2, int pairs, int group_blocks, int32_t* out) {
  MOK_REQUIRE(out && n_blocks >= 0 && mb_blocks >= 1 && slots >= 1 && n1 >= 1 && n2 >= 1);
  MOK_REQUIRE(queue == kComputeQueue || queue == kPullQueue || queue == kFirstPullQueue);
  MOK_REQUIRE(pairs == 0 || pairs == 1);
  MOK_REQUIRE(group_blocks >= kMinGroupBlocks && group_blocks <= kMaxGroupBlocks && group_blocks % 2 == 0);
  Plan plan{n_blocks, mb_blocks, slots, n1, n2};
  plan.pairs = pairs;
  plan.group_blocks = group_blocks;
  MOK_REQUIRE(index >= 0 && index < queue_items(plan, queue));
  const Item it = queue_item(plan, queue, index);
  const Wait w = wait_of(plan, it);
  out[0] = it.kind;
  out[1] = it.block;
  out[2] = it.col;
  out[3] = w.counter;
  out[4] = w.slot;
  out[5] = w.target;
  return MOK_OK;
}

MOK_API int mok_megakernel_layout_blocks(const int32_t* counts, int L, int32_t* out, int64_t out_len) {
  MOK_REQUIRE(counts != nullptr && out != nullptr && L >= 1);
  int64_t n_blocks = 0;
  for (int l = 0; l < L; ++l) {
    MOK_REQUIRE(counts[l] >= 0);
    n_blocks += (counts[l] + kBlockRows - 1) / kBlockRows;
  }
  MOK_REQUIRE(n_blocks <= out_len && n_blocks < INT32_MAX);
  int first = 0;
  for (int l = 0; l < L; ++l) {
    const int n = (counts[l] + kBlockRows - 1) / kBlockRows;
    for (int b = first; b < first + n; ++b) out[b] = layout_block(first, n, b);
    first += n;
  }
  return MOK_OK;
}

// Words of an item's record from mok_megakernel_backward_plan_item: 8 fields, then the waits and
// signals as (counter, index, value) triples.
static constexpr int kBwdItemWords = 8 + 3 * (kMaxBwdWaits + kMaxBwdSignals);

MOK_API int mok_megakernel_backward_tables(const int32_t* expert_blocks, int L, int mb_blocks, int slots,
                                           int unit_blocks, int n_keep, int h_cols, int i_cols, int strip_tiles,
                                           int group_blocks, int pairs, int32_t* tables, int64_t words,
                                           int64_t* words_needed) {
  MOK_REQUIRE(expert_blocks != nullptr && words_needed != nullptr && L >= 1 && (pairs == 0 || pairs == 1));
  MOK_REQUIRE(mb_blocks >= 1 && slots >= 1 && unit_blocks >= 1 && n_keep >= 0 && h_cols >= 1 && i_cols >= 1);
  MOK_REQUIRE(strip_tiles >= 1 && strip_tiles <= kMaxStripTiles);
  MOK_REQUIRE(group_blocks >= kMinGroupBlocks && group_blocks <= kMaxGroupBlocks && group_blocks % 2 == 0);
  int64_t n_blocks = 0, n_units = 0;
  for (int l = 0; l < L; ++l) {
    MOK_REQUIRE(expert_blocks[l] >= 0);
    n_blocks += expert_blocks[l];
    n_units += (expert_blocks[l] + (int64_t)unit_blocks - 1) / unit_blocks;
  }
  // Every position, count and target of the plan fits an int32 (a unit has at most one W
  // position per weight-gradient tile).
  const int64_t tiles = 6 * (int64_t)h_cols * i_cols;
  MOK_REQUIRE(n_blocks * (3 * (int64_t)i_cols + h_cols) + n_units * tiles < INT32_MAX);
  MOK_REQUIRE(kTileArrivals * tiles * (n_units + 1) < INT32_MAX && (int64_t)slots * (n_blocks + 1) < INT32_MAX);
  *words_needed = bwd_table_words((int)n_blocks, mb_blocks, (int)n_units);
  if (tables == nullptr) return MOK_OK;
  MOK_REQUIRE(words >= *words_needed);
  build_bwd_tables(expert_blocks, L, mb_blocks, slots, unit_blocks, n_keep, h_cols, i_cols, strip_tiles,
                   group_blocks, pairs, tables);
  return MOK_OK;
}

MOK_API int mok_megakernel_backward_counter_layout(int slots, int max_blocks, int L, int unit_blocks, int mb_blocks,
                                                   int h_cols, int i_cols, int64_t* out, int out_len) {
  MOK_REQUIRE(out != nullptr && out_len >= 2 * kNumBwdCounters + 2);
  MOK_REQUIRE(slots >= 1 && max_blocks >= 0 && L >= 1 && unit_blocks >= 1 && mb_blocks >= 1 && h_cols >= 1 &&
              i_cols >= 1);
  const int64_t units = (int64_t)max_blocks / unit_blocks + L;
  const int64_t tiles = 6 * (int64_t)h_cols * i_cols;
  MOK_REQUIRE(units < INT32_MAX && tiles < INT32_MAX &&
              kHeaderWords + 4 * (int64_t)slots + 2 * units + tiles + 4 * ((int64_t)max_blocks + units + 4) < INT32_MAX);
  BwdPlan p{};
  p.h_cols = h_cols;
  p.i_cols = i_cols;
  const BwdCounterLayout l = bwd_counter_layout(slots, bwd_max_units(max_blocks, L, unit_blocks), wgrad_tiles(p),
                                                bwd_table_words(max_blocks, mb_blocks, (int)units));
  for (int c = 0; c < kNumBwdCounters; ++c) {
    out[c] = l.base[c];
    out[kNumBwdCounters + c] = l.length[c];
  }
  out[2 * kNumBwdCounters] = l.tables;
  out[2 * kNumBwdCounters + 1] = l.words;
  return MOK_OK;
}

// The plan of `tables` when its header is one mok_megakernel_backward_tables writes and the
// arrays fit in `words`; false otherwise.
static bool bwd_tables_valid(const int32_t* tables, int64_t words) {
  if (tables == nullptr || words < kTabHeaderWords) return false;
  const BwdPlan p = bwd_plan_of(tables);
  if (p.n_blocks < 0 || p.mb_blocks < 1 || p.slots < 1 || p.unit_blocks < 1 || p.n_keep < 0 || p.h_cols < 1 ||
      p.i_cols < 1 || p.strip_tiles < 1 || p.strip_tiles > kMaxStripTiles || p.group_blocks < 1 ||
      (p.pairs != 0 && p.pairs != 1) || (p.pairs == 1 && p.group_blocks < 2) ||
      p.n_units < 0 || p.n_units > p.n_blocks || p.n_mb != div_up(p.n_blocks, p.mb_blocks))
    return false;
  return words >= bwd_table_words(p.n_blocks, p.mb_blocks, p.n_units);
}

MOK_API int mok_megakernel_backward_plan_sizes(const int32_t* tables, int64_t words, int64_t* out) {
  MOK_REQUIRE(out != nullptr && bwd_tables_valid(tables, words));
  const BwdPlan p = bwd_plan_of(tables);
  out[0] = bwd_queue_items(p, kComputeQueue);
  out[1] = bwd_queue_items(p, kPullQueue);
  out[2] = bwd_queue_items(p, kFirstPullQueue);
  out[3] = p.n_units;
  out[4] = p.n_mb;
  out[5] = wgrad_tiles(p);
  out[6] = w_strips(p);
  out[7] = bwd_first_blocks(p);
  return MOK_OK;
}

MOK_API int mok_megakernel_backward_plan_item(int queue, int index, const int32_t* tables, int64_t words,
                                              int32_t* out, int out_len) {
  MOK_REQUIRE(out != nullptr && out_len >= kBwdItemWords && bwd_tables_valid(tables, words));
  MOK_REQUIRE(queue == kComputeQueue || queue == kPullQueue || queue == kFirstPullQueue);
  const BwdPlan p = bwd_plan_of(tables);
  MOK_REQUIRE(index >= 0 && index < bwd_queue_items(p, queue));
  const BwdItem it = bwd_queue_item(p, queue, index);
  BwdWait waits[kMaxBwdWaits];
  BwdSignal signals[kMaxBwdSignals];
  const int nw = bwd_waits(p, it, waits);
  const int ns = bwd_signals(p, it, signals);
  const int32_t head[8] = {it.kind, it.block, it.col, it.unit, it.first_tile, it.tiles, nw, ns};
  int k = 0;
  for (int i = 0; i < 8; ++i) out[k++] = head[i];
  for (int i = 0; i < nw; ++i) {
    out[k++] = waits[i].counter;
    out[k++] = waits[i].index;
    out[k++] = waits[i].target;
  }
  for (int i = 0; i < ns; ++i) {
    out[k++] = signals[i].counter;
    out[k++] = signals[i].index;
    out[k++] = signals[i].amount;
  }
  return MOK_OK;
}

MOK_API int mok_megakernel_training_ring_rows_of(const int32_t* counts, int L, int64_t ring_rows, int32_t* n_keep,
                                                 int32_t* out, int64_t out_len) {
  MOK_REQUIRE(counts != nullptr && n_keep != nullptr && out != nullptr && L >= 1 && ring_rows >= 0);
  int64_t n_blocks = 0, rows = 0;
  for (int l = 0; l < L; ++l) {
    MOK_REQUIRE(counts[l] >= 0);
    n_blocks += div_up(counts[l], kBlockRows);
    rows += (int64_t)div_up(counts[l], kBlockRows) * kBlockRows;
  }
  MOK_REQUIRE(2 * n_blocks <= out_len && rows < INT32_MAX);
  *n_keep = training_ring_keep(counts, L, ring_rows);
  // Each expert's blocks start at its compact offset, the ring rows of the experts before it.
  int b = 0, offset = 0;
  for (int l = 0; l < L; ++l) {
    const int n = div_up(counts[l], kBlockRows);
    for (int j = 0; j < n; ++j, ++b) {
      out[2 * b] = offset + expert_compact_rows(counts[l], j);
      out[2 * b + 1] = compact_block_halves(counts[l], j);
    }
    offset += expert_compact_rows(counts[l], n);
  }
  return MOK_OK;
}
