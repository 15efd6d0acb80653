// What a launch of the forward megakernel passes to its CTAs (KernelParams, a __grid_constant__
// parameter, filled by the host launch from MokMegakernelArgs) and what each CTA keeps in shared
// memory next to the GEMM stage ring (CtaShared).
#pragma once

#include <cstdint>

#include "mok/gemm/config.cuh"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/push.cuh"
#include "mok/megakernel/rows.cuh"
#include "mok/megakernel/slot_sum.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/tiles.cuh"
#include "mok/megakernel/trace.cuh"

namespace mok {
namespace mega {

struct KernelParams {
  TileOperands ops;
  RowSpaces rows;
  const uint64_t* signal_bases;
  const int64_t* ids;
  uint4* y;
  const int32_t* offsets;
  const int32_t* counts;
  int32_t* counters;
  int32_t* status;
  int64_t timeout_ns;
  Trace trace;
  int P, rank, L, T, E;
  int comm_ctas;
  int mb_blocks, slots, n1, n2;
  int pairs;         // 1: launched in clusters of two that run pair tiles (plan.cuh)
  int group_blocks;  // Plan::group_blocks
};

// Shared memory after the stage ring (whose plan is Fc1Cfg::kSmemBytes, alignment included).
struct CtaShared {
  uint64_t copy_bars[kCopyWarps * kCopyStages];  // the first pulls' bulk-copy mbarriers
  StageRecord records[gemm::kMaxStages];
  Item comm_item;    // the first pulls (Crew of the whole CTA)
  Item helper_item;  // pull helpers (Crew)
  SumShared sum;
  uint64_t epoch;
  uint64_t mail;        // pair mode: the producers' hand-over barrier (tiles.cuh, PairLink)
  int32_t ticket;
  int32_t n_blocks;
  int32_t pair_ticket;  // pair mode: the compute-queue position handed to the follower
  DeliveryArgs delivery;  // in shared memory: kept out of the registers of the GEMM loop
};
constexpr int kSmemBytes = Fc1Cfg::kSmemBytes + (int)sizeof(CtaShared);
static_assert(Fc1Cfg::kSmemBytes % alignof(CtaShared) == 0, "CtaShared alignment");
static_assert(kSmemBytes <= gemm::kSmemLimit, "shared memory budget");
static_assert(gemm::kThreads / 32 == kCopyWarps, "every warp of a CTA has a copy pipe");
static_assert(kCopyWarps * kCopyWarpBytes <= Fc1Cfg::kStages * Fc1Cfg::kStageBytes,
              "the first pulls' copy chunks fit the GEMM stage area");

__device__ __forceinline__ Deadline deadline_of(const KernelParams& p) {
  return Deadline{p.status, p.timeout_ns, p.rank};
}

}  // namespace mega
}  // namespace mok
