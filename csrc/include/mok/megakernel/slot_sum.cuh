// The end of the forward megakernel: the fixed-order sum over the top-k slots of this rank's
// tokens,
//   y[t] = sum_{j = 0 .. K-1, 0 <= ids[t, j] < E} slots[t, j]   (fp32, j ascending, bf16 out),
// or NaN everywhere when the status word holds any flag (a failed exchange never yields
// plausible numbers). Work comes in units of a quarter of a token's row, taken by warps from
// atomic counters, with no CTA-wide barrier, so warps that get here first take more of them.
// Two phases (the early one only when SumArgs::early asks for it; off by default, see
// early_sum_mode):
//   early: once every rank has raised its "early delivered" flag (the output rows of all of
//     its minibatches but the last kLateMinibatches are home, push.cuh), warps with nothing
//     else left sum the tokens none of whose slots come from those late minibatches of any rank
//     (a slot's expert below its owner's late_from word), while the last tiles still run;
//   final: after every rank's combine-done flag, everything else.
// Both phases run the same code on the same slots, so a unit summed by either (or, in a race
// the rules below allow, by both) gets the same bits.
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
constexpr int kEarlyMaxTopk = 32;   // the early sum reads a token's ids as one warp's lanes
constexpr int kEarlyMaxRanks = 32;  // ... and the ranks' late_from words likewise
// SumArgs::early. kEarlySumAll (for the tests): the early sum goes on past the combine-done
// flags until its queue's end, so every unit whose token has no late slot is its own.
enum EarlySum : int { kNoEarlySum = 0, kEarlySum = 1, kEarlySumAll = 2 };

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
  int early;             // EarlySum (kNoEarlySum unless K <= kEarlyMaxTopk, P <= kEarlyMaxRanks)
  int L;                 // experts per rank: the owner of expert id e is e / L
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

// Whether one of a token's slots may hold a row that is not home before the combine-done
// flags (lane j holds slot j's id, -1 past K; lane q < P holds rank q's late_from): its expert
// is at or past its owner's late_from.
__device__ __forceinline__ bool token_has_late_slot(const SumArgs& a, int64_t id, int64_t late_from_lane) {
  const bool used = id >= 0 && id < a.E;
  const int64_t from = __shfl_sync(~0u, late_from_lane, used ? (int)(id / a.L) : 0);
  return __any_sync(~0u, used && id >= from);
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

// Lane 0: whether every rank's flag at words [base, base + P) of our flag array holds this
// launch's epoch (relaxed loads: the caller acquires what it then reads).
__device__ __forceinline__ bool flags_up(const SumArgs& a, int base) {
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(a.signal_bases[a.rank]) + base;
  for (int q = 0; q < a.P; ++q)
    if (*reinterpret_cast<const volatile uint64_t*>(mine + q) < a.epoch) return false;
  return true;
}

// The early sum, by one warp with nothing else to do before the combine-done flags. Once every
// rank's "early delivered" flag is up (push.cuh: the output rows of its experts below its
// late_from word are home), the warp takes units from kEarlyNext and sums those whose token has
// no late slot, the same way and into the same bytes as the final sum, which skips them. It
// stops at the combine-done flags (with kEarlySumAll only at the queue's end), at the queue's
// end, or when the launch has failed or run out of time (the final sum's wait then records the
// timeout); a unit it took, it always finishes first. Returns nothing: whatever it did not sum,
// the final sum does.
__device__ __noinline__ void early_sum(const SumArgs& a, uint32_t* valid, int lane) {
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(a.signal_bases[a.rank]);
  const int units = a.T * kSumParts;
  const uint64_t start = globaltimer_ns();
  auto stop_now = [&]() {
    int stop = 0;
    if (lane == 0)
      stop = (a.early != kEarlySumAll && flags_up(a, 0)) || ld_volatile(&a.deadline.status[MOK_STATUS_FLAGS]) != 0 ||
             (int64_t)(globaltimer_ns() - start) > a.deadline.timeout_ns;
    return __shfl_sync(~0u, stop, 0) != 0;
  };
  for (;;) {  // until every rank's early flag is up
    if (stop_now()) return;
    int up = 0;
    if (lane == 0) {
      up = flags_up(a, a.P);
      if (up) fence_acq_rel_sys();  // acquires the flags (and the late_from words they release)
    }
    if (__shfl_sync(~0u, up, 0)) break;
    __nanosleep(500);
  }
  __syncwarp();  // extends lane 0's acquire to the warp
  const int64_t late_from = lane < a.P ? (int64_t)*reinterpret_cast<const volatile uint64_t*>(mine + 2 * a.P + lane) : 0;
  // The next unit and its ids are taken while the current one streams.
  int cur = __shfl_sync(~0u, lane == 0 ? atomicAdd(&a.counters[kEarlyNext], 1) : 0, 0);
  int64_t cur_id = first_slot_id(a, cur, lane);
  while (cur < units) {
    const bool stop = stop_now();
    int next = units;
    if (!stop) next = __shfl_sync(~0u, lane == 0 ? atomicAdd(&a.counters[kEarlyNext], 1) : 0, 0);
    const int64_t next_id = first_slot_id(a, next, lane);
    if (!token_has_late_slot(a, cur_id, late_from)) sum_one_unit(a, valid, cur, cur_id, false, lane);
    if (stop) return;
    cur = next;
    cur_id = next_id;
  }
}

// Called by all kSumThreads threads of a CTA (tid = threadIdx.x). Every warp goes on alone
// (no CTA barrier): it runs the early sum, then waits for every rank's combine-done flag and
// takes units from kSumNext, skipping those the early sum took and may sum (every unit below
// kEarlyNext's value when the warp reads it, whose token has no late slot).
__device__ __forceinline__ void combine_and_sum(const SumArgs& a, SumShared& sh, int tid) {
  const int warp = tid / 32, lane = tid % 32;
  uint32_t* valid = sh.valid[warp];
  if (a.early) early_sum(a, valid, lane);
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(a.signal_bases[a.rank]);
  int failed = 0, taken = 0;
  if (lane == 0) {
    // Every rank stores the epoch into our flag array (st.release.sys) once all of its pushes
    // were delivered; acquiring all P flags makes every push into our slots visible.
    for (int q = 0; q < a.P; ++q)
      if (!wait_flag_sys(mine + q, a.epoch, a.deadline, MOK_SITE_MK_COMBINE_DONE, q)) break;
    if (a.early) taken = ld_volatile(&a.counters[kEarlyNext]);
    // An early warp saw every early flag up: they are (or soon will be) here too, with the
    // late_from words it went by.
    for (int q = 0; q < a.P && taken > 0; ++q)
      if (!wait_flag_sys(mine + a.P + q, a.epoch, a.deadline, MOK_SITE_MK_COMBINE_DONE, q)) taken = 0;
    failed = ld_volatile(&a.deadline.status[MOK_STATUS_FLAGS]) != 0;
    if (failed) taken = 0;  // a failed launch writes NaN to every unit
    if (tid == 0) a.trace.stamp(a.trace_record, kTrStart);
  }
  failed = __shfl_sync(~0u, failed, 0);
  const int early_taken = __shfl_sync(~0u, taken, 0);
  __syncwarp();  // extends lane 0's acquires to the warp
  const int64_t late_from =
      early_taken > 0 && lane < a.P ? (int64_t)*reinterpret_cast<const volatile uint64_t*>(mine + 2 * a.P + lane) : 0;
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
    if (cur >= early_taken || token_has_late_slot(a, cur_id, late_from))
      sum_one_unit(a, valid, cur, cur_id, failed != 0, lane);
    cur = next;
    cur_id = next_id;
    next = __shfl_sync(~0u, after, 0);
  }
}

}  // namespace mega
}  // namespace mok
