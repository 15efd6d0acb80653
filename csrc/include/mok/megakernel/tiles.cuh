// The compute CTAs of the forward megakernel: the TMA producer thread takes GEMM tiles from the
// compute queue in order, waits (acquire) until the tile's input rows are in the ring, and
// loads them through the stage ring of the grouped GEMMs (mok/gemm/pipeline.cuh); the two
// consumer warpgroups run the same tiles with mma_row_tile and release the tile's arrival on
// its slot counter; fc1's epilogue is the grouped GEMM's SwiGLU epilogue into the ring, fc2's
// pushes the output rows home (push.cuh).
//
// In pair mode (plan.cuh) the launch runs in clusters of two: both CTAs' producers walk the
// same pair tiles (PairLink), each loads its own block's rows and one of the two weight boxes
// of a stage, multicast to both CTAs, and every stage is released by the consumers of both.
//
// The producer hands each tile to the consumers through a small per-stage record written
// before the stage's first `full` arrival (mbarrier arrive: release; try_wait: acquire, both
// at CTA scope), so the consumers learn the tile from the pipeline itself. The queue's end
// (or an aborted wait) is a record of kind kEnd with no TMA bytes.
//
// Both tile kinds are 128 x 256 with a 64-deep K step: fc1 (RowCfg<128, 256, kSwiGLU>: 128
// gate and the same 128 up rows of fc1, SwiGLU epilogue, 128 h columns) and fc2
// (RowCfg<128, 256, kKMajor>: 256 output columns, pushed home); their stage layouts are
// identical, so one shared-memory ring serves both.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/gemm/epilogue.cuh"
#include "mok/gemm/mainloop.cuh"
#include "mok/gemm/pipeline.cuh"
#include "mok/gemm/ptx.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/push.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/trace.cuh"

namespace mok {
namespace mega {

using Fc1Cfg = gemm::RowCfg<kBlockRows, 256, gemm::BLayout::kSwiGLU>;
using Fc2Cfg = gemm::RowCfg<kBlockRows, 256, gemm::BLayout::kKMajor>;
// The weight boxes of a stage, in both modes: fc1's gate and up boxes; fc2's 256 weight rows as
// two boxes of 128 (the clustered grouped GEMM's geometry), so each CTA of a pair can load one.
using Fc1Boxes = Fc1Cfg;
using Fc2Boxes = gemm::RowCfg<kBlockRows, 256, gemm::BLayout::kKMajor, false, true>;
static_assert(Fc1Cfg::kStages == Fc2Cfg::kStages && Fc1Cfg::kStageBytes == Fc2Cfg::kStageBytes &&
                  Fc1Cfg::kABytes == Fc2Cfg::kABytes && Fc1Cfg::kStagingBytes == Fc2Cfg::kStagingBytes &&
                  Fc1Cfg::kSmemBytes == Fc2Cfg::kSmemBytes,
              "fc1 and fc2 tiles share one stage ring");
static_assert(Fc1Cfg::BN / 2 == kFc1Cols && Fc2Cfg::BN == kFc2Cols, "tile widths of the plan");
static_assert(Fc1Cfg::WN == 1 && Fc1Cfg::WM == kTileArrivals, "one 64-row half per consumer warpgroup");

// What the producer tells the consumers about the tile in a stage.
struct StageRecord {
  int32_t kind;     // kFc1, kFc2 or kEnd
  int32_t expert;   // local expert of the row block
  int32_t row0;     // first ring row of the block's slot
  int32_t col;      // column block
  int32_t row_end;  // ring rows >= row_end are padding
  int32_t index;    // position in the compute queue (the trace record)
  int32_t block;    // layout row block (its rows: block * 128 ..); -1: the pair's missing block
  int32_t pad;
};

struct TileOperands {
  gemm::RowOperands fc1;  // A: ring x [ring_rows, H]; B: fc1 weight [L1 * 2I, H]; K = H, N = 2I
  gemm::RowOperands fc2;  // A: ring h [ring_rows, I]; B: fc2 weight [L1 * H, I]; K = I, N = H
  // The same for experts L1 .. L - 1, whose weights lie in a second pair of tensors (a shared
  // expert kept in its own parameters); L1 = L when there is none.
  gemm::RowOperands fc1_2;
  gemm::RowOperands fc2_2;
  int L1;
  // The same A operands with a 64-row box: a tile whose rows 64.. are all padding loads only
  // its first 64 rows (an expert's last block; at ~170 rows per expert, half of all blocks).
  CUtensorMap fc1_a_half;
  CUtensorMap fc2_a_half;
  gemm::SwiGLUForwardEpilogue::Params swiglu;  // h = ring h, scale = ring router weights, gu = null
  __nv_bfloat16* save_gu;                      // [save_rows, 2I] training copy of the pre-activation, or null
  int64_t save_rows;                           // layout rows kept in save_gu (a multiple of 128)
  PushTargets push;                            // fc2's output rows: their home (token, slot) rows
};

// Local expert of ring row block starting at layout row `row`: the largest l < L with
// offs[l] <= row (empty experts share their offset with the next one).
__device__ __forceinline__ int expert_of_row(const int32_t* offs, int L, int row) {
  int lo = 0, hi = L - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offs[mid] <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The layout block whose rows the queues' block `block` of expert e stands for (plan.cuh,
// block order).
__device__ __forceinline__ int layout_block_of(const int32_t* offs, int e, int block) {
  const int first = offs[e] / kBlockRows;
  return layout_block(first, offs[e + 1] / kBlockRows - first, block);
}

// How a tile's stages are filled in pair mode (plan.cuh). kOwnB: the CTA loads its A rows and
// the whole weight tile (always, outside pair mode); kSharedB: its A rows and weight box
// `rank`, multicast to both CTAs of the cluster, whose other box the peer multicasts; kSkip:
// nothing (the pair has no second block), the stages only keep the two CTAs' rings in step.
enum TileLoad : int { kOwnB = 0, kSharedB = 1, kSkip = 2 };

// half_a: the map of A with a 64-row box, when the tile's rows 64.. are all padding (their
// consumer warpgroup only passes the stages on, so the lower half of the A buffer is not read);
// null otherwise. The 128-byte swizzle repeats every 8 rows, so the first 64 rows land where a
// 128-row box puts them. Boxes: the weight tile's two boxes of 128 rows (fc1: gate and up
// rows; fc2: the two halves of its 256 rows), the geometry of the clustered grouped GEMMs.
template <class Cfg, class Boxes>
__device__ __forceinline__ void load_tile(const gemm::RowOperands& op, const CUtensorMap* half_a,
                                          const gemm::RowTile& t, const StageRecord& rec,
                                          const gemm::SmemRing<Cfg>& ring, gemm::PipeState& st,
                                          StageRecord* records, int how, int rank) {
  static_assert(Cfg::BM == 128 && Cfg::kABytes % 2 == 0, "two 64-row halves of A");
  static_assert(gemm::b_boxes<Boxes>() == 2 && Boxes::kStageBytes == Cfg::kStageBytes,
                "two weight boxes per stage, one per CTA of a pair");
  const int nk = op.K / gemm::kBK;
  const CUtensorMap* map_a = half_a != nullptr ? half_a : &op.map_a;
  const uint32_t bytes = half_a != nullptr ? Cfg::kStageBytes - Cfg::kABytes / 2 : Cfg::kStageBytes;
  for (int kb = 0; kb < nk; ++kb) {
    gemm::mbar_wait(&ring.empty[st.stage], st.phase ^ 1u);
    if (kb == 0) records[st.stage] = rec;  // published by the arrive below (release, CTA scope)
    uint64_t* bar = &ring.full[st.stage];
    if (how == kSkip) {
      gemm::mbar_arrive(bar);  // no bytes: the phase completes on this arrival
    } else {
      // kSharedB: this CTA's box and the peer's both count on this barrier (A + the whole tile).
      gemm::mbar_arrive_expect_tx(bar, bytes);
      const int k0 = kb * gemm::kBK;
      gemm::tma_load_2d(ring.a(st.stage), map_a, bar, k0, t.row0);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (how == kSharedB && j != rank) continue;
        uint8_t* dst;
        int c0, c1;
        gemm::b_box<Boxes>(op, t, k0, j, ring.b(st.stage), dst, c0, c1);
        if (how == kSharedB)
          gemm::tma_load_2d_multicast(dst, &op.map_b, bar, c0, c1, 0x3u);
        else
          gemm::tma_load_2d(dst, &op.map_b, bar, c0, c1);
      }
    }
    st.template advance<Cfg::kStages>();
  }
}

struct ComputeContext {
  int32_t* counters;
  Deadline deadline;
  int L;
  Trace trace;
};

// Pair mode: how the producer threads of a cluster share the compute queue. The leader (rank 0)
// takes each position with atomicAdd and hands it to the follower (rank 1) through `ticket`, a
// word of the follower's shared memory, written with st.async; `mail` is a barrier in each CTA:
// in the follower "a position is in `ticket`" (its own arrival and the store's 4 bytes), in the
// leader "the follower has read it" (the follower's arrival). Both then run the same pair tile,
// so their stage rings stay in step.
struct PairLink {
  int rank;         // -1: not in pair mode
  uint64_t* mail;
  int32_t* ticket;
};

// The compute-queue position this producer works on next. In pair mode the leader takes it
// and hands it over; after one of its waits timed out (`end`) it hands over the queue's end.
__device__ __forceinline__ int next_position(const ComputeContext& cx, const PairLink& link, int total, bool end,
                                             uint32_t& mail_phase) {
  if (link.rank < 0) return atomicAdd(&cx.counters[kComputeNext], 1);
  int i;
  if (link.rank == 0) {
    i = end ? total : atomicAdd(&cx.counters[kComputeNext], 1);
    gemm::mbar_wait(link.mail, mail_phase ^ 1u);  // the follower has read the previous position
    // st.async, not a store and a release arrive: a release at cluster scope waits for this
    // thread's earlier memory operations, and the hand-over lies on the chain between a tile's
    // last stage and the next tile's first, which is not hidden after fc2 tiles.
    gemm::st_async_cluster_u32(link.ticket, link.mail, 1, (uint32_t)i);
  } else {
    // One arrival (this thread's) and 4 bytes (the leader's st.async) complete the phase.
    gemm::mbar_arrive_expect_tx(link.mail, 4);
    gemm::mbar_wait(link.mail, mail_phase);
    i = *reinterpret_cast<volatile int32_t*>(link.ticket);
    gemm::mbar_arrive_release_cluster(link.mail, 0);
  }
  mail_phase ^= 1u;
  return i;
}

// The producer thread. offs / cnts: the CTA's shared copies of offsets[0..L] and counts.
__device__ __forceinline__ void produce_tiles(const TileOperands& ops, const Plan& plan, const ComputeContext& cx,
                                              const int32_t* offs, const int32_t* cnts,
                                              const gemm::SmemRing<Fc1Cfg>& ring1,
                                              const gemm::SmemRing<Fc2Cfg>& ring2, StageRecord* records,
                                              const PairLink& link) {
  gemm::tma_prefetch_descriptor(&ops.fc1.map_a);
  gemm::tma_prefetch_descriptor(&ops.fc1.map_b);
  gemm::tma_prefetch_descriptor(&ops.fc2.map_a);
  gemm::tma_prefetch_descriptor(&ops.fc2.map_b);
  if (ops.L1 < cx.L) {
    gemm::tma_prefetch_descriptor(&ops.fc1_2.map_b);
    gemm::tma_prefetch_descriptor(&ops.fc2_2.map_b);
  }
  gemm::tma_prefetch_descriptor(&ops.fc1_a_half);
  gemm::tma_prefetch_descriptor(&ops.fc2_a_half);
  const bool paired = link.rank >= 0;
  const int total = compute_items(plan);
  gemm::PipeState st;
  uint32_t mail_phase = 0;
  bool timed_out = false;
  for (;;) {
    const int i = next_position(cx, link, total, timed_out, mail_phase);
    Item it;
    it.kind = kEnd;
    int how = kOwnB;
    const int64_t record = paired ? 2 * (int64_t)i + link.rank : i;
    if (i < total) {
      it = compute_item(plan, i);
      if (paired) {
        // This CTA's block of the pair; the weights are shared when both blocks are one expert's.
        const int second = pair_partner(plan, it.block);
        if (second >= 0 && expert_of_row(offs, cx.L, it.block * kBlockRows) ==
                               expert_of_row(offs, cx.L, second * kBlockRows))
          how = kSharedB;
        if (link.rank == 1) {
          if (second < 0) how = kSkip;
          else it.block = second;
        }
      }
      if (how != kSkip) {
        cx.trace.stamp(record, kTrTake);
        const Wait w = wait_of(plan, it);
        const int site = it.kind == kFc1 ? MOK_SITE_MK_FC1_WAITS_PULL : MOK_SITE_MK_FC2_WAITS_FC1;
        if (!wait_counter(cx.counters + counter_index(w.counter, w.slot, plan.slots), w.target, cx.deadline, site)) {
          // A single CTA stops here. A CTA of a pair still fills the tile's stages (with rows
          // that may not be in: the launch has failed, its outputs are not used), since the
          // peer's consumers wait for the weight box it multicasts; the leader then ends both.
          if (!paired) it.kind = kEnd;
          timed_out = true;
        }
        if (cx.trace.on()) {
          cx.trace.stamp(record, kTrReady);
          cx.trace.item(record, it.kind, it.block, it.col);
        }
      }
    }
    if (it.kind == kEnd) {
      gemm::mbar_wait(&ring1.empty[st.stage], st.phase ^ 1u);
      records[st.stage].kind = kEnd;
      gemm::mbar_arrive(&ring1.full[st.stage]);  // no bytes: the phase completes on this arrival
      return;
    }
    StageRecord rec;
    rec.kind = it.kind;
    rec.col = it.col;
    rec.index = (int32_t)record;
    gemm::RowTile t{0, 0, it.col, 0, true};
    const CUtensorMap* half_a = nullptr;
    bool second_segment = false;
    if (how == kSkip) {
      rec.expert = 0;
      rec.row0 = 0;
      rec.row_end = 0;
      rec.block = -1;
    } else {
      // The rows just acquired were written with generic stores; order the TMA reads after them.
      fence_proxy_async_global();
      const int slot = it.block % plan.slots;
      const int e = expert_of_row(offs, cx.L, it.block * kBlockRows);
      const int rows_block = layout_block_of(offs, e, it.block);
      const int row = rows_block * kBlockRows;
      int real = offs[e] + cnts[e] - row;
      real = real < 0 ? 0 : (real > kBlockRows ? kBlockRows : real);
      rec.expert = e;
      rec.row0 = slot * kBlockRows;
      rec.row_end = rec.row0 + real;
      rec.block = rows_block;
      // The tile's expert indexes its weight segment.
      second_segment = e >= ops.L1;
      t = gemm::RowTile{second_segment ? e - ops.L1 : e, rec.row0, it.col, rec.row_end, true};
      if (real <= kBlockRows / 2) half_a = it.kind == kFc1 ? &ops.fc1_a_half : &ops.fc2_a_half;
    }
    const int rank = paired ? link.rank : 0;
    if (it.kind == kFc1)
      load_tile<Fc1Cfg, Fc1Boxes>(second_segment ? ops.fc1_2 : ops.fc1, half_a, t, rec, ring1, st, records, how,
                                  rank);
    else
      load_tile<Fc2Cfg, Fc2Boxes>(second_segment ? ops.fc2_2 : ops.fc2, half_a, t, rec, ring2, st, records, how,
                                  rank);
  }
}

// A consumer warpgroup's turn on a tile whose rows it does not compute: wait for each of the
// tile's nk stages and hand it back.
template <class Cfg>
__device__ __forceinline__ void pass_stages(int nk, const gemm::SmemRing<Cfg>& ring, gemm::PipeState& st) {
  for (int kb = 0; kb < nk; ++kb) {
    ring.wait_full(st);
    ring.release(st.stage);
    st.template advance<Cfg::kStages>();
  }
}

// A padding-only warpgroup's share of the training copy of the pre-activation: zeros for its 64
// rows in the tile's 128 gate and 128 up columns (the backward reads every row of a segment).
__device__ __forceinline__ void zero_gu_half(const gemm::SwiGLUForwardEpilogue::Params& sp,
                                             const gemm::RowTile& t, int cw) {
  const int lane = threadIdx.x % 128;
  const int c0 = t.col_block * kFc1Cols;
  for (int q = lane; q < 64 * 2 * (kFc1Cols / 8); q += 128) {
    const int r = q / (2 * (kFc1Cols / 8));
    const int v = q % (2 * (kFc1Cols / 8));
    const int col = (v < kFc1Cols / 8 ? c0 : sp.inter + c0) + 8 * (v % (kFc1Cols / 8));
    const int64_t row = t.row0 + cw * 64 + r;
    *reinterpret_cast<uint4*>(sp.gu + row * 2 * sp.inter + col) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Consumer warpgroup cw (0 or 1): rows cw * 64 .. +64 of every tile. Returns the fc2 tile halves
// it ran (push.cuh counts them as delivered).
__device__ __forceinline__ Fc2Tally consume_tiles(const TileOperands& ops, const Plan& plan, const ComputeContext& cx,
                                                  const gemm::SmemRing<Fc1Cfg>& ring1,
                                                  const gemm::SmemRing<Fc2Cfg>& ring2, const StageRecord* records,
                                                  int cw) {
  gemm::PipeState st;
  float acc[Fc1Cfg::kAccRegs];
  Fc2Tally tally;
  for (;;) {
    ring1.wait_full(st);
    const volatile StageRecord& vr = records[st.stage];
    const int kind = vr.kind;
    if (kind == kEnd) return tally;
    const gemm::RowTile t{vr.expert, vr.row0, vr.col, vr.row_end, true};
    const int record = vr.index;
    const int block = vr.block;
    if (block < 0) {  // pair mode: the pair has no second block; keep the ring in step
      if (kind == kFc1) pass_stages(ops.fc1.K / gemm::kBK, ring1, st);
      else pass_stages(ops.fc2.K / gemm::kBK, ring2, st);
      continue;
    }
    const bool stamps = cx.trace.on() && threadIdx.x % 128 == 0 && cw == 0;
    if (stamps) cx.trace.stamp(record, kTrStart);
    const int slot = t.row0 / kBlockRows;
    // A warpgroup whose 64 rows are all padding only passes the stages on: its rows' h and
    // outputs are never read (fc2 skips the same rows, and padding rows are not pushed). At
    // ~170 rows per expert (Kimi-K2 on 2 GPUs) a third of the blocks' halves are padding.
    const bool padding_only = t.row0 + cw * 64 >= t.row_end;
    if (kind == kFc1) {
      // The training copy of the pre-activation goes to the block's layout rows, when the block
      // lies in the kept prefix: the epilogue addresses gu by ring row, so shift its base by
      // (layout row - ring row). ops.swiglu.gu is null: blocks past the prefix store no gu.
      gemm::SwiGLUForwardEpilogue::Params sp = ops.swiglu;
      if (ops.save_gu != nullptr && (int64_t)(block + 1) * kBlockRows <= ops.save_rows)
        sp.gu = ops.save_gu + ((int64_t)block * kBlockRows - t.row0) * 2 * sp.inter;
      if (padding_only) {
        pass_stages(ops.fc1.K / gemm::kBK, ring1, st);
        if (sp.gu != nullptr) zero_gu_half(sp, t, cw);
      } else {
        gemm::mma_row_tile<Fc1Cfg>(ops.fc1, cw, 0, ring1, st, acc);
        gemm::SwiGLUForwardEpilogue::apply<Fc1Cfg::WGN>(sp, t, cw, 0, Fc1Cfg::BN, acc, nullptr, cw);
        fence_proxy_async_global();  // h is read by fc2's TMA loads
      }
      // Every thread of the warpgroup has stored its fragment: one release covers them all.
      gemm::named_barrier_sync(1 + cw, 128);
      if (threadIdx.x % 128 == 0) red_release_gpu_add(cx.counters + counter_index(kHReady, slot, plan.slots), 1);
    } else {
      if (!padding_only) gemm::mma_row_tile<Fc2Cfg>(ops.fc2, cw, 0, ring2, st, acc);
      else pass_stages(ops.fc2.K / gemm::kBK, ring2, st);
      // The warpgroup's MMAs have read the tile's h rows, and nothing of the slot is read after
      // them: its half of the slot is free before the push (released before the pushed stores,
      // so the release need not wait for them to reach the peers).
      gemm::named_barrier_sync(1 + cw, 128);
      if (threadIdx.x % 128 == 0) red_release_gpu_add(cx.counters + counter_index(kFc2Done, slot, plan.slots), 1);
      if (!padding_only) push_fragment<Fc2Cfg::WGN>(ops.push, block, t.col_block, cw, acc);
      ++tally.halves;
    }
    if (stamps) cx.trace.stamp(record, kTrDone);
  }
}

}  // namespace mega
}  // namespace mok
