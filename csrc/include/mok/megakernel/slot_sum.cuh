// The end of the forward megakernel: wait for every rank's "combine done" flag, then the
// fixed-order sum over the top-k slots of this rank's tokens,
//   y[t] = sum_{j = 0 .. K-1, 0 <= ids[t, j] < E} slots[t, j]   (fp32, j ascending, bf16 out),
// or NaN everywhere when the status word holds any flag (a failed exchange never yields
// plausible numbers). Tokens are handed out kSumChunk at a time by an atomic counter, so CTAs
// that reach this point early take more of them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mok/gemm/ptx.cuh"
#include "mok/megakernel.h"
#include "mok/megakernel/plan.cuh"
#include "mok/megakernel/sync.cuh"

namespace mok {
namespace mega {

constexpr int kSumThreads = 256;  // warpgroups 1 and 2 of every CTA
constexpr int kSumBarrier = 3;    // named barrier id (1 and 2 belong to the consumer warpgroups)
constexpr int kSumChunk = 4;

struct SumArgs {
  const uint64_t* signal_bases;  // device [P]
  const uint4* slots;            // this rank's slots [T_cap, K, H / 8]
  const int64_t* ids;            // [T, K]
  uint4* y;                      // [T, H / 8]
  int32_t* counters;
  Deadline deadline;
  uint64_t epoch;
  int P, rank, T, K, E, vecs;
};

struct SumShared {
  int32_t next;
  int32_t failed;
};

// Called by the kSumThreads threads 128 .. 383 of a CTA (tid = threadIdx.x - 128).
__device__ __forceinline__ void combine_and_sum(const SumArgs& a, SumShared& sh, int tid) {
  if (tid == 0) {
    // Every rank's last comm CTA stores the epoch into our flag array (st.release.sys) after
    // all of its pushes; acquiring all P flags makes every push into our slots visible.
    const uint64_t* mine = reinterpret_cast<const uint64_t*>(a.signal_bases[a.rank]);
    for (int q = 0; q < a.P; ++q)
      if (!wait_flag_sys(mine + q, a.epoch, a.deadline, MOK_SITE_MK_COMBINE_DONE, q)) break;
    sh.failed = ld_volatile(&a.deadline.status[MOK_STATUS_FLAGS]) != 0;
  }
  gemm::named_barrier_sync(kSumBarrier, kSumThreads);
  const bool failed = sh.failed != 0;
  const float nan = __int_as_float(0x7fc00000);
  for (;;) {
    if (tid == 0) sh.next = atomicAdd(&a.counters[kSumNext], kSumChunk);
    gemm::named_barrier_sync(kSumBarrier, kSumThreads);
    const int t0 = sh.next;
    gemm::named_barrier_sync(kSumBarrier, kSumThreads);  // all have read sh.next
    if (t0 >= a.T) return;
    const int t1 = t0 + kSumChunk < a.T ? t0 + kSumChunk : a.T;
    for (int t = t0; t < t1; ++t) {
      const int64_t* my_ids = a.ids + (int64_t)t * a.K;
      for (int v = tid; v < a.vecs; v += kSumThreads) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < a.K; ++j) {
          const int64_t e = my_ids[j];
          if (e < 0 || e >= a.E) continue;
          const uint4 packed = __ldcg(a.slots + ((int64_t)t * a.K + j) * a.vecs + v);
          const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 f = __bfloat1622float2(p[q]);
            acc[2 * q] += f.x;
            acc[2 * q + 1] += f.y;
          }
        }
        uint4 out;
        __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          r[q] = failed ? __floats2bfloat162_rn(nan, nan) : __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
        a.y[(int64_t)t * a.vecs + v] = out;
      }
    }
  }
}

}  // namespace mega
}  // namespace mok
