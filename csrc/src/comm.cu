// Pull / push / slot-sum / barrier kernels (see mok/comm.h).
//
// Row copies: one warp per row, 16-byte vectors, a grid-stride loop over rows whose bound
// R_pad = offsets[L] is read on the device. Rows are H bf16 = 2H bytes, H % 8 == 0.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "mok/comm.h"
#include "mok/cuda_check.cuh"
#include "mok/memory_order.cuh"
#include "mok/vec_copy.cuh"

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int kUnroll = 4;

__device__ inline void copy_row(const uint4* __restrict__ src, uint4* __restrict__ dst, int vecs,
                                int lane) {
  mok::copy_vecs_strided<kUnroll>(src, dst, vecs, lane, kWarp);
}

__device__ inline void zero_row(uint4* dst, int vecs, int lane) {
  for (int v = lane; v < vecs; v += kWarp) dst[v] = make_uint4(0, 0, 0, 0);
}

__global__ void __launch_bounds__(kThreads) pull_rows_kernel(
    const uint64_t* __restrict__ bases, int64_t src_offset, int per_token, int64_t scalar_offset,
    const int32_t* __restrict__ table, const int32_t* __restrict__ offsets, int L, int K, int H,
    uint4* __restrict__ rows_out, float* __restrict__ scalars_out) {
  const int lane = threadIdx.x % kWarp;
  const int rows = offsets[L];
  const int vecs = H / 8;
  for (int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; i < rows;
       i += gridDim.x * kWarpsPerBlock) {
    const int s = table[2 * (int64_t)i];
    const int route = table[2 * (int64_t)i + 1];
    uint4* dst = rows_out + (int64_t)i * vecs;
    if (s < 0) {
      zero_row(dst, vecs, lane);
      if (scalars_out != nullptr && lane == 0) scalars_out[i] = 0.f;
      continue;
    }
    const int64_t src_row = per_token ? route / K : route;
    const char* base = reinterpret_cast<const char*>(bases[s]);
    copy_row(reinterpret_cast<const uint4*>(base + src_offset) + src_row * vecs, dst, vecs, lane);
    if (scalars_out != nullptr && lane == 0)
      scalars_out[i] = reinterpret_cast<const float*>(base + scalar_offset)[route];
  }
}

__global__ void __launch_bounds__(kThreads) push_rows_kernel(
    const uint64_t* __restrict__ bases, int64_t dst_offset, int64_t scalar_offset,
    const int32_t* __restrict__ table, const int32_t* __restrict__ offsets, int L, int H,
    const uint4* __restrict__ rows, const float* __restrict__ scalars) {
  const int lane = threadIdx.x % kWarp;
  const int n = offsets[L];
  const int vecs = H / 8;
  for (int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; i < n;
       i += gridDim.x * kWarpsPerBlock) {
    const int s = table[2 * (int64_t)i];
    if (s < 0) continue;
    const int route = table[2 * (int64_t)i + 1];
    char* base = reinterpret_cast<char*>(bases[s]);
    copy_row(rows + (int64_t)i * vecs, reinterpret_cast<uint4*>(base + dst_offset) + (int64_t)route * vecs,
             vecs, lane);
    if (scalars != nullptr && lane == 0)
      reinterpret_cast<float*>(base + scalar_offset)[route] = scalars[i];
  }
}

// A grid-stride loop over tokens, one block per token at a time; each thread owns 8
// consecutive channels (one 16-byte vector) per step and adds the K slots in ascending j:
// the order never depends on timing. The status word (pinned host memory) is read once per
// block.
__global__ void __launch_bounds__(kThreads) sum_slots_kernel(
    const uint4* __restrict__ slots, const int64_t* __restrict__ ids, int T, int K, int H, int E,
    uint4* __restrict__ out, const float* __restrict__ scalar_slots, float* __restrict__ scalars_out,
    const int32_t* __restrict__ status) {
  __shared__ int failed;
  if (threadIdx.x == 0)
    failed = status != nullptr && mok::ld_volatile(status) != 0;
  __syncthreads();
  const int vecs = H / 8;
  const float nan = __int_as_float(0x7fc00000);
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const int64_t* my_ids = ids + (int64_t)t * K;
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < K; ++j) {
        const int64_t e = my_ids[j];
        if (e < 0 || e >= E) continue;
        uint4 packed = slots[((int64_t)t * K + j) * vecs + v];
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          float2 f = __bfloat1622float2(p[q]);
          acc[2 * q] += f.x;
          acc[2 * q + 1] += f.y;
        }
      }
      uint4 result;
      __nv_bfloat162* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
      for (int q = 0; q < 4; ++q)
        r[q] = failed ? __floats2bfloat162_rn(nan, nan)
                      : __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
      out[(int64_t)t * vecs + v] = result;
    }
    if (scalars_out != nullptr) {
      for (int j = threadIdx.x; j < K; j += blockDim.x) {
        const int64_t e = my_ids[j];
        float value = (e < 0 || e >= E) ? 0.f : scalar_slots[(int64_t)t * K + j];
        scalars_out[(int64_t)t * K + j] = failed ? nan : value;
      }
    }
  }
}

__device__ inline bool stopped(const int32_t* status) {
  return status != nullptr && (mok::ld_volatile(&status[MOK_STATUS_FLAGS]) & MOK_STATUS_TIMEOUT) != 0;
}

// This rank's failure word in every peer's signal array (after its own flags [P]).
__device__ inline void announce_stop(const uint64_t* signal_bases, int rank, int P, uint64_t word) {
  mok::fence_acq_rel_sys();
  for (int q = 0; q < P; ++q)
    if (q != rank) mok::st_release_sys_u64(reinterpret_cast<uint64_t*>(signal_bases[q]) + P + rank, word);
}

// Record a stop in the status word (the first one wins the detail words). Returns whether this
// call recorded the first. PEER_FAILED is set only with the first (the detail words are its).
__device__ inline bool record_stop(int32_t* status, int flags, int peer, int site, int rank, int code) {
  if (status == nullptr) return false;
  const int old = atomicOr(&status[MOK_STATUS_FLAGS], MOK_STATUS_TIMEOUT);
  const bool first = (old & MOK_STATUS_TIMEOUT) == 0;
  if (first) {
    atomicExch(&status[MOK_STATUS_PEER], peer);
    atomicExch(&status[MOK_STATUS_WHERE], site);
    atomicExch(&status[MOK_STATUS_RANK], rank);
    if (flags & MOK_STATUS_PEER_FAILED) {
      atomicExch(&status[MOK_STATUS_FAILURE], code);
      atomicOr(&status[MOK_STATUS_FLAGS], MOK_STATUS_PEER_FAILED);
    }
  }
  __threadfence_system();
  return first;
}

__global__ void barrier_kernel(const uint64_t* __restrict__ signal_bases, int rank, int P,
                               uint64_t* counter, int64_t timeout_ns, int site,
                               int32_t* status) {
  __shared__ uint64_t epoch;
  __shared__ int skip;
  if (threadIdx.x == 0) {
    epoch = ++(*counter);
    skip = stopped(status);
  }
  __syncthreads();
  const int p = threadIdx.x;
  if (skip || p >= P || p == rank) return;
  // Every write this rank made before the barrier (earlier kernels in the stream, peer
  // stores included) happens-before this release; the fence makes that cumulative.
  mok::fence_acq_rel_sys();
  mok::st_release_sys_u64(reinterpret_cast<uint64_t*>(signal_bases[p]) + rank, epoch);
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(signal_bases[rank]) + p;
  const uint64_t* failure = reinterpret_cast<const uint64_t*>(signal_bases[rank]) + P + p;
  const uint64_t start = mok::globaltimer_ns();
  for (uint32_t spin = 1; mok::ld_acquire_sys_u64(mine) < epoch; ++spin) {
    const uint64_t word = mok::ld_acquire_sys_u64(failure);
    if (word != 0) {  // peer p stopped: every rank stops this call
      record_stop(status, MOK_STATUS_PEER_FAILED, (int)(word & 0xffffffffu), site, rank,
                  (int)((word >> 32) & 0x7fffffffu));
      return;
    }
    if ((spin & 15u) == 0 && stopped(status)) return;  // another wait of this rank stopped
    if ((int64_t)(mok::globaltimer_ns() - start) > timeout_ns) {
      if (record_stop(status, 0, p, site, rank, 0))
        announce_stop(signal_bases, rank, P, MOK_FAILURE_WORD(MOK_FAILURE_TIMEOUT, rank));
      return;
    }
    __nanosleep(100);
  }
  // Arrived, but a peer that stored its epoch and then gave up waiting (for this rank or
  // another) has set its failure word: this call stops here too.
  const uint64_t word = mok::ld_acquire_sys_u64(failure);
  if (word != 0)
    record_stop(status, MOK_STATUS_PEER_FAILED, (int)(word & 0xffffffffu), site, rank,
                (int)((word >> 32) & 0x7fffffffu));
}

__global__ void signal_failure_kernel(const uint64_t* __restrict__ signal_bases, int rank, int P, int code,
                                      int failed_rank, int32_t* status) {
  if (threadIdx.x != 0) return;
  record_stop(status, MOK_STATUS_PEER_FAILED, failed_rank, 0, rank, code);
  announce_stop(signal_bases, rank, P, MOK_FAILURE_WORD(code, failed_rank));
}

int launch_blocks(int num_blocks) {
  if (num_blocks > 0) return num_blocks;
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return 4 * sms;
}

}  // namespace

MOK_API int mok_pull_rows(const uint64_t* bases, int64_t src_offset, int per_token,
                          int64_t scalar_offset, const int32_t* table, const int32_t* offsets,
                          int L, int K, int H, void* rows_out, float* scalars_out,
                          int num_blocks, cudaStream_t stream) {
  MOK_REQUIRE(bases && table && offsets && rows_out && L >= 1 && K >= 1 && H > 0 && H % 8 == 0);
  MOK_REQUIRE(src_offset % 16 == 0 && reinterpret_cast<uintptr_t>(rows_out) % 16 == 0);
  pull_rows_kernel<<<launch_blocks(num_blocks), kThreads, 0, stream>>>(
      bases, src_offset, per_token, scalar_offset, table, offsets, L, K, H,
      static_cast<uint4*>(rows_out), scalars_out);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

MOK_API int mok_push_rows(const uint64_t* bases, int64_t dst_offset, int64_t scalar_offset,
                          const int32_t* table, const int32_t* offsets, int L, int K, int H,
                          const void* rows, const float* scalars, int num_blocks,
                          cudaStream_t stream) {
  MOK_REQUIRE(bases && table && offsets && rows && L >= 1 && K >= 1 && H > 0 && H % 8 == 0);
  MOK_REQUIRE(dst_offset % 16 == 0 && reinterpret_cast<uintptr_t>(rows) % 16 == 0);
  push_rows_kernel<<<launch_blocks(num_blocks), kThreads, 0, stream>>>(
      bases, dst_offset, scalar_offset, table, offsets, L, H, static_cast<const uint4*>(rows),
      scalars);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

MOK_API int mok_sum_slots(const void* slots, const int64_t* ids, int T, int K, int H, int E,
                          void* out, const float* scalar_slots, float* scalars_out,
                          const int32_t* status, cudaStream_t stream) {
  MOK_REQUIRE(T >= 0 && K >= 1 && H > 0 && H % 8 == 0 && E >= 1);
  if (T == 0) return MOK_OK;  // empty tensors may have null data pointers
  MOK_REQUIRE(slots && ids && out);
  MOK_REQUIRE((scalars_out == nullptr) == (scalar_slots == nullptr));
  const int blocks = T < launch_blocks(0) ? T : launch_blocks(0);
  sum_slots_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(slots), ids, T, K, H, E,
                                               static_cast<uint4*>(out), scalar_slots,
                                               scalars_out, status);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

MOK_API int mok_signal_failure(const uint64_t* signal_bases, int rank, int P, int code,
                               int failed_rank, int32_t* status, cudaStream_t stream) {
  MOK_REQUIRE(signal_bases && status && P >= 1 && P <= 1024 && rank >= 0 && rank < P);
  MOK_REQUIRE(code >= 1 && failed_rank >= 0 && failed_rank < P);
  signal_failure_kernel<<<1, 32, 0, stream>>>(signal_bases, rank, P, code, failed_rank, status);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}

MOK_API int mok_barrier(const uint64_t* signal_bases, int rank, int P, uint64_t* counter,
                        int64_t timeout_ns, int site, int32_t* status, cudaStream_t stream) {
  MOK_REQUIRE(signal_bases && counter && P >= 1 && P <= 1024 && rank >= 0 && rank < P);
  MOK_REQUIRE(timeout_ns > 0);
  const int threads = ((P + kWarp - 1) / kWarp) * kWarp;
  barrier_kernel<<<1, threads, 0, stream>>>(signal_bases, rank, P, counter, timeout_ns, site,
                                            status);
  MOK_RETURN_IF_LAUNCH_FAILED();
  return MOK_OK;
}
