// The backward megakernel's compute launch (docs/training.md, section 2, step 3 of section 7):
// the fc2 data gradient with the SwiGLU backward (D2), the fc1 data gradient pushing dX and the
// router-weight gradient home (D1) and both weight gradients (W), as one persistent launch on
// the backward plan of bwd_plan.cuh. Included by src/megakernel_backward.cu only.
//
// What it takes from the unfused chain: the dY rows pulled into the expert-grouped layout and the
// kept x, router weights and gate|up rows, all whole-layout arrays. So this launch needs no
// slot ring: the plan runs with one slot per row block (every block is generation 1, a pull never
// waits), one unit per expert (no weight-gradient carry) and every block kept (no replay). The
// in-kernel pulls, the ring and the replay of the full design come on top of it.
//
// Roles, one CTA per SM, as the forward's: warpgroup 0 thread 0 takes compute-queue positions in
// order, reads each position's entry (BwdEntry, resolved from the plan by a kernel before the
// launch), waits (acquire) for the item's inputs and loads its tiles through the stage ring; warps
// 1-3 of warpgroup 0 are the offload crew, running the SwiGLU backward of this CTA's D2 tiles from
// the staging buffers (as the standalone SwiGLUBackwardEpilogue); warpgroups 1 and 2 multiply.
// Every tile is the standalone kernel's tile with the standalone K loop, so every output is
// bitwise the unfused chain's:
//   D2: RowCfg<128, 256, kMNMajor, staged>   = mok_gemm_fc2_dgrad_swiglu (dgu over gate|up, h)
//   D1: the same shape, pushed home          = mok_gemm_fc1_dgrad_push (+ the router-weight sum)
//   W:  WgradCfg<staged>, bf16 TMA stores    = mok_gemm_weight_grad with counts
// All three have the same 48 KB stage, so one three-stage ring and the two 32 KB staging buffers
// serve them.
//
// Hand-overs: the offload crew stores dgu and h with generic stores that D1 and W read with TMA,
// so each crew thread fences the async proxy before the crew's barrier, one thread then releases
// dgu_ready[block] and unit_ready[unit] (red.release.gpu), and the producer that acquires them
// fences again before its TMA loads (mok/memory_order.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/epilogue.cuh"
#include "mok/gemm/mainloop.cuh"
#include "mok/gemm/pipeline.cuh"
#include "mok/gemm/ptx.cuh"
#include "mok/gemm/push.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/bwd_plan.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/tiles.cuh"
#include "mok/megakernel/trace.cuh"
#include "mok/memory_order.cuh"

namespace mok {
namespace mega {

using BwdRowCfg = gemm::RowCfg<kBlockRows, 256, gemm::BLayout::kMNMajor, true>;
using BwdWCfg = gemm::WgradCfg<true>;
static_assert(BwdRowCfg::kStages == BwdWCfg::kStages && BwdRowCfg::kStageBytes == BwdWCfg::kStageBytes &&
                  BwdRowCfg::kABytes == BwdWCfg::kABytes && BwdRowCfg::kStagingBytes == BwdWCfg::kStagingBytes &&
                  BwdRowCfg::kSmemBytes == BwdWCfg::kSmemBytes,
              "D2, D1 and W tiles share one stage ring");
static_assert(BwdRowCfg::WM == kTileArrivals && BwdRowCfg::WN == 1, "one 64-row half per consumer warpgroup");
constexpr int kBwdSlice = 256;  // columns of a router-weight partial sum (SwiGLUBackwardEpilogue)
constexpr int kCrewBarrier = 3;  // named barrier of the offload crew (1 and 2 are the consumers')
constexpr int kCrewThreads = 32 * gemm::kOffloadWarps;

struct BwdOperands {
  gemm::RowOperands d2;   // A: dY rows [rows, H]; B: fc2 weight [L * H, I] (MN-major); K = H, N = I
  gemm::RowOperands d1;   // A: dgu [rows, 2I]; B: fc1 weight [L * 2I, H] (MN-major); K = 2I, N = H
  gemm::WgradOperands w1;  // dW1[e] = dgu^T x: A dgu [rows, 2I], B x [rows, H]; M = 2I, N = H
  gemm::WgradOperands w2;  // dW2[e] = dY^T h: A dY [rows, H], B h [rows, I]; M = H, N = I
  gemm::SwiGLUBackwardEpilogue::Params swiglu;  // gu = dgu (in place), h, partials [I / 256, rows]
  gemm::WgradTmaEpilogue::Params out1;           // dW1 as [L * 2I, H]
  gemm::WgradTmaEpilogue::Params out2;           // dW2 as [L * H, I]
  gemm::PushTargets push;                        // dX rows: their home (token, slot) rows
  int64_t scalars_offset;                        // the router-weight gradient's fp32 scalar slots
  int64_t rows;                                  // layout rows (rows_cap of the arrays)
};

struct BwdParams {
  BwdOperands ops;
  const int32_t* offsets;  // [L + 1], multiples of 128
  const int32_t* counts;   // [L] real rows per expert
  int32_t* counters;       // the launch's counter buffer (BwdCounterLayout), reset before it
  BwdCounterLayout layout;
  int32_t* status;         // int32 [MOK_STATUS_WORDS]
  int64_t timeout_ns;
  int rank;
  int L;
  Trace trace;           // optional timeline (MokBackwardComputeArgs::trace)
  const int32_t* entries;  // BwdEntry [compute items], built by backward_entries_kernel
};

// Trace records (trace.cuh's fields): compute item i -> 2 i (take, ready, start = the consumers'
// first full stage of its first tile, done = their last tile's epilogue); 2 i + 1 -> D2: done =
// the crew's offload released its counters; W: meta = its tile count; CTA c -> capacity - 1 - c
// (take = its start, done = its end).
__device__ __forceinline__ int64_t item_record(int index) { return 2 * (int64_t)index; }

// What the producer tells the consumers about the tile in a stage, and the consumers the crew.
struct BwdRecord {
  int32_t kind;     // kBwdD2, kBwdD1, kBwdW or kEnd
  int32_t expert;
  int32_t row0;     // D2 / D1: first layout row of the block; W: the expert's first row
  int32_t col;      // D2 / D1: column block; W: m0
  int32_t row_end;  // D2 / D1: rows >= row_end are padding; W: K rows
  int32_t n0;       // W: n0
  int32_t matrix;   // W: 1 (dW1) or 2 (dW2)
  int32_t block;    // D2: the queue block (its dgu_ready), W: -
  int32_t unit;     // D2: the block's unit (its unit_ready)
  int32_t index;    // the item's compute-queue position (its trace record)
  int32_t ends;     // bit 0: the item's first tile, bit 1: its last
};

struct BwdShared {
  BwdRecord records[gemm::kMaxStages];
  BwdRecord crew;  // the D2 tile in the staging buffers
};

__device__ __forceinline__ int32_t* bwd_counter(const BwdParams& p, int counter, int index) {
  return p.counters + p.layout.base[counter] + index;
}

// Stage records are published by the `full` barrier's arrival (release at CTA scope); the
// stage's TMA bytes complete its phase.
template <class Cfg>
__device__ __forceinline__ uint64_t* acquire_stage(const gemm::SmemRing<Cfg>& ring, gemm::PipeState& st,
                                                   BwdRecord* records, const BwdRecord& rec, int kb) {
  gemm::mbar_wait(&ring.empty[st.stage], st.phase ^ 1u);
  if (kb == 0) records[st.stage] = rec;
  gemm::mbar_arrive_expect_tx(&ring.full[st.stage], Cfg::kStageBytes);
  return &ring.full[st.stage];
}

__device__ __forceinline__ void load_bwd_row_tile(const gemm::RowOperands& op, const gemm::RowTile& t,
                                                  const gemm::SmemRing<BwdRowCfg>& ring, gemm::PipeState& st,
                                                  BwdRecord* records, const BwdRecord& rec) {
  const int nk = op.K / gemm::kBK;
  for (int kb = 0; kb < nk; ++kb) {
    uint64_t* bar = acquire_stage(ring, st, records, rec, kb);
    const int k0 = kb * gemm::kBK;
    gemm::tma_load_2d(ring.a(st.stage), &op.map_a, bar, k0, t.row0);
#pragma unroll
    for (int j = 0; j < gemm::b_boxes<BwdRowCfg>(); ++j) {
      uint8_t* dst;
      int c0, c1;
      gemm::b_box<BwdRowCfg>(op, t, k0, j, ring.b(st.stage), dst, c0, c1);
      gemm::tma_load_2d(dst, &op.map_b, bar, c0, c1);
    }
    st.template advance<BwdRowCfg::kStages>();
  }
}

__device__ __forceinline__ void load_bwd_w_tile(const gemm::WgradOperands& op, const gemm::WgradTile& t,
                                                const gemm::SmemRing<BwdWCfg>& ring, gemm::PipeState& st,
                                                BwdRecord* records, const BwdRecord& rec) {
  const int nk = t.k_rows / gemm::kBK;
  for (int kb = 0; kb < nk; ++kb) {
    uint64_t* bar = acquire_stage(ring, st, records, rec, kb);
    const int r = t.row0 + kb * gemm::kBK;
    uint8_t* a = ring.a(st.stage);
    uint8_t* b = ring.b(st.stage);
#pragma unroll
    for (int j = 0; j < BwdWCfg::BM / 64; ++j) gemm::tma_load_2d(a + j * 8192, &op.map_a, bar, t.m0 + j * 64, r);
#pragma unroll
    for (int j = 0; j < BwdWCfg::BN / 64; ++j) gemm::tma_load_2d(b + j * 8192, &op.map_b, bar, t.n0 + j * 64, r);
    st.template advance<BwdWCfg::kStages>();
  }
}

// The weight-gradient tile `index` (0 .. wgrad_tiles) of expert e: dW1's tiles n-block by
// n-block with the m-blocks inside, then dW2's (bwd_strip_item's numbering).
__device__ __forceinline__ BwdRecord w_tile_record(const BwdPlan& plan, int index, int e, int row0, int k_rows) {
  BwdRecord r{};
  r.kind = kBwdW;
  r.expert = e;
  r.row0 = row0;
  r.row_end = k_rows;
  const bool first = index < w1_tiles(plan);
  const int local = first ? index : index - w1_tiles(plan);
  const int mblocks = first ? w1_mblocks(plan) : w2_mblocks(plan);
  r.col = (local % mblocks) * BwdWCfg::BM;
  r.n0 = (local / mblocks) * BwdWCfg::BN;
  r.matrix = first ? 1 : 2;
  r.block = -1;
  r.unit = -1;
  return r;
}

__device__ __forceinline__ gemm::WgradTile w_tile_of(const BwdRecord& r) {
  gemm::WgradTile t;
  t.expert = r.expert;
  t.row0 = r.row0;
  t.k_rows = r.row_end;
  t.m0 = r.col;
  t.n0 = r.n0;
  t.carry_in = false;
  t.carry_out = false;
  return t;
}

// Item at position i of the compute queue, in the plan's phases (bwd_plan.cuh) with the phase's
// parts in another order: D2(k) first, then D1(k - 1) and W(k - 1). In the plan's order D1(k - 1)
// follows D2(k - 1) at once, so every producer that takes one of its first tiles waits for the
// offload of a D2 tile just issued (its consumers idle meanwhile, once per minibatch); here a
// minibatch of D2 tiles lies between them. A phase holds the same items either way, so the phase
// starts are the plan's. Every block is kept: the plan has no R item.
__device__ __forceinline__ BwdItem compute_item_d2_first(const BwdPlan& p, int i) {
  int lo = 0, hi = p.n_mb + 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.phase_start[mid] <= i) lo = mid; else hi = mid - 1;
  }
  const int k = lo - 1;
  int off = i - p.phase_start[lo];
  if (off < d2_items(p, k)) return bwd_sweep_item(p, kBwdD2, mb_first(p, k), mb_size(p, k), d2_cols(p), off);
  off -= d2_items(p, k);
  if (off < d1_items(p, k - 1))
    return bwd_sweep_item(p, kBwdD1, mb_first(p, k - 1), mb_size(p, k - 1), d1_cols(p), off);
  off -= d1_items(p, k - 1);
  const int s = w_strips(p);
  return bwd_strip_item(p, p.w_units[k - 1] + off / s, off % s);
}

// Item `off` of a sweep over the blocks [first, first + nb) of a minibatch with `cols` columns,
// in groups cut at expert boundaries (runs of one expert's blocks, at most group_blocks each),
// column by column inside a group: the tiles that run together share the expert's weight tile,
// and no group reads an expert's weights twice (bwd_sweep_item's groups of group_blocks blocks
// cut experts).
__device__ __forceinline__ BwdItem expert_sweep_item(const BwdPlan& p, const int32_t* offs, int L, int32_t kind,
                                                     int first, int nb, int cols, int off) {
  int b = first;
  for (;;) {
    const int e = expert_of_row(offs, L, b * kBlockRows);
    const int expert_end = offs[e + 1] / kBlockRows;
    int run = imin(imin(expert_end, first + nb) - b, p.group_blocks);
    if (off < run * cols) {
      BwdItem it;
      it.kind = kind;
      it.col = off / run;
      it.block = b + off % run;
      it.unit = unit_of(p, it.block);
      it.first_tile = 0;
      it.tiles = 0;
      return it;
    }
    off -= run * cols;
    b += run;
  }
}

// compute_item_d2_first with the D sweeps of expert_sweep_item.
__device__ __forceinline__ BwdItem launch_item(const BwdPlan& p, const int32_t* offs, int L, int i) {
  BwdItem it = compute_item_d2_first(p, i);
  if (it.kind != kBwdD2 && it.kind != kBwdD1) return it;
  int lo = 0, hi = p.n_mb + 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.phase_start[mid] <= i) lo = mid; else hi = mid - 1;
  }
  const int k = lo - 1;
  int off = i - p.phase_start[lo];
  if (it.kind == kBwdD2) return expert_sweep_item(p, offs, L, kBwdD2, mb_first(p, k), mb_size(p, k), d2_cols(p), off);
  off -= d2_items(p, k);
  return expert_sweep_item(p, offs, L, kBwdD1, mb_first(p, k - 1), mb_size(p, k - 1), d1_cols(p), off);
}

// One compute-queue position, resolved before the launch by backward_entries_kernel: the
// producer reads it (prefetched one item ahead) instead of searching the plan's tables between
// two tiles, where a single thread's lookups (~2 us) left the consumers idle.
struct BwdEntry {
  int32_t kind;        // kBwdD2, kBwdD1 or kBwdW
  int32_t block;       // D2 / D1: the queue block; W: its unit
  int32_t col;         // D2 / D1: column block; W: the strip's first weight-gradient tile
  int32_t unit;        // D2: the block's unit (its unit_ready); W: the strip's tiles
  int32_t expert;
  int32_t row0;        // D2 / D1: first layout row of the block; W: the expert's first row
  int32_t row_end;     // D2 / D1: rows >= row_end are padding; W: K rows (counts rounded up to 64)
  int32_t wait_word;   // counters[wait_word] >= wait_target before the item starts; -1: no wait
  int32_t wait_target;
  int32_t pad[3];
};
static_assert(sizeof(BwdEntry) == 48, "three 16-byte loads");

// The entry of position i: the item in this launch's order, its tile geometry and its one input
// wait (dy_ready is met before the launch; one unit per expert has no carry; no pair tiles).
__device__ __forceinline__ BwdEntry make_entry(const BwdParams& p, const BwdPlan& plan, const BwdItem& it) {
  BwdWait all[kMaxBwdWaits];
  const int n = bwd_waits(plan, it, all);
  BwdEntry e{};
  e.kind = it.kind;
  e.wait_word = -1;
  for (int w = 0; w < n; ++w) {
    if (all[w].counter == kDyReady) continue;
    if (e.wait_word >= 0) __trap();  // unreachable: this launch's items wait for one counter at most
    e.wait_word = (int32_t)(p.layout.base[all[w].counter] + all[w].index);
    e.wait_target = all[w].target;
  }
  if (it.kind == kBwdW) {
    const int x = expert_of_row(p.offsets, p.L, plan.unit_start[it.unit] * kBlockRows);
    e.block = it.unit;
    e.col = it.first_tile;
    e.unit = it.tiles;
    e.expert = x;
    e.row0 = p.offsets[x];
    e.row_end = (p.counts[x] + gemm::kBK - 1) / gemm::kBK * gemm::kBK;
  } else {
    const int x = expert_of_row(p.offsets, p.L, it.block * kBlockRows);
    e.block = it.block;
    e.col = it.col;
    e.unit = it.unit;
    e.expert = x;
    e.row0 = layout_block_of(p.offsets, x, it.block) * kBlockRows;
    e.row_end = p.offsets[x] + p.counts[x];
  }
  return e;
}

__device__ __forceinline__ BwdEntry load_entry(const BwdParams& p, int i, int total) {
  BwdEntry e;
  if (i >= total) {
    e.kind = kEnd;
    return e;
  }
  const int4* src = reinterpret_cast<const int4*>(p.entries) + 3 * (int64_t)i;
  int4* dst = reinterpret_cast<int4*>(&e);
  dst[0] = src[0];
  dst[1] = src[1];
  dst[2] = src[2];
  return e;
}

__device__ __forceinline__ int wait_site(const BwdParams& p, int word) {
  return word < p.layout.base[kUnitReady] ? MOK_SITE_MK_D1_WAITS_D2 : MOK_SITE_MK_W_WAITS_UNIT;
}

// The producer thread. Positions are taken two ahead and entries loaded one ahead, so neither
// the queue atomic's round trip nor the entry's load lies between two tiles: what is left there
// is the item's input wait (an acquire of a counter, usually met long before) and the TMA loads.
__device__ __forceinline__ void produce_bwd(const BwdParams& p, const BwdPlan& plan,
                                            const gemm::SmemRing<BwdRowCfg>& ring,
                                            const gemm::SmemRing<BwdWCfg>& wring, BwdRecord* records) {
  const BwdOperands& ops = p.ops;
  gemm::tma_prefetch_descriptor(&ops.d2.map_a);
  gemm::tma_prefetch_descriptor(&ops.d2.map_b);
  gemm::tma_prefetch_descriptor(&ops.d1.map_a);
  gemm::tma_prefetch_descriptor(&ops.d1.map_b);
  const Deadline d{p.status, p.timeout_ns, p.rank};
  const int total = bwd_compute_items(plan);
  gemm::PipeState st;
  int i = atomicAdd(&p.counters[kComputeNext], 1);
  int ahead = i < total ? atomicAdd(&p.counters[kComputeNext], 1) : total;
  int ahead2 = ahead < total ? atomicAdd(&p.counters[kComputeNext], 1) : total;
  BwdEntry cur = load_entry(p, i, total);
  BwdEntry nxt = load_entry(p, ahead, total);
  for (;;) {
    bool end = cur.kind == kEnd;
    if (!end) p.trace.stamp(item_record(i), kTrTake);
    if (!end && cur.wait_word >= 0) {
      end = !wait_counter(p.counters + cur.wait_word, cur.wait_target, d, wait_site(p, cur.wait_word));
      // The rows acquired were written with generic stores; order the TMA reads after them.
      if (!end) fence_proxy_async_global();
    }
    if (end) {
      gemm::mbar_wait(&ring.empty[st.stage], st.phase ^ 1u);
      records[st.stage].kind = kEnd;
      gemm::mbar_arrive(&ring.full[st.stage]);  // no bytes: the phase completes on this arrival
      return;
    }
    if (p.trace.on()) {
      p.trace.stamp(item_record(i), kTrReady);
      p.trace.item(item_record(i), cur.kind, cur.block, cur.col);
      if (cur.kind == kBwdW) p.trace.put(item_record(i) + 1, kTrMeta, cur.unit);
    }
    if (cur.kind == kBwdW) {
      for (int t = 0; t < cur.unit; ++t) {
        BwdRecord rec = w_tile_record(plan, cur.col + t, cur.expert, cur.row0, cur.row_end);
        rec.index = i;
        rec.ends = (t == 0 ? 1 : 0) | (t == cur.unit - 1 ? 2 : 0);
        load_bwd_w_tile(rec.matrix == 1 ? ops.w1 : ops.w2, w_tile_of(rec), wring, st, records, rec);
      }
    } else {
      BwdRecord rec{};
      rec.kind = cur.kind;
      rec.expert = cur.expert;
      rec.row0 = cur.row0;
      rec.col = cur.col;
      rec.row_end = cur.row_end;
      rec.block = cur.block;
      rec.unit = cur.unit;
      rec.index = i;
      rec.ends = 3;
      const gemm::RowTile t{cur.expert, cur.row0, cur.col, cur.row_end, true};
      load_bwd_row_tile(cur.kind == kBwdD2 ? ops.d2 : ops.d1, t, ring, st, records, rec);
    }
    cur = nxt;
    i = ahead;
    ahead = ahead2;
    nxt = load_entry(p, ahead, total);
    if (ahead2 < total) ahead2 = atomicAdd(&p.counters[kComputeNext], 1);
  }
}

// The router-weight gradient of layout rows row0 .. row0 + 63: the sum of the row's partials in
// slice order (as gemm::sum_partials), pushed to its home (token, slot) as push_row_scalars does.
__device__ __forceinline__ void push_router_grads(const BwdOperands& ops, int64_t row0) {
  if (threadIdx.x % 4 != 0) return;
  const gemm::Fragment f;
  const int slices = ops.swiglu.inter / kBwdSlice;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t row = row0 + f.row + 8 * j;
    const int2 entry = gemm::push_entry<true>(ops.push, row, ops.rows);
    if (entry.x < 0) continue;
    float s = 0.f;
    for (int k = 0; k < slices; ++k) s += ops.swiglu.partials[k * ops.rows + row];
    reinterpret_cast<float*>(gemm::push_region(ops.push, entry.x) + ops.scalars_offset)[entry.y] = s;
  }
}

// Consumer warpgroup cw (0 or 1): rows cw * 64 .. +64 of every row tile, m-rows of every W tile.
__device__ __forceinline__ void consume_bwd(const BwdParams& p, const gemm::SmemRing<BwdRowCfg>& ring,
                                            const gemm::SmemRing<BwdWCfg>& wring, BwdShared& sh, int cw) {
  const BwdOperands& ops = p.ops;
  gemm::PipeState st;
  uint32_t staged_phase = 0;  // flips with every tile handed to the crew
  float acc[BwdRowCfg::kAccRegs];
  uint8_t* staging = ring.staging(cw);
  for (;;) {
    ring.wait_full(st);
    const volatile BwdRecord& vr = sh.records[st.stage];
    BwdRecord rec;
    rec.kind = vr.kind;
    if (rec.kind == kEnd) {
      // Tell the crew: the staging buffers once more, with the end as their record.
      ring.wait_staging_free(staged_phase);
      if (cw == 0 && threadIdx.x % 128 == 0) sh.crew.kind = kEnd;
      ring.publish_staged();
      gemm::staging_finish();
      return;
    }
    rec.expert = vr.expert;
    rec.row0 = vr.row0;
    rec.col = vr.col;
    rec.row_end = vr.row_end;
    rec.n0 = vr.n0;
    rec.matrix = vr.matrix;
    rec.block = vr.block;
    rec.unit = vr.unit;
    rec.index = vr.index;
    rec.ends = vr.ends;
    const bool stamp = p.trace.on() && threadIdx.x == 128;
    if (stamp && (rec.ends & 1)) p.trace.stamp(item_record(rec.index), kTrStart);
    if (rec.kind == kBwdW) {
      const gemm::WgradTile t = w_tile_of(rec);
      gemm::mma_wgrad_tile<BwdWCfg>(rec.matrix == 1 ? ops.w1 : ops.w2, t, cw, wring, st, acc);
      ring.wait_staging_free(staged_phase);  // the crew has read the last D2 tile staged here
      gemm::WgradTmaEpilogue::apply<BwdWCfg::WGN>(rec.matrix == 1 ? ops.out1 : ops.out2, t, cw, acc, staging, cw);
      if (stamp && (rec.ends & 2)) p.trace.stamp(item_record(rec.index), kTrDone);
      continue;
    }
    if (rec.kind == kBwdD2) {
      gemm::mma_row_tile<BwdRowCfg>(ops.d2, cw, 0, ring, st, acc);
      ring.wait_staging_free(staged_phase);
      gemm::staging_acquire(cw);  // this warpgroup's TMA stores of a W tile have read the buffer
      gemm::stage_tile<BwdRowCfg::WGN>(staging, acc);
      if (cw == 0 && threadIdx.x % 128 == 0) {
        BwdRecord& c = sh.crew;
        c = rec;
      }
      ring.publish_staged();
      staged_phase ^= 1u;
    } else {
      gemm::mma_row_tile<BwdRowCfg>(ops.d1, cw, 0, ring, st, acc);
      const int64_t row0 = (int64_t)rec.row0 + cw * 64;
      gemm::push_fragment<BwdRowCfg::WGN>(ops.push, row0, rec.col * BwdRowCfg::BN, ops.rows, acc);
      if (rec.col == 0) push_router_grads(ops, row0);
    }
    if (stamp) p.trace.stamp(item_record(rec.index), kTrDone);
  }
}

// The offload crew (warps 1-3 of warpgroup 0): the SwiGLU backward of each D2 tile the
// consumers staged, then its signals.
__device__ __forceinline__ void offload_bwd(const BwdParams& p, const gemm::SmemRing<BwdRowCfg>& ring,
                                            const BwdShared& sh) {
  const int e = threadIdx.x / 32 - 1;
  uint32_t phase = 0;
  for (;;) {
    ring.wait_staged(phase);
    const volatile BwdRecord& c = sh.crew;
    if (c.kind == kEnd) return;
    const gemm::RowTile t{c.expert, c.row0, c.col, c.row_end, true};
    const int block = c.block, unit = c.unit, index = c.index;
    gemm::SwiGLUBackwardEpilogue::offload<BwdRowCfg>(p.ops.swiglu, t, ring.staging(0), e);
    ring.release_staged();
    phase ^= 1u;
    fence_proxy_async_global();  // dgu and h are read by D1's and W's TMA loads
    gemm::named_barrier_sync(kCrewBarrier, kCrewThreads);
    if (threadIdx.x == 32) {
      red_release_gpu_add(bwd_counter(p, kDguReady, block), 1);
      red_release_gpu_add(bwd_counter(p, kUnitReady, unit), 1);
      p.trace.stamp(item_record(index) + 1, kTrDone);
    }
  }
}

__global__ void __launch_bounds__(gemm::kThreads, 1) backward_compute_kernel(const __grid_constant__ BwdParams p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const gemm::SmemRing<BwdRowCfg> ring(smem_raw, 1);
  const gemm::SmemRing<BwdWCfg> wring(smem_raw, 1);
  BwdShared& sh = *reinterpret_cast<BwdShared*>(smem_raw + BwdRowCfg::kSmemBytes);
  if (threadIdx.x == 0) ring.init_barriers();
  __syncthreads();
  const BwdPlan plan = bwd_plan_of(p.counters + p.layout.tables);
  const int64_t cta_record = p.trace.capacity - 1 - blockIdx.x;
  if (threadIdx.x == 0 && p.trace.on()) {
    p.trace.stamp(cta_record, kTrTake);
    p.trace.put(cta_record, kTrMeta, kTraceCtaKind);
    p.trace.put(cta_record, kTrCta, blockIdx.x);
  }
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    if (threadIdx.x == 0) produce_bwd(p, plan, ring, wring, sh.records);
    else if (threadIdx.x >= 32) offload_bwd(p, ring, sh);
  } else {
    consume_bwd(p, ring, wring, sh, wg - 1);
  }
  if (p.trace.on()) {
    __syncthreads();
    if (threadIdx.x == 0) p.trace.stamp(cta_record, kTrDone);
  }
}

// Zeroes the launch's counters (the queue position and the counter arrays; the header's epoch is
// the forward's and is left alone) and builds the plan tables from the layout, one CTA.
__global__ void backward_reset_kernel(int32_t* counters, BwdCounterLayout layout, const int32_t* offsets, int L,
                                      int mb_blocks, int slots, int unit_blocks, int h_cols, int i_cols,
                                      int strip_tiles, int group_blocks) {
  __shared__ int32_t blocks[gemm::kMaxExperts];
  for (int64_t i = kComputeNext + threadIdx.x; i < layout.tables; i += blockDim.x) counters[i] = 0;
  for (int l = threadIdx.x; l < L; l += blockDim.x) blocks[l] = (offsets[l + 1] - offsets[l]) / kBlockRows;
  __syncthreads();
  if (threadIdx.x == 0) {
    int n_blocks = 0;
    for (int l = 0; l < L; ++l) n_blocks += blocks[l];
    build_bwd_tables(blocks, L, mb_blocks, slots, unit_blocks, n_blocks, h_cols, i_cols, strip_tiles, group_blocks,
                     0, counters + layout.tables);
  }
}

// Resolves every compute-queue position into its BwdEntry (launch_item, make_entry), after the
// reset kernel built the plan tables; a grid-stride loop over the positions.
__global__ void backward_entries_kernel(const __grid_constant__ BwdParams p) {
  const BwdPlan plan = bwd_plan_of(p.counters + p.layout.tables);
  const int total = bwd_compute_items(plan);
  BwdEntry* out = reinterpret_cast<BwdEntry*>(const_cast<int32_t*>(p.entries));
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
    out[i] = make_entry(p, plan, launch_item(plan, p.offsets, p.L, i));
}

// Zeroes the weight gradients of the experts without rows (the launch has no tile for them).
__global__ void zero_empty_experts_kernel(const int32_t* counts, int L, uint4* d_fc1, int64_t fc1_vecs, uint4* d_fc2,
                                          int64_t fc2_vecs) {
  const int e = blockIdx.y;
  if (e >= L || counts[e] > 0) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < fc1_vecs + fc2_vecs;
       i += (int64_t)gridDim.x * blockDim.x) {
    if (i < fc1_vecs) d_fc1[e * fc1_vecs + i] = make_uint4(0u, 0u, 0u, 0u);
    else d_fc2[e * fc2_vecs + (i - fc1_vecs)] = make_uint4(0u, 0u, 0u, 0u);
  }
}

}  // namespace mega
}  // namespace mok
