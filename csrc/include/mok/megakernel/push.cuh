// The combine push of the forward megakernel, done by the compute CTAs: an fc2 tile's epilogue
// stores its output rows straight into their home ranks' (token, slot) rows (peer memory for
// the rows of other ranks), and each compute CTA, once its queue is empty, counts its fc2 tile
// halves as delivered after a system-scope fence. Whoever completes the count raises every
// rank's combine-done flag for this rank. Pushing from the epilogue costs no SM, no ring write
// and re-read, and no push after the last tile (docs/megakernel.md).
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
#include "mok/gemm/push.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/sync.cuh"

namespace mok {
namespace mega {

// Where a block's output rows go: the whole layout's table, indexed by layout row.
using gemm::PushTargets;

// Consumer warpgroup cw's 64 x WGN fp32 accumulator of fc2 tile (block, col_block), rounded to
// bf16, into the home rows of its rows (padding rows: nothing): gemm::push_fragment, the
// standalone GEMMs' push epilogue, so the rows are bitwise those of the composed kernels.
// Called by the 128 threads of the warpgroup.
template <int WGN>
__device__ __forceinline__ void push_fragment(const PushTargets& p, int block, int col_block, int cw,
                                              const float (&acc)[WGN / 2]) {
  static_assert(WGN == kFc2Cols, "one consumer warpgroup covers the tile's columns");
  // Every block of the plan lies inside the table (blocks < offsets[L] / kBlockRows): no bound.
  const int64_t row0 = (int64_t)block * kBlockRows + cw * 64;  // layout row
  gemm::push_fragment<WGN, false>(p, row0, col_block * kFc2Cols, 0, acc);
}

// Every rank's combine-done flag for this rank: the epoch, stored after a system-scope fence.
// Called once per launch: by the thread that completes the count of delivered fc2 tile halves,
// or, when this rank computes no rows at all, by the first comm CTA.
__device__ __forceinline__ void raise_combine_done(const uint64_t* signal_bases, int P, int rank, uint64_t epoch) {
  fence_acq_rel_sys();
  for (int q = 0; q < P; ++q) st_release_sys_u64(reinterpret_cast<uint64_t*>(signal_bases[q]) + rank, epoch);
}

struct DeliveryArgs {
  int32_t* counters;
  const int32_t* status;
  const uint64_t* signal_bases;
  uint64_t epoch;
  int P, rank;
  int total;             // fc2_arrivals(plan)
};

// What a consumer warpgroup has counted of its fc2 tile halves (padding-only halves included).
struct Fc2Tally {
  int halves = 0;
};

// Called by the 128 threads of consumer warpgroup cw after its last tile. After a timeout the
// flags stay unset: the count falls short of the total whenever a producer stopped early, and
// peers time out too.
__device__ __forceinline__ void deliver_fc2(const DeliveryArgs& a, const Fc2Tally& tally, int cw) {
  __threadfence_system();  // this thread's pushed rows reach their home ranks first
  gemm::named_barrier_sync(1 + cw, 128);
  if (threadIdx.x % 128 == 0 && tally.halves > 0) {
    const int before = atom_add_acq_rel_gpu(&a.counters[kFc2Delivered], tally.halves);
    if (before + tally.halves == a.total && !timeout_recorded(a.status))
      raise_combine_done(a.signal_bases, a.P, a.rank, a.epoch);
  }
}

}  // namespace mega
}  // namespace mok
