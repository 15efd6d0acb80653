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
#include "mok/megakernel/trace.cuh"

namespace mok {
namespace mega {

constexpr int kSumThreads = 384;  // every thread of every CTA
constexpr int kSumBarrier = 3;    // named barrier id (1 and 2 belong to the consumer warpgroups)
constexpr int kSumChunk = 8;    // tokens per grab
constexpr int kSumUnroll = 8;   // slot loads in flight per (token, vector)
constexpr int kSumMaxK = 1024;  // the launch's bound on top-k (check_args)
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
  int32_t next;
  int32_t failed;
  // The chunk's slots that hold a row: bit j of valid[i][j / 32] for token t0 + i, slot j (an
  // id in [0, E)). Read once per chunk, so a slot load does not wait for its id's load.
  uint32_t valid[kSumChunk][kSumMaskWords];
};

// Called by all kSumThreads threads of a CTA (tid = threadIdx.x).
__device__ __forceinline__ void combine_and_sum(const SumArgs& a, SumShared& sh, int tid) {
  if (tid == 0) {
    // Every rank stores the epoch into our flag array (st.release.sys) once all of its pushes
    // were delivered; acquiring all P flags makes every push into our slots visible.
    const uint64_t* mine = reinterpret_cast<const uint64_t*>(a.signal_bases[a.rank]);
    for (int q = 0; q < a.P; ++q)
      if (!wait_flag_sys(mine + q, a.epoch, a.deadline, MOK_SITE_MK_COMBINE_DONE, q)) break;
    sh.failed = ld_volatile(&a.deadline.status[MOK_STATUS_FLAGS]) != 0;
    a.trace.stamp(a.trace_record, kTrStart);
  }
  gemm::named_barrier_sync(kSumBarrier, kSumThreads);
  const bool failed = sh.failed != 0;
  const float nan = __int_as_float(0x7fc00000);
  for (;;) {
    if (tid == 0) sh.next = atomicAdd(&a.counters[kSumNext], kSumChunk);
    gemm::named_barrier_sync(kSumBarrier, kSumThreads);
    const int t0 = sh.next;
    if (t0 >= a.T) return;  // every thread read the same t0
    const int t1 = t0 + kSumChunk < a.T ? t0 + kSumChunk : a.T;
    const int words = (a.K + 31) / 32;
    for (int w = tid; w < (t1 - t0) * words; w += kSumThreads) {
      const int i = w / words, j0 = (w % words) * 32;
      const int j1 = j0 + 32 < a.K ? j0 + 32 : a.K;
      const int64_t* ids = a.ids + (int64_t)(t0 + i) * a.K;
      uint32_t bits = 0;
      for (int j = j0; j < j1; ++j) {
        const int64_t e = ids[j];
        bits |= (e >= 0 && e < a.E ? 1u : 0u) << (j - j0);
      }
      sh.valid[i][w % words] = bits;
    }
    gemm::named_barrier_sync(kSumBarrier, kSumThreads);  // all have read sh.next; valid is set
    // The chunk's (token, vector) pairs, two per thread at a time, each with up to
    // kSumUnroll slot loads in flight: the sum reads K rows per token and must stream at
    // HBM speed (latency-bound otherwise).
    const int pairs = (t1 - t0) * a.vecs;
    for (int q0 = tid; q0 < pairs; q0 += 2 * kSumThreads) {
      float acc[2][8];
      int64_t tok[2];
      int vec[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int q = q0 + h * kSumThreads;
        tok[h] = t0 + (q < pairs ? q / a.vecs : 0);
        vec[h] = q < pairs ? q % a.vecs : 0;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[h][c] = 0.f;
      }
      for (int j0 = 0; j0 < a.K; j0 += kSumUnroll) {
        uint4 r[2][kSumUnroll];
        bool ok[2][kSumUnroll];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int u = 0; u < kSumUnroll; ++u) {
            const int j = j0 + u;
            ok[h][u] = j < a.K && q0 + h * kSumThreads < pairs &&
                       ((sh.valid[tok[h] - t0][j >> 5] >> (j & 31)) & 1u) != 0;
            if (ok[h][u]) r[h][u] = __ldcg(a.slots + (tok[h] * a.K + j) * a.vecs + vec[h]);
          }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int u = 0; u < kSumUnroll; ++u) {  // j ascending: the order of mok_sum_slots
            if (!ok[h][u]) continue;
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
        if (q0 + h * kSumThreads >= pairs) continue;
        uint4 out;
        __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int c = 0; c < 4; ++c)
          o[c] = failed ? __floats2bfloat162_rn(nan, nan) : __floats2bfloat162_rn(acc[h][2 * c], acc[h][2 * c + 1]);
        a.y[tok[h] * a.vecs + vec[h]] = out;
      }
    }
  }
}

}  // namespace mega
}  // namespace mok
