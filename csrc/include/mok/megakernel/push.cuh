// The combine push of the forward megakernel, done by the compute CTAs: an fc2 tile's epilogue
// stores its output rows straight into their home ranks' (token, slot) rows (peer memory for
// the rows of other ranks), and each compute CTA, once its queue is empty, counts its fc2 tile
// halves as delivered after a system-scope fence. Whoever completes the count raises every
// rank's combine-done flag for this rank.
//
// Until the twelfth session the epilogue wrote the output rows back into the ring and push CTAs
// (and compute CTAs with nothing left to compute) copied them home: the SMs, the ring write and
// re-read, and the last push after the last tile were the cost (docs/megakernel.md).
//
// Memory ordering. The home rank reads its slots after acquiring every rank's flag
// (slot_sum.cuh). Every thread that stored rows issues fence.sc.sys (__threadfence_system)
// after its last tile, then the warpgroup barrier and one acq_rel count per warpgroup; the
// thread whose count completes the launch's total has acquired every other count, and its
// system-scope fence and release stores make all of the launch's stores happen-before each
// peer's acquire of the flag. One fence per warpgroup and launch, not per tile: a fence waits
// for the thread's stores to reach the peer, which would stall the warpgroup's next tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm/epilogue.cuh"
#include "mok/gemm/ptx.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/sync.cuh"

namespace mok {
namespace mega {

// Where a block's output rows go.
struct PushTargets {
  const uint64_t* bases;  // device [P]: every rank's workspace region
  int64_t slots_offset;   // byte offset of the bf16 combine slots [T_cap, K, H] in a region
  const int32_t* table;   // schedule [R_cap, 2]: (source rank or -1 for padding, token * K + slot)
  int H;
};

// Consumer warpgroup cw's 64 x WGN fp32 accumulator of fc2 tile (block, col_block), rounded to
// bf16, into the home rows of its rows (padding rows: nothing). The same fragments, rounding
// and 16-byte vectors (a quad transpose) as gemm::StoreEpilogue, so the rows are bitwise those
// of the composed kernels. Called by the 128 threads of the warpgroup.
template <int WGN>
__device__ __forceinline__ void push_fragment(const PushTargets& p, int block, int col_block, int cw,
                                              const float (&acc)[WGN / 2]) {
  static_assert(WGN == kFc2Cols, "one consumer warpgroup covers the tile's columns");
  const gemm::Fragment f;
  const int c0 = col_block * kFc2Cols + 8 * (threadIdx.x % 4);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t row = (int64_t)block * kBlockRows + cw * 64 + f.row + 8 * j;  // layout row
    const int2 entry = __ldg(reinterpret_cast<const int2*>(p.table) + row);
    __nv_bfloat16* home = nullptr;
    if (entry.x >= 0)
      home = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(__ldg(p.bases + entry.x)) + p.slots_offset) +
             (int64_t)entry.y * p.H;
#pragma unroll
    for (int i0 = 0; i0 < WGN / 8; i0 += 4) {
      uint32_t x[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        x[k] = gemm::bf16x2_bits(acc[4 * (i0 + k) + 2 * j], acc[4 * (i0 + k) + 2 * j + 1]);
      const uint4 v = gemm::quad_transpose(x[0], x[1], x[2], x[3]);  // every lane: shuffles
      if (home != nullptr) *reinterpret_cast<uint4*>(home + c0 + 8 * i0) = v;
    }
  }
}

// Every rank's combine-done flag for this rank: the epoch, stored after a system-scope fence.
// Called once per launch: by the thread that completes the count of delivered fc2 tile halves,
// or, when this rank computes no rows at all, by the first comm CTA.
__device__ __forceinline__ void raise_combine_done(const uint64_t* signal_bases, int P, int rank, uint64_t epoch) {
  fence_acq_rel_sys();
  for (int q = 0; q < P; ++q) st_release_sys_u64(reinterpret_cast<uint64_t*>(signal_bases[q]) + rank, epoch);
}

// Every rank's "early delivered" flag for this rank (word P + rank of its flag array) and the
// first global expert id whose rows this rank may still be computing (word 2P + rank): every
// output row of this rank's experts below it has reached its home rank. Called once per launch:
// by the thread that completes kEarlyDelivered, or, when no block is early, by the CTA with
// ticket 0 (late_from then names the expert of the first block: every row is late).
__device__ __forceinline__ void raise_early_delivered(const uint64_t* signal_bases, int P, int rank, uint64_t epoch,
                                                      int64_t late_from) {
  fence_acq_rel_sys();
  for (int q = 0; q < P; ++q) {
    uint64_t* flags = reinterpret_cast<uint64_t*>(signal_bases[q]);
    *reinterpret_cast<volatile uint64_t*>(flags + 2 * P + rank) = (uint64_t)late_from;
    st_release_sys_u64(flags + P + rank, epoch);  // releases the word above too
  }
}

struct DeliveryArgs {
  int32_t* counters;
  const int32_t* status;
  const uint64_t* signal_bases;
  uint64_t epoch;
  int P, rank;
  int total;             // fc2_arrivals(plan)
  int early_total;       // early_arrivals(plan)
  int early_record;      // early_position(plan) as a stage record's index (x 2 in pair mode)
  int64_t late_from;     // global id of the expert of first_late_block(plan)
};

// What a consumer warpgroup has counted of its fc2 tile halves (padding-only halves included).
struct Fc2Tally {
  int halves = 0;
  bool early_reported = false;  // its halves of early blocks are in kEarlyDelivered
};

// The warpgroup's fc2 tile halves of early blocks, counted as delivered once every thread's
// pushed rows have reached their home ranks (the same fence, barrier and acq_rel count as
// deliver_fc2; the thread that completes the count raises the early flags). Called by the 128
// threads of consumer warpgroup cw before its first tile at or past early_position, or by
// deliver_fc2 when it has none: one system-scope fence per warpgroup and launch more.
__device__ __forceinline__ void add_early(const DeliveryArgs& a, int halves) {
  const int before = atom_add_acq_rel_gpu(&a.counters[kEarlyDelivered], halves);
  if (before + halves == a.early_total && !timeout_recorded(a.status))
    raise_early_delivered(a.signal_bases, a.P, a.rank, a.epoch, a.late_from);
}

__device__ __forceinline__ void report_early(const DeliveryArgs& a, Fc2Tally& tally, int cw) {
  tally.early_reported = true;
  if (tally.halves == 0) return;
  __threadfence_system();
  gemm::named_barrier_sync(1 + cw, 128);
  if (threadIdx.x % 128 == 0) add_early(a, tally.halves);
}

// Called by the 128 threads of consumer warpgroup cw after its last tile. After a timeout the
// flags stay unset: the count falls short of the total whenever a producer stopped early, and
// peers time out too.
__device__ __forceinline__ void deliver_fc2(const DeliveryArgs& a, const Fc2Tally& tally, int cw) {
  __threadfence_system();  // this thread's pushed rows reach their home ranks first
  gemm::named_barrier_sync(1 + cw, 128);
  if (threadIdx.x % 128 == 0 && tally.halves > 0) {
    if (!tally.early_reported) add_early(a, tally.halves);  // every half it ran was early
    const int before = atom_add_acq_rel_gpu(&a.counters[kFc2Delivered], tally.halves);
    if (before + tally.halves == a.total && !timeout_recorded(a.status))
      raise_combine_done(a.signal_bases, a.P, a.rank, a.epoch);
  }
}

}  // namespace mega
}  // namespace mok
