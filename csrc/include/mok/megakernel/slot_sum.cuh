// The end of the forward megakernel: the fixed-order sum over the top-k slots of this rank's
// tokens,
//   y[t] = sum_{j = 0 .. K-1, 0 <= ids[t, j] < E} slots[t, j]   (fp32, j ascending, bf16 out),
// or NaN everywhere when the status word holds any flag (a failed exchange never yields
// plausible numbers). It starts once every rank's combine-done flag is up (push.cuh: every
// output row of that rank's experts is home). Work comes in units of a quarter of a token's
// row, taken by warps from an atomic counter, with no CTA-wide barrier, so warps that get here
// first take more of them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm/ptx.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/sync.cuh"
#include "mok/megakernel/trace.cuh"

namespace mok {
namespace mega {

constexpr int kSumThreads = 384;  // every thread of every CTA
constexpr int kSumWarps = kSumThreads / 32;
constexpr int kSumParts = 4;      // units per token: a warp sums a quarter of the token's row
constexpr int kSumUnroll = 8;     // slot loads in flight per (token, vector)
constexpr int kSumMaxK = 1024;    // the launch's bound on top-k (check_args)
constexpr int kSumMaskWords = kSumMaxK / 32;

struct SumArgs {
  const uint64_t* signal_bases;  // device [P]
  const uint4* slots;            // this rank's slots [T_cap, K, H / 8]
  const int64_t* ids;            // [T, K]
  uint4* y;                      // [T, H / 8]
  int32_t* counters;
  Deadline deadline;
  uint64_t epoch;
  int P, rank, T, K, E, vecs;
  Trace trace;
  int64_t trace_record;  // this CTA's record
};

struct SumShared {
  // Per warp, the slots of its current token that hold a row: bit j % 32 of valid[warp][j / 32]
  // (an id in [0, E)).
  uint32_t valid[kSumWarps][kSumMaskWords];
};

// Vectors [v0, v1) of token t's output row, by one warp: lane l takes vectors v0 + l, v0 + l + 32,
// ... two at a time, with up to kSumUnroll slot loads in flight for each. `valid` holds the
// token's used slots (bit j % 32 of valid[j / 32]).
__device__ __forceinline__ void sum_unit(const SumArgs& a, const uint32_t* valid, int t, int v0, int v1, bool failed,
                                         int lane) {
  const uint4* tok_slots = a.slots + (int64_t)t * a.K * a.vecs;
  const float nan = __int_as_float(0x7fc00000);
  for (int v = v0 + lane; v < v1; v += 64) {
    const bool second = v + 32 < v1;
    float acc[2][8];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[h][c] = 0.f;
    for (int j0 = 0; j0 < a.K; j0 += kSumUnroll) {
      static_assert(32 % kSumUnroll == 0, "a group of slots lies in one mask word");
      const uint32_t used = valid[j0 >> 5] >> (j0 & 31);  // bit u: slot j0 + u (past K: 0)
      uint4 r[2][kSumUnroll];
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u)
        if ((used >> u) & 1u) {
          r[0][u] = __ldcg(tok_slots + (int64_t)(j0 + u) * a.vecs + v);
          if (second) r[1][u] = __ldcg(tok_slots + (int64_t)(j0 + u) * a.vecs + v + 32);
        }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) {  // j ascending: the order of mok_sum_slots
          if (((used >> u) & 1u) == 0 || (h == 1 && !second)) continue;
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&r[h][u]);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const float2 f = __bfloat1622float2(p[c]);
            acc[h][2 * c] += f.x;
            acc[h][2 * c + 1] += f.y;
          }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h == 1 && !second) continue;
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int c = 0; c < 4; ++c)
        o[c] = failed ? __floats2bfloat162_rn(nan, nan) : __floats2bfloat162_rn(acc[h][2 * c], acc[h][2 * c + 1]);
      a.y[(int64_t)t * a.vecs + v + 32 * h] = out;
    }
  }
}

// Slot j's id of unit's token in lane j (-1 past K or past the last unit).
__device__ __forceinline__ int64_t first_slot_id(const SumArgs& a, int unit, int lane) {
  return unit < a.T * kSumParts && lane < a.K ? a.ids[(int64_t)(unit / kSumParts) * a.K + lane] : -1;
}

// Unit `unit` of the sum by one warp: its token's slot mask (ids of slots 0-31 in `id`, the
// others read now), then sum_unit.
__device__ __forceinline__ void sum_one_unit(const SumArgs& a, uint32_t* valid, int unit, int64_t id, bool failed,
                                             int lane) {
  const int t = unit / kSumParts, part = unit % kSumParts;
  __syncwarp();  // every lane has read the previous unit's mask
  const uint32_t bits = __ballot_sync(~0u, id >= 0 && id < a.E);
  if (lane == 0) valid[0] = bits;
  for (int w = 1; w < (a.K + 31) / 32; ++w) {  // top-k above 32: the other ids now
    const int j = w * 32 + lane;
    const int64_t e = j < a.K ? a.ids[(int64_t)t * a.K + j] : -1;
    const uint32_t more = __ballot_sync(~0u, e >= 0 && e < a.E);
    if (lane == 0) valid[w] = more;
  }
  __syncwarp();
  sum_unit(a, valid, t, part * a.vecs / kSumParts, (part + 1) * a.vecs / kSumParts, failed, lane);
}

// Called by all kSumThreads threads of a CTA (tid = threadIdx.x). Every warp goes on alone
// (no CTA barrier): it waits for every rank's combine-done flag, then takes units from kSumNext.
__device__ __forceinline__ void combine_and_sum(const SumArgs& a, SumShared& sh, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  uint32_t* valid = sh.valid[warp];
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(a.signal_bases[a.rank]);
  int failed = 0;
  if (lane == 0) {
    // Every rank stores the epoch into our flag array (st.release.sys) once all of its pushes
    // were delivered; acquiring all P flags makes every push into our slots visible.
    for (int q = 0; q < a.P; ++q)
      if (!wait_flag_sys(mine + q, a.epoch, a.deadline, MOK_SITE_MK_COMBINE_DONE, q)) break;
    failed = ld_volatile(&a.deadline.status[MOK_STATUS_FLAGS]) != 0;  // a failed launch writes NaN
    if (tid == 0) a.trace.stamp(a.trace_record, kTrStart);
  }
  failed = __shfl_sync(~0u, failed, 0);
  __syncwarp();  // extends lane 0's acquires to the warp
  const int units = a.T * kSumParts;
  // A warp works on unit `cur` while the atomic that takes the unit after `next` and the ids of
  // `next`'s token are in flight, so neither round trip stalls its slot loads.
  int cur = __shfl_sync(~0u, lane == 0 ? atomicAdd(&a.counters[kSumNext], 1) : 0, 0);
  int next = __shfl_sync(~0u, lane == 0 ? atomicAdd(&a.counters[kSumNext], 1) : 0, 0);
  int64_t cur_id = first_slot_id(a, cur, lane);
  while (cur < units) {
    int after = 0;
    if (lane == 0) after = atomicAdd(&a.counters[kSumNext], 1);
    const int64_t next_id = first_slot_id(a, next, lane);
    sum_one_unit(a, valid, cur, cur_id, failed != 0, lane);
    cur = next;
    cur_id = next_id;
    next = __shfl_sync(~0u, after, 0);
  }
}

}  // namespace mega
}  // namespace mok
