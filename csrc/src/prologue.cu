// The forward dispatch prologue (see mok/prologue.h).
#include <cuda_runtime.h>

#include "mok/comm.h"
#include "mok/cuda_check.cuh"
#include "mok/prologue.h"
#include "mok/schedule.h"
#include "mok/vec_copy.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kVecsInFlight = 4;    // 16-byte loads per thread before its stores
constexpr int kMaxCopyBlocks = 1024;

// x's rows as 16-byte vectors, then the ids and router weights of the T x K routes, and T: one
// launch instead of a cudaMemcpyAsync and a kernel (a copy call costs the host ~3x a launch on
// the GPU machines, docs/perf-notes.md).
__global__ void publish_kernel(const uint4* __restrict__ x, uint4* __restrict__ x_out, int64_t x_vecs,
                               const int64_t* __restrict__ ids, const float* __restrict__ weights, int64_t routes,
                               int64_t* __restrict__ ids_out, float* __restrict__ weights_out, int32_t* ntok,
                               int32_t T) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  mok::copy_vecs_strided<kVecsInFlight>(x, x_out, x_vecs, first, stride);
  for (int64_t r = first; r < routes; r += stride) {
    ids_out[r] = ids[r];
    weights_out[r] = weights[r];
  }
  if (first == 0) *ntok = T;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

MOK_API int64_t mok_prologue_args_bytes(void) { return (int64_t)sizeof(MokPrologueArgs); }

MOK_API int mok_dispatch_prologue(const MokPrologueArgs* a, cudaStream_t stream) {
  MOK_REQUIRE(a != nullptr && a->region != nullptr);
  MOK_REQUIRE(a->T >= 0 && a->T <= a->max_tokens && a->H >= 1 && a->K >= 1);
  MOK_REQUIRE(a->T == 0 || (a->x && a->topk_ids && a->topk_weights));
  MOK_REQUIRE(a->rows_offset >= 0 && a->ids_offset >= 0 && a->scalars_offset >= 0 && a->ntok_offset >= 0);
  MOK_REQUIRE(a->ntok_offset % 4 == 0 && a->ids_offset % 8 == 0 && a->scalars_offset % 4 == 0);
  MOK_REQUIRE(a->P >= 1 && a->P <= 1024 && a->rank >= 0 && a->rank < a->P);
  MOK_REQUIRE(a->P == 1 || (a->signal_bases && a->counter && a->timeout_ns > 0));
  // The schedule's own checks come before anything is queued too (the table's size bound).
  MOK_REQUIRE(a->ids_ptrs && a->ntok_ptrs && a->table && a->counts && a->offsets && a->scratch);
  MOK_REQUIRE(a->max_tokens <= INT32_MAX && a->L >= 1 && a->tile_rows >= 1);
  MOK_REQUIRE(mok_schedule_table_rows((int)a->P, (int)a->max_tokens, (int)a->K, (int)a->L, (int)a->tile_rows) <
              (int64_t)INT32_MAX);
  MOK_REQUIRE(a->L * (int64_t)sizeof(int32_t) <= 48 * 1024);

  char* region = static_cast<char*>(a->region);
  const int64_t routes = a->T * a->K;
  const int64_t x_bytes = a->T * a->H * 2;
  void* x_dst = region + a->rows_offset;
  // The kernel copies x when both ends hold whole 16-byte vectors; else the copy engine does.
  const bool x_by_kernel = x_bytes % 16 == 0 && aligned16(a->x) && aligned16(x_dst);
  if (a->T > 0 && !x_by_kernel)
    MOK_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(x_dst, a->x, (size_t)x_bytes, cudaMemcpyDeviceToDevice, stream));
  const int64_t x_vecs = x_by_kernel ? x_bytes / 16 : 0;
  // A thread per kVecsInFlight vectors of x or per route, whichever needs more, up to the cap.
  const int64_t x_threads = mok::ceil_div(x_vecs, kVecsInFlight);
  int64_t blocks = mok::ceil_div(x_threads > routes ? x_threads : routes, kThreads);
  blocks = blocks < 1 ? 1 : (blocks > kMaxCopyBlocks ? kMaxCopyBlocks : blocks);
  publish_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(
      static_cast<const uint4*>(a->x), static_cast<uint4*>(x_dst), x_vecs, a->topk_ids, a->topk_weights, routes,
      reinterpret_cast<int64_t*>(region + a->ids_offset), reinterpret_cast<float*>(region + a->scalars_offset),
      reinterpret_cast<int32_t*>(region + a->ntok_offset), (int32_t)a->T);
  MOK_RETURN_IF_LAUNCH_FAILED();
  if (a->P > 1) {
    const int rc = mok_barrier(a->signal_bases, (int)a->rank, (int)a->P, a->counter, a->timeout_ns, (int)a->site,
                               a->status, stream);
    if (rc != MOK_OK) return rc;
  }
  return mok_build_schedule(a->ids_ptrs, a->ntok_ptrs, (int)a->P, (int)a->max_tokens, (int)a->K, (int)a->rank,
                            (int)a->L, (int)a->tile_rows, a->table, a->counts, a->offsets, a->scratch, a->status,
                            stream);
}
